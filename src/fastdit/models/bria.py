"""Bria 3.x (text-to-image): ``BriaTransformer2DModel`` (a FLUX.1-style MMDiT without pooled or guidance embeddings).

Blocks (diffusers 0.42.1): dual-stream ``transformer_blocks`` and single-stream ``single_transformer_blocks``; both
are called by keyword with ``(hidden_states, encoder_hidden_states, temb, image_rotary_emb, attention_kwargs)`` and
return ``(encoder_hidden_states, hidden_states)`` (pattern 1): the single block concatenates ``[text, image]``
itself and splits the result again.
"""

from __future__ import annotations

from fastdit.models.base import BlockGroup, ForwardPattern, ModelAdapter, ModelPreset, StepInvariant, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan_shapes import mmdit_root_plan
from fastdit.parallel.tp_shapes import flux1_tp_plan

TRANSFORMER = "diffusers.models.transformers.transformer_bria.BriaTransformer2DModel"

_LATENT_CHANNELS = 4
_TEXT_DIM = 32


def tiny_transformer(seed: int = 0):
    """A 3-block ``BriaTransformer2DModel`` (1 dual + 2 single, 2 heads x 16) for 2x2-packed 4-channel latents."""
    from diffusers import BriaTransformer2DModel

    from fastdit.testing.components.encoders import build

    return build(
        BriaTransformer2DModel,
        seed=seed,
        patch_size=1,
        in_channels=4 * _LATENT_CHANNELS,
        num_layers=1,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=_TEXT_DIM,
        axes_dims_rope=[4, 6, 6],
    )


def tiny_bria(seed: int = 0):
    """A complete tiny ``BriaPipeline`` (T5 text encoder, two-level ``AutoencoderKL``)."""
    from diffusers import BriaPipeline, FlowMatchEulerDiscreteScheduler

    from fastdit.testing.components.autoencoder_kl import autoencoder_kl
    from fastdit.testing.components.encoders import t5_encoder

    text_encoder, tokenizer = t5_encoder(d_model=_TEXT_DIM, seed=seed + 1)
    return BriaPipeline(
        transformer=tiny_transformer(seed),
        scheduler=FlowMatchEulerDiscreteScheduler(),
        # The pipeline's vae_scale_factor is 2 ** levels (twice the VAE's own), which its 2x2 packing compensates.
        vae=autoencoder_kl(latent_channels=_LATENT_CHANNELS, shift_factor=0.0, use_quant_conv=False, seed=seed),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
    )


# Context parallelism: FLUX.1's shape — the forward is "embed, loop over blocks, project out", token-wise outside
# attention, so the root's streams and their position ids (cat(txt_ids, img_ids) builds the RoPE inside forward) are
# split on their token dims; each rank's joint sequence is [text_r, image_r]. No attention mask.
CP_PLAN = mmdit_root_plan(
    "diffusers.models.transformers.transformer_bria",
    notes="RoPE from img_ids/txt_ids, split on their sequence dim with the streams: no RoPE patch needed.",
)

# Tensor parallelism: FLUX.1's split (the processor reshapes with attn.heads, divided; QK-norms per head, replicated),
# with the per-block AdaLN linears (dim -> 6·dim per stream and dual block, dim -> 3·dim per single block) split with
# a gathered output. The single block's proj_out reads cat([attn_out, mlp_hidden]): each part is split on its own.
TP_PLAN = flux1_tp_plan(
    notes="FLUX.1's split plus per-block AdaLN modulation split with a gathered output; QK-norms (per head) "
    "replicated.",
)

# The pipeline passes the same position ids and prompt embeddings at every step: the rotary table (computed in forward
# from cat(txt_ids, img_ids)) and the text projection repeat. Both are keyed on the transformer's arguments, which
# context parallelism splits beneath the lookup (a new shard every call).
STEP_INVARIANT = (
    StepInvariant("pos_embed", inputs=("txt_ids", "img_ids")),
    StepInvariant("context_embedder", inputs=("encoder_hidden_states",)),
)

_CALL = {
    "prompt": "a cat holding a sign",
    "negative_prompt": "blurry",
    "height": 32,
    "width": 32,
    "num_inference_steps": 2,
    "guidance_scale": 5.0,
    "max_sequence_length": 16,
}

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "transformer_blocks": (
        ("attn.to_q", "attn.to_k", "attn.to_v"),
        ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    ),
    "single_transformer_blocks": (("proj_mlp", "attn.to_q", "attn.to_k", "attn.to_v"),),
}

ADAPTER = register(
    ModelAdapter(
        family="bria",
        fused_projections=FUSED_PROJECTIONS,
        transformer_classes=(TRANSFORMER,),
        block_groups=(
            BlockGroup(path="transformer_blocks", pattern=ForwardPattern.P1),
            BlockGroup(path="single_transformer_blocks", pattern=ForwardPattern.P1),
        ),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        step_invariant=STEP_INVARIANT,
        tiny_pipelines=(TinyPipeline(name="bria", build=tiny_bria, call_kwargs=_CALL),),
        presets=(
            ModelPreset(
                name="bria-3.2",
                pipeline_class="diffusers.BriaPipeline",
                hub_id="briaai/BRIA-3.2",
                defaults={"num_inference_steps": 30, "guidance_scale": 5.0, "height": 1024, "width": 1024},
            ),
        ),
        notes=(
            "FLUX.1's layout without pooled projections or guidance embedding; prompts are zero-padded T5 "
            "embeddings, no attention mask. CFG is batched ([uncond, cond] in one call), no cache contexts. "
            "ControlNet residuals (`controlnet_block_samples`) are not covered by the context-parallel plan: "
            "diffusers 0.42.1 ships no Bria ControlNet pipeline."
            " No spectral signal: the latent arrives packed into a token sequence (batch, tokens, channels): no grid "
            "to filter."
        ),
    )
)
