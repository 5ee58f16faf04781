"""CogView4 and CogView4-Control: ``CogView4Transformer2DModel``.

Blocks (diffusers 0.42.1): one list, ``transformer_blocks`` (28 ``CogView4TransformerBlock``), called positionally
with ``(hidden_states, encoder_hidden_states, temb, image_rotary_emb, attention_mask, attention_kwargs)``; each
returns ``(hidden_states, encoder_hidden_states)`` (pattern 0). Text and image tokens are concatenated inside each
block's attention; nothing runs between blocks.
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
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, SplitInput, SplitOutput
from fastdit.parallel.plan_shapes import streams
from fastdit.parallel.tp_plan import TensorParallelPlan
from fastdit.parallel.tp_shapes import attention, feed_forward, modulation, under

TRANSFORMER = "diffusers.models.transformers.transformer_cogview4.CogView4Transformer2DModel"

_LATENT_CHANNELS = 16


def tiny_transformer(seed: int = 0, *, num_layers: int = 3, in_channels: int = _LATENT_CHANNELS):
    """A 3-block ``CogView4Transformer2DModel`` (2 heads x 16, GLM width 32)."""
    from diffusers import CogView4Transformer2DModel

    from fastdit.testing.components.encoders import build

    return build(
        CogView4Transformer2DModel,
        seed=seed,
        patch_size=2,
        in_channels=in_channels,
        out_channels=_LATENT_CHANNELS,
        num_layers=num_layers,
        attention_head_dim=16,
        num_attention_heads=2,
        text_embed_dim=32,
        time_embed_dim=16,
        condition_dim=8,
        pos_embed_max_size=16,
        sample_size=16,
        rope_axes_dim=(16, 16),
    )


def _components(seed: int, in_channels: int) -> dict:
    from diffusers import FlowMatchEulerDiscreteScheduler

    from fastdit.testing.components.autoencoder_kl import autoencoder_kl
    from fastdit.testing.components.glm import glm_model

    text_encoder, tokenizer = glm_model(seed=seed)
    return {
        "tokenizer": tokenizer,
        "text_encoder": text_encoder,
        "vae": autoencoder_kl(latent_channels=_LATENT_CHANNELS, num_levels=2, scaling_factor=1.0, seed=seed),
        "transformer": tiny_transformer(seed, in_channels=in_channels),
        # CogView4 checkpoints ship a time-shifted flow-matching schedule with dynamic shifting.
        "scheduler": FlowMatchEulerDiscreteScheduler(
            base_shift=0.25, max_shift=0.75, base_image_seq_len=256, use_dynamic_shifting=True, time_shift_type="linear"
        ),
    }


def tiny_cogview4(seed: int = 0):
    """A complete tiny ``CogView4Pipeline`` (GLM text encoder, 16-channel KL VAE with scale factor 2)."""
    from diffusers import CogView4Pipeline

    return CogView4Pipeline(**_components(seed, _LATENT_CHANNELS))


# guidance_scale > 1 turns on CFG: two transformer calls per step ("cond" then "uncond" cache contexts).
_CALL = {
    "prompt": "a cat holding a sign",
    "negative_prompt": "blue",
    "guidance_scale": 5.0,
    "height": 32,
    "width": 32,
    "num_inference_steps": 2,
    "max_sequence_length": 16,
}

# The patch embedding returns the two streams and forward builds the image RoPE (cos, sin) from hidden_states.shape,
# so the streams are split at the first block's inputs and the RoPE tables at the rope module's output (or at the
# root when a caller passes them). The joint attention concatenates [text, image] per rank and rotates the image part
# by the local text length; the pipeline passes no attention mask, so any split is exact. CogView4AttnProcessor calls
# F.scaled_dot_product_attention itself: its module's F is routed.
CP_PLAN = ContextParallelPlan(
    inputs={
        "": {"image_rotary_emb": SplitInput(dim=0, expected_dims=2)},
        "transformer_blocks.0": streams(),
    },
    outputs={"rope": (SplitOutput(dim=0, expected_dims=2, index=0), SplitOutput(dim=0, expected_dims=2, index=1))},
    gather={"proj_out": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(sdpa_modules=("diffusers.models.transformers.transformer_cogview4",)),
    notes="Image RoPE (cos, sin) split at the rope module's output with the tokens (split at transformer_blocks.0).",
)

# Tensor parallelism: CogView4AttnProcessor unflattens q/k/v into (attn.heads, -1), so attn1.heads is divided and
# q/k/v split by heads (to_out row-wise); its QK-norms are per-head LayerNorms and the image RoPE rotates each head
# alike (both replicated). The one FFN, run on each stream in turn, is split by hidden size. The per-block AdaLN linear
# (time_embed_dim -> 12·dim) is split with a gathered output; embedders, RoPE and the final norm stay whole.
TP_PLAN = TensorParallelPlan(
    layers=under("transformer_blocks.*", {**attention("attn1"), **feed_forward(), **modulation("norm1.linear")}),
    divide=("transformer_blocks.*.attn1.heads",),
    notes="Attention split by heads, the shared-stream FFN by hidden size; per-block AdaLN (12·dim) split with a "
    "gathered output; QK-norms per head.",
)

# The pipeline passes the same prompt embeddings at every step, the cond call its own and the uncond call the
# negative ones (both encoded once before the loop): the text half of the patch embedding (`patch_embed.text_proj`,
# applied to `encoder_hidden_states` as passed) repeats. Not `patch_embed` itself (it embeds the latent too), `rope`
# (computed from the latent, a new tensor every step) nor `time_condition_embed` (the timestep).
STEP_INVARIANT = (StepInvariant("patch_embed.text_proj", inputs=("encoder_hidden_states",)),)

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "transformer_blocks": (("attn1.to_q", "attn1.to_k", "attn1.to_v"),),
}

ADAPTER = register(
    ModelAdapter(
        family="cogview4",
        fused_projections=FUSED_PROJECTIONS,
        # hidden_states is (batch, channels, height, width).
        latent=LatentLayout(),
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="transformer_blocks", pattern=ForwardPattern.P0),),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        step_invariant=STEP_INVARIANT,
        # No tiny Control pipeline: it samples the control latents with the global RNG (latent_dist.sample()
        # without the caller's generator), so two seeded runs differ.
        tiny_pipelines=(TinyPipeline(name="cogview4", build=tiny_cogview4, call_kwargs=_CALL),),
        presets=(
            ModelPreset(
                name="cogview4",
                pipeline_class="diffusers.CogView4Pipeline",
                hub_id="THUDM/CogView4-6B",
                defaults={"num_inference_steps": 50, "guidance_scale": 3.5, "height": 1024, "width": 1024},
            ),
            ModelPreset(
                name="cogview4-control",
                pipeline_class="diffusers.CogView4ControlPipeline",
                hub_id="THUDM/CogView4-6B-Control",
                defaults={"num_inference_steps": 50, "guidance_scale": 3.5},
            ),
        ),
        notes=(
            "RoPE is computed from hidden_states.shape inside forward (interpolated onto a fixed rope_axes_dim grid) "
            "and covers image tokens only; text tokens are left-padded to a multiple of 16 with no attention mask. "
            "CFG runs two transformer calls per step (cond/uncond). Under context parallelism an `attention_mask` "
            "(text padding) is not supported: the processor builds it over the local tokens only."
        ),
    )
)
