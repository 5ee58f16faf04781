"""ChronoEdit (image editing as a short video, Wan 2.1 I2V architecture): ``ChronoEditTransformer3DModel``.

Blocks (diffusers 0.42.1): one list, ``blocks`` (40 Wan-style ``WanTransformerBlock``), called positionally with
``(hidden_states, encoder_hidden_states, temb, rotary_emb)`` and returning the hidden states alone (pattern 2). The
encoder stream is ``[CLIP image tokens | UMT5 text tokens]``, only read by cross-attention. Nothing runs between
blocks.
"""

from __future__ import annotations

from fastdit.models._lazy import LazyKwargs, tiny_image
from fastdit.models.base import BlockGroup, ForwardPattern, LatentLayout, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan_shapes import wan_blocks_plan
from fastdit.parallel.tp_shapes import wan_tp_plan

TRANSFORMER = "diffusers.models.transformers.transformer_chronoedit.ChronoEditTransformer3DModel"

_LATENT_CHANNELS = 4
_TEXT_DIM = 32
_IMAGE_DIM = 8


def tiny_transformer(seed: int = 0, *, num_layers: int = 3):
    """A 3-block ``ChronoEditTransformer3DModel`` (2 heads x 16) on noise + condition latents + a 4-channel mask."""
    from diffusers import ChronoEditTransformer3DModel

    from fastdit.testing.components.encoders import build

    return build(
        ChronoEditTransformer3DModel,
        seed=seed,
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=2 * _LATENT_CHANNELS + 4,
        out_channels=_LATENT_CHANNELS,
        text_dim=_TEXT_DIM,
        freq_dim=32,
        ffn_dim=64,
        num_layers=num_layers,
        image_dim=_IMAGE_DIM,
        added_kv_proj_dim=32,
        rope_max_seq_len=64,
    )


def tiny_chronoedit(seed: int = 0):
    """A complete tiny ``ChronoEditPipeline`` (UMT5 + CLIP vision encoders, Wan VAE, flow UniPC)."""
    from diffusers import ChronoEditPipeline, UniPCMultistepScheduler

    from fastdit.testing.components.autoencoder_kl_wan import autoencoder_kl_wan
    from fastdit.testing.components.clip_vision import clip_vision_model
    from fastdit.testing.components.encoders import umt5_encoder

    text_encoder, tokenizer = umt5_encoder(d_model=_TEXT_DIM, seed=seed)
    image_encoder, image_processor = clip_vision_model(hidden_size=_IMAGE_DIM, seed=seed)
    # A multistep scheduler: temporal reasoning trims its stored model outputs when it drops the middle frames.
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0)
    return ChronoEditPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        image_encoder=image_encoder,
        image_processor=image_processor,
        transformer=tiny_transformer(seed),
        vae=autoencoder_kl_wan(latent_channels=_LATENT_CHANNELS, seed=seed),
        scheduler=scheduler,
    )


# Context parallelism, as for Wan: the sequence only exists after patch_embedding + flatten inside forward, so the image
# tokens are split at the first block (called positionally). `rope` returns (cos, sin) tables (1, S, 1, D) for the
# full latent grid (its two-frame temporal skip included): both are split on dim 1 like the tokens. A per-token
# timestep (B, S), which this forward accepts like Wan 2.2's, is split at the root so its modulation matches the split
# tokens; the pipeline's per-sample timestep is 1-D and passes whole. The [CLIP image | text] context is not split:
# self-attention is context-parallel, and both cross-attention calls (the processor passes parallel_config=None for
# them) attend from local image tokens to the whole context on every rank.
CP_PLAN = wan_blocks_plan(
    "diffusers.models.transformers.transformer_chronoedit",
    notes="RoPE tables from `rope` split on dim 1; tokens split at blocks.0; the encoder context is replicated.",
)

TP_PLAN = wan_tp_plan(
    "blocks",
    notes=(
        "Wan's plan: attention by heads, QK-norms over the inner dim as ShardedNorm; FFN split; "
        "modulation tables whole."
    ),
)

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "blocks": (
        ("attn1.to_q", "attn1.to_k", "attn1.to_v"),
        ("attn2.to_k", "attn2.to_v"),
        ("attn2.add_k_proj", "attn2.add_v_proj"),
    ),
}

ADAPTER = register(
    ModelAdapter(
        family="chronoedit",
        fused_projections=FUSED_PROJECTIONS,
        # hidden_states is (batch, channels, frames, height, width). The input image's latents and mask are appended
        # as channels and stay put from step to step: they dilute the signal.
        latent=LatentLayout(),
        # CFG as two unannounced calls per step, each output used only after both: paired by timestep.
        cfg_pairs_by_timestep=True,
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="blocks", pattern=ForwardPattern.P2),),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        tiny_pipelines=(
            TinyPipeline(
                name="edit",
                build=tiny_chronoedit,
                # guidance_scale > 1: a cond then an uncond transformer call per step, without cache contexts.
                call_kwargs=LazyKwargs(
                    {
                        "image": tiny_image(),
                        "prompt": "a cat holding a sign",
                        "negative_prompt": "blue",
                        "guidance_scale": 5.0,
                        "height": 32,
                        "width": 32,
                        "num_inference_steps": 2,
                        "max_sequence_length": 16,
                    }
                ),
            ),
        ),
        presets=(
            ModelPreset(
                name="chronoedit",
                pipeline_class="diffusers.ChronoEditPipeline",
                hub_id="nvidia/ChronoEdit-14B-Diffusers",
                defaults={"num_inference_steps": 50, "guidance_scale": 5.0, "num_frames": 5},
            ),
        ),
        notes=(
            "Wan 2.1 I2V layout: 3-D RoPE computed from hidden_states.shape inside forward, CLIP image tokens "
            "prepended to the text for cross-attention. With enable_temporal_reasoning the pipeline drops the middle "
            "latent frames after num_temporal_reasoning_steps, so the sequence length changes mid-run (a cache must "
            "not read that as a new run). CFG is two calls per step without cache contexts."
        ),
    )
)
