"""SkyReels-V2 (T2V, I2V, diffusion forcing): ``SkyReelsV2Transformer3DModel``.

Blocks (diffusers 0.42.1): one list ``blocks`` of ``SkyReelsV2TransformerBlock``; the model calls each positionally
as ``block(hidden_states, encoder_hidden_states, timestep_proj, rotary_emb, causal_mask)`` and the block returns
``hidden_states`` alone (pattern 2). The model is Wan 2.1 with an fps embedding and diffusion forcing; the pipelines
use the Wan VAE, UMT5 and (I2V) CLIP vision features.
"""

from __future__ import annotations

from fastdit.models._lazy import LazyKwargs, tiny_image
from fastdit.models.base import BlockGroup, ForwardPattern, LatentLayout, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, SplitInput, SplitOutput
from fastdit.parallel.tp_shapes import wan_tp_plan

TRANSFORMER = "diffusers.models.transformers.transformer_skyreels_v2.SkyReelsV2Transformer3DModel"

_Z_DIM = 16  # the released Wan 2.1 VAE's channel count (WAN_LATENT_CHANNELS of the tiny one)
_IMAGE_DIM = 8  # width of the tiny CLIP vision tower
_TEXT_DIM = 32


def tiny_transformer(
    seed: int = 0, *, in_channels: int = _Z_DIM, image_dim: int | None = None, inject_sample_info: bool = False
):
    """A 3-block ``SkyReelsV2Transformer3DModel``; ``inject_sample_info`` adds the fps embedding (DF models)."""
    from diffusers import SkyReelsV2Transformer3DModel

    from fastdit.testing.components.encoders import build

    return build(
        SkyReelsV2Transformer3DModel,
        seed=seed,
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=in_channels,
        out_channels=_Z_DIM,
        text_dim=_TEXT_DIM,
        freq_dim=32,
        ffn_dim=32,
        num_layers=3,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
        image_dim=image_dim,
        inject_sample_info=inject_sample_info,
    )


def _common(seed: int) -> dict:
    from diffusers import UniPCMultistepScheduler

    from fastdit.testing.components.autoencoder_kl_wan import wan_components

    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=8.0)
    return wan_components(text_dim=_TEXT_DIM, scheduler=scheduler, seed=seed)


def tiny_skyreels_t2v(seed: int = 0):
    """A complete tiny ``SkyReelsV2Pipeline`` (text to video)."""
    from diffusers import SkyReelsV2Pipeline

    return SkyReelsV2Pipeline(transformer=tiny_transformer(seed), **_common(seed))


def tiny_skyreels_i2v(seed: int = 0):
    """A complete tiny ``SkyReelsV2ImageToVideoPipeline`` (CLIP image tokens + first-frame latents)."""
    from diffusers import SkyReelsV2ImageToVideoPipeline

    from fastdit.testing.components.clip_vision import clip_vision_model

    image_encoder, image_processor = clip_vision_model(hidden_size=_IMAGE_DIM, seed=seed)
    return SkyReelsV2ImageToVideoPipeline(
        # 16 noise + 4 mask + 16 first-frame latent channels.
        transformer=tiny_transformer(seed, in_channels=2 * _Z_DIM + 4, image_dim=_IMAGE_DIM),
        image_encoder=image_encoder,
        image_processor=image_processor,
        **_common(seed),
    )


def tiny_skyreels_df(seed: int = 0):
    """A complete tiny ``SkyReelsV2DiffusionForcingPipeline`` (per-frame timesteps, fps embedding)."""
    from diffusers import SkyReelsV2DiffusionForcingPipeline

    return SkyReelsV2DiffusionForcingPipeline(
        transformer=tiny_transformer(seed, inject_sample_info=True), **_common(seed)
    )


_CALL = {
    "prompt": "a cat holding a sign",
    "negative_prompt": "blue",
    "height": 32,
    "width": 32,
    "num_frames": 5,
    "num_inference_steps": 2,
    "guidance_scale": 5.0,
    "max_sequence_length": 16,
}

