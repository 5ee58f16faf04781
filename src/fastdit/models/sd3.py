"""Stable Diffusion 3 / 3.5 (Medium, Large, Large Turbo): ``SD3Transformer2DModel``.

Blocks (diffusers 0.42.1): one list, ``transformer_blocks``, of MMDiT ``JointTransformerBlock``s. Each is called by
keyword with ``(hidden_states, encoder_hidden_states, temb, joint_attention_kwargs)`` and returns
``(encoder_hidden_states, hidden_states)`` (pattern 1). The last block is built with ``context_pre_only=True`` and
returns ``None`` for the encoder stream. SD3.5 Medium (MMDiT-X) adds a second, image-only attention inside the first
blocks (``dual_attention_layers``) without changing the call.
"""

from __future__ import annotations

from fastdit.models.base import (
    BlockGroup,
    ForwardPattern,
    LatentLayout,
    ModelAdapter,
    ModelPreset,
    StepInvariant,
    TinyPipeline,
)
from fastdit.models.registry import register
from fastdit.parallel.plan_shapes import joint_first_block_plan
from fastdit.parallel.tp_plan import TensorParallelPlan
from fastdit.parallel.tp_shapes import attention, feed_forward, joint_attention, modulation, under

TRANSFORMER = "diffusers.models.transformers.transformer_sd3.SD3Transformer2DModel"

# The pipeline concatenates the two CLIP hidden states on the feature axis and zero-pads them to the T5 width, so
# CLIP_DIM * 2 <= T5_DIM == joint_attention_dim; the pooled projections are concatenated as well.
_CLIP_DIM = 16
_T5_DIM = 32


def tiny_transformer(seed: int = 0, *, sd35: bool = False):
    """A 3-block ``SD3Transformer2DModel`` (SD3.5 Medium layout when ``sd35``: QK RMSNorm and dual attention)."""
    from diffusers import SD3Transformer2DModel

    from fastdit.testing.components.encoders import build

    return build(
        SD3Transformer2DModel,
        seed=seed,
        sample_size=16,
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=3,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=_T5_DIM,
        caption_projection_dim=32,
        pooled_projection_dim=2 * _CLIP_DIM,
        pos_embed_max_size=16,
        dual_attention_layers=(0, 1) if sd35 else (),
        qk_norm="rms_norm" if sd35 else None,
    )


def _pipeline(seed: int, *, sd35: bool):
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    from fastdit.testing.components.autoencoder_kl import autoencoder_kl
    from fastdit.testing.components.encoders import clip_text_model_with_projection, t5_encoder

    text_encoder, tokenizer = clip_text_model_with_projection(_CLIP_DIM, _CLIP_DIM, seed=seed)
    text_encoder_2, tokenizer_2 = clip_text_model_with_projection(_CLIP_DIM, _CLIP_DIM, seed=seed + 1)
    text_encoder_3, tokenizer_3 = t5_encoder(d_model=_T5_DIM, seed=seed + 2)
    return StableDiffusion3Pipeline(
        transformer=tiny_transformer(seed, sd35=sd35),
        vae=autoencoder_kl(latent_channels=4, scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
    )


def tiny_sd3(seed: int = 0):
    """A complete tiny ``StableDiffusion3Pipeline`` (SD3 Medium layout)."""
    return _pipeline(seed, sd35=False)


def tiny_sd35(seed: int = 0):
    """A complete tiny ``StableDiffusion3Pipeline`` (SD3.5 Medium layout: QK norm, dual attention)."""
    return _pipeline(seed, sd35=True)


# forward builds the image sequence itself (patch embedding with a learned position table cropped to the latent
# size), so the split is at the first block's inputs, after the positions are added. The joint attention
# concatenates [image, text] per rank without a mask or RoPE, so any split of either stream is exact.
# JointAttnProcessor2_0 calls F.scaled_dot_product_attention itself: its module's F is routed.
CP_PLAN = joint_first_block_plan(
    "transformer_blocks.0",
    sdpa_modules=("diffusers.models.attention_processor",),
    notes="Learned position table added in the patch embedding before the split at transformer_blocks.0; no RoPE.",
)

# Tensor parallelism: JointAttnProcessor2_0 views q/k/v (and the text stream's add_*_proj) with attn.heads, so the
# heads are divided and both streams' projections split by heads; to_out / to_add_out and both FFNs' down projections
# are row-wise. The per-block AdaLN linears (dim -> 6·dim, 9·dim with dual attention; the last block's context norm
# is dim -> 2·dim but shares the pattern) are split with a gathered output. The QK RMSNorms are per head.
# SD3.5 Medium's image-only `attn2` (its first blocks only; none in SD3) runs the same processor without a text
# stream: split by heads like `attn`, its patterns and heads optional.
_DUAL = attention("attn2")
TP_PLAN = TensorParallelPlan(
    layers=under(
        "transformer_blocks.*",
        {
            **joint_attention(),
            **_DUAL,
            **feed_forward(),
            **feed_forward("ff_context"),
            **modulation("norm1.linear", "norm1_context.linear"),
        },
    ),
    divide=("transformer_blocks.*.attn.heads", "transformer_blocks.*.attn2.heads"),
    optional=(*under("transformer_blocks.*", _DUAL), "transformer_blocks.*.attn2"),
    notes="Joint attention, SD3.5 Medium's dual attention (attn2) and both FFNs split by heads; per-block AdaLN "
    "split with a gathered output; QK-norms per head (replicated).",
    # SD3.5 Large has 38 heads: tp=4 or 8 split the FFNs and the modulation only (attention whole).
    fallback=TensorParallelPlan(
        layers=under(
            "transformer_blocks.*",
            {**feed_forward(), **feed_forward("ff_context"), **modulation("norm1.linear", "norm1_context.linear")},
        ),
        notes="FFNs and modulation only: tp does not divide the heads.",
        name="ffn-only",
    ),
)

_CALL = {
    "prompt": "a cat holding a sign",
    "height": 32,
    "width": 32,
    "num_inference_steps": 2,
    "guidance_scale": 5.0,
    "max_sequence_length": 16,
}

# The pipeline passes the same prompt embeddings at every step (batched CFG's cat([negative, prompt]) is done once
# before the loop; skip-layer guidance's extra call passes the un-batched embeddings, also made once): the text
# projection repeats. Not `pos_embed`: the patch embedding of the latent.
STEP_INVARIANT = (StepInvariant("context_embedder", inputs=("encoder_hidden_states",)),)

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "transformer_blocks": (
        ("attn.to_q", "attn.to_k", "attn.to_v"),
        ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    ),
}