# Context parallelism, as for Wan: the sequence only exists after patch_embedding + flatten inside forward, so the image
# tokens are split at the first block (called positionally); `rope`'s (cos, sin) tables (1, S, 1, D) cover the full
# latent grid and are split on dim 1 like the tokens. Diffusion forcing expands its per-frame timesteps inside forward
# to a per-token modulation (B, 6, S, D) that every block receives: it is split on dim 2 at each block (the per-sample
# one is 3-D and passes whole). Its block-causal mask (1, 1, S, S) stays global: context-parallel attention indexes it
# with every rank's shard. The same per-token timestep also shifts and scales `norm_out`'s output, so the sequence is
# gathered there, before that modulation, rather than at proj_out. The text is replicated. Unlike Wan's, this
# processor passes its parallel_config to the cross-attention calls too; the plan lists the cross-attention modules
# (`blocks.*.attn2`, no mask, no RoPE) as local, so they attend from the rank's image tokens to its own whole copy of
# the text instead of exchanging replicated keys.
CP_PLAN = ContextParallelPlan(
    inputs={
        "blocks.0": {"hidden_states": SplitInput(dim=1, expected_dims=3)},
        "blocks.*": {"temb": SplitInput(dim=2, expected_dims=4)},
    },
    outputs={"rope": (SplitOutput(dim=1, expected_dims=4, index=0), SplitOutput(dim=1, expected_dims=4, index=1))},
    gather={"norm_out": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(
        modules=("diffusers.models.transformers.transformer_skyreels_v2",), local=("blocks.*.attn2",)
    ),
    notes=(
        "RoPE tables from `rope` split on dim 1; tokens split at blocks.0, per-token modulation (diffusion forcing) at "
        "every block; gathered at norm_out; text replicated (cross-attention local)."
    ),
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
    ),
}

ADAPTER = register(
    ModelAdapter(
        family="skyreels_v2",
        fused_projections=FUSED_PROJECTIONS,
        # hidden_states is (batch, channels, frames, height, width). Its image-to-video models append their conditioning
        # channels (the first frame's latents, with a mask for some), which stay put from step to step: the filter over
        # all channels still follows the noisy ones, diluted.
        latent=LatentLayout(),
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="blocks", pattern=ForwardPattern.P2),),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        tiny_pipelines=(
            TinyPipeline(name="t2v", build=tiny_skyreels_t2v, call_kwargs=_CALL),
            TinyPipeline(name="i2v", build=tiny_skyreels_i2v, call_kwargs=LazyKwargs({**_CALL, "image": tiny_image()})),
            # 13 frames -> 4 latent frames in causal blocks of 2: attention gets a block-causal mask.
            TinyPipeline(
                name="df",
                build=tiny_skyreels_df,
                call_kwargs={**_CALL, "num_frames": 13, "base_num_frames": 13, "ar_step": 0, "causal_block_size": 2},
            ),
        ),
        presets=(
            ModelPreset(
                name="skyreels-v2-t2v",
                pipeline_class="diffusers.SkyReelsV2Pipeline",
                hub_id="Skywork/SkyReels-V2-T2V-14B-540P-Diffusers",
                defaults={
                    "num_inference_steps": 50,
                    "guidance_scale": 6.0,
                    "height": 544,
                    "width": 960,
                    "num_frames": 97,
                },
            ),
            ModelPreset(
                name="skyreels-v2-i2v",
                pipeline_class="diffusers.SkyReelsV2ImageToVideoPipeline",
                hub_id="Skywork/SkyReels-V2-I2V-14B-540P-Diffusers",
                defaults={
                    "num_inference_steps": 50,
                    "guidance_scale": 5.0,
                    "height": 544,
                    "width": 960,
                    "num_frames": 97,
                },
            ),
            ModelPreset(
                name="skyreels-v2-df",
                pipeline_class="diffusers.SkyReelsV2DiffusionForcingPipeline",
                hub_id="Skywork/SkyReels-V2-DF-14B-540P-Diffusers",
                defaults={
                    "num_inference_steps": 30,
                    "guidance_scale": 6.0,
                    "height": 544,
                    "width": 960,
                    "num_frames": 97,
                    "ar_step": 5,
                    "causal_block_size": 5,
                },
            ),
        ),
        notes=(
            "Wan-like: RoPE from the latent shape inside forward, CLIP image tokens prepended to the text (I2V). "
            "Diffusion forcing passes per-frame timesteps (temb (B, 6, S, D), split it with the hidden states under "
            "context parallelism) and a block-causal attention mask over frames (S x S: reorder, never split); the "
            "DF pipeline also rewrites the transformer config (num_frame_per_block) at call time."
        ),
    )
)