ADAPTER = register(
    ModelAdapter(
        family="sd3",
        fused_projections=FUSED_PROJECTIONS,
        # hidden_states is (batch, channels, height, width).
        latent=LatentLayout(),
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="transformer_blocks", pattern=ForwardPattern.P1),),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        step_invariant=STEP_INVARIANT,
        tiny_pipelines=(
            TinyPipeline(name="sd3", build=tiny_sd3, call_kwargs=_CALL),
            TinyPipeline(name="sd3.5-medium", build=tiny_sd35, call_kwargs=_CALL),
        ),
        presets=(
            ModelPreset(
                name="sd3",
                pipeline_class="diffusers.StableDiffusion3Pipeline",
                hub_id="stabilityai/stable-diffusion-3-medium-diffusers",
                defaults={"num_inference_steps": 28, "guidance_scale": 7.0, "height": 1024, "width": 1024},
            ),
            ModelPreset(
                name="sd3.5-medium",
                pipeline_class="diffusers.StableDiffusion3Pipeline",
                hub_id="stabilityai/stable-diffusion-3.5-medium",
                defaults={"num_inference_steps": 40, "guidance_scale": 4.5, "height": 1024, "width": 1024},
            ),
            ModelPreset(
                name="sd3.5-large",
                pipeline_class="diffusers.StableDiffusion3Pipeline",
                hub_id="stabilityai/stable-diffusion-3.5-large",
                defaults={"num_inference_steps": 28, "guidance_scale": 3.5, "height": 1024, "width": 1024},
            ),
            ModelPreset(
                name="sd3.5-large-turbo",
                pipeline_class="diffusers.StableDiffusion3Pipeline",
                hub_id="stabilityai/stable-diffusion-3.5-large-turbo",
                defaults={"num_inference_steps": 4, "guidance_scale": 0.0, "height": 1024, "width": 1024},
            ),
        ),
        notes=(
            "The last block returns None for the encoder stream (context_pre_only). CFG is batched (one forward per "
            "step), but skip-layer guidance (`skip_guidance_layers`, SD3.5 Medium) adds a second forward per step "
            "with batch 1 (not 2) and `skip_layers` that leaves out blocks, and no cache_context: a cache must give "
            "it its own state. ControlNet residuals are added between blocks. Positions are a learned table "
            "cropped to the latent size, no RoPE and no attention mask. Under context parallelism the sequence is "
            "split at the first block, so skip-layer guidance must not skip block 0 and ControlNet residuals "
            "(full-length) are not supported."
        ),
    )
)
