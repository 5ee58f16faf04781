"""LTX-Video (0.9.x: T2V, I2V, conditioning): ``LTXVideoTransformer3DModel``.

Blocks (diffusers 0.42.1): one list ``transformer_blocks`` of ``LTXVideoTransformerBlock``; the model calls each by
keyword as ``block(hidden_states=..., encoder_hidden_states=..., temb=..., image_rotary_emb=...,
encoder_attention_mask=...)`` and the block returns ``hidden_states`` alone (pattern 2): text enters through
cross-attention only.
"""

from __future__ import annotations

from fastdit.models._lazy import LazyKwargs, tiny_image
from fastdit.models.base import BlockGroup, ForwardPattern, ModelAdapter, ModelPreset, StepInvariant, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, SplitInput, SplitOutput
from fastdit.parallel.tp_plan import LocalSlice, ShardedNorm, TensorParallelPlan
from fastdit.parallel.tp_shapes import attention, feed_forward, under

TRANSFORMER = "diffusers.models.transformers.transformer_ltx.LTXVideoTransformer3DModel"

_LATENT = 8
_TEXT_DIM = 32


def tiny_transformer(seed: int = 0):
    """A 3-block ``LTXVideoTransformer3DModel`` (patch 1: one token per latent voxel, as the real model)."""
    from diffusers import LTXVideoTransformer3DModel

    from fastdit.testing.components.encoders import build

    return build(
        LTXVideoTransformer3DModel,
        seed=seed,
        in_channels=_LATENT,
        out_channels=_LATENT,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=2,
        attention_head_dim=16,
        cross_attention_dim=32,
        num_layers=3,
        caption_channels=_TEXT_DIM,
    )


def _components(seed: int) -> dict:
    from diffusers import FlowMatchEulerDiscreteScheduler

    from fastdit.testing.components.autoencoder_kl_ltx import autoencoder_kl_ltx_video
    from fastdit.testing.components.encoders import t5_encoder

    text_encoder, tokenizer = t5_encoder(d_model=_TEXT_DIM, seed=seed)
    return {
        "transformer": tiny_transformer(seed),
        "vae": autoencoder_kl_ltx_video(latent_channels=_LATENT, seed=seed),
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "scheduler": FlowMatchEulerDiscreteScheduler(),
    }


def tiny_ltx(seed: int = 0):
    """A complete tiny ``LTXPipeline`` (text to video)."""
    from diffusers import LTXPipeline

    return LTXPipeline(**_components(seed))


def tiny_ltx_i2v(seed: int = 0):
    """A complete tiny ``LTXImageToVideoPipeline`` (the first latent frame is the encoded image, timestep 0)."""
    from diffusers import LTXImageToVideoPipeline

    return LTXImageToVideoPipeline(**_components(seed))


def tiny_ltx_condition(seed: int = 0):
    """A complete tiny ``LTXConditionPipeline`` (image/video conditions at chosen frames, LTX-Video 0.9.5+)."""
    from diffusers import LTXConditionPipeline

    return LTXConditionPipeline(**_components(seed))


# Context parallelism: latents arrive packed (B, S, C) and forward is "project in, blocks, project out", so the root
# inputs are split. `rope` builds its (cos, sin) tables (B, S, D) from num_frames/height/width or the condition
# pipeline's video_coords, i.e. for the full sequence: both are split on dim 1 like the tokens. The I2V / condition
# per-token timestep (B, S) is split with the tokens (temb and the output modulation are per token; a per-sample
# timestep is 1-D and passes whole). Every attention processor is routed, cross-attention included, so the text and
# its padding mask are split too: the cross-attention exchange then reassembles the whole text once per call instead
# of every rank attending to duplicated keys; the processor's key mask over the local text is all-gathered.
CP_PLAN = ContextParallelPlan(
    inputs={
        "": {
            "hidden_states": SplitInput(dim=1, expected_dims=3),
            "encoder_hidden_states": SplitInput(dim=1, expected_dims=3),
            "encoder_attention_mask": SplitInput(dim=1, expected_dims=2),
            "timestep": SplitInput(dim=1, expected_dims=2),
        }
    },
    outputs={"rope": (SplitOutput(dim=1, expected_dims=3, index=0), SplitOutput(dim=1, expected_dims=3, index=1))},
    gather={"proj_out": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(modules=("diffusers.models.transformers.transformer_ltx",)),
    notes="Root split of tokens, per-token timestep, text and text mask; RoPE tables from `rope` split on dim 1.",
)

# Tensor parallelism. LTXVideoAttnProcessor applies the QK-norms and RoPE to the flattened q/k (all heads) before
# unflattening them with ``attn.heads`` (divided; prepare_attention_mask repeats the text mask by it too). The
# QK-norms are RMSNorms over the whole inner dim ("rms_norm_across_heads"), so they become ShardedNorms; the `rope`
# module returns (cos, sin) of (B, S, inner_dim) over every head's features, so each rank keeps its slice of the
# last dim (LocalSlice), which lines up with its column-wise q/k features. Self- and cross-attention (attn1, attn2)
# split by heads, q/k/v column-wise and out row-wise; the GELU FFN up column-wise, down row-wise. Modulation is one
# shared AdaLayerNormSingle (time_embed) plus a small per-block scale_shift_table: both replicated, like the patch
# and caption projections, norm_out and proj_out.
TP_PLAN = TensorParallelPlan(
    layers={
        "rope": LocalSlice(dim=-1),
        **under(
            "transformer_blocks.*",
            {
                **attention("attn1"),
                **attention("attn2"),
                **{f"{attn}.{norm}": ShardedNorm() for attn in ("attn1", "attn2") for norm in ("norm_q", "norm_k")},
                **feed_forward("ff"),
            },
        ),
    },
    divide=("transformer_blocks.*.attn1.heads", "transformer_blocks.*.attn2.heads"),
    notes="Self- and cross-attention split by heads (QK-norms across heads sharded, RoPE tables sliced to the local "
    "features), GELU FFN split; shared AdaLN-single and per-block tables replicated.",
)

# The pipelines pass the same prompt embeddings (batched CFG's cat([negative, prompt]) is done once before the loop),
# the same latent grid size and rope_interpolation_scale, or the condition pipeline's video_coords (built once before
# the loop), at every step: the RoPE tables and the caption projection repeat. `rope` reads the latent only for its
# batch size and device (its own arguments match by shape, dtype and device besides); both are keyed on the
# transformer's arguments, which context parallelism splits beneath the lookup (a new shard every call; the split of
# the tables, and tensor parallelism's slice of them, run on the module's output, around the lookup). Not
# `time_embed` (the per-sample or per-token timestep) nor `proj_in` (the latent).
STEP_INVARIANT = (
    StepInvariant("rope", inputs=("num_frames", "height", "width", "rope_interpolation_scale", "video_coords")),
    StepInvariant("caption_projection", inputs=("encoder_hidden_states",)),
)

_CALL = {
    "prompt": "a cat holding a sign",
    "negative_prompt": "blue",
    "height": 32,
    "width": 32,
    "num_frames": 9,  # 8k+1 frames -> k+1 latent frames
    "num_inference_steps": 2,
    "guidance_scale": 3.0,
    "max_sequence_length": 16,
}

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "transformer_blocks": (
        ("attn1.to_q", "attn1.to_k", "attn1.to_v"),
        ("attn2.to_k", "attn2.to_v"),
    ),
}

ADAPTER = register(
    ModelAdapter(
        family="ltx",
        fused_projections=FUSED_PROJECTIONS,
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="transformer_blocks", pattern=ForwardPattern.P2),),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        step_invariant=STEP_INVARIANT,
        tiny_pipelines=(
            TinyPipeline(name="t2v", build=tiny_ltx, call_kwargs=_CALL),
            # Per-token timesteps with conditioning tokens at 0: the cache follows the largest entry.
            TinyPipeline(name="i2v", build=tiny_ltx_i2v, call_kwargs=LazyKwargs({**_CALL, "image": tiny_image()})),
            TinyPipeline(
                name="condition", build=tiny_ltx_condition, call_kwargs=LazyKwargs({**_CALL, "image": tiny_image()})
            ),
        ),
        presets=(
            ModelPreset(
                name="ltx-video",
                pipeline_class="diffusers.LTXPipeline",
                hub_id="Lightricks/LTX-Video",
                defaults={
                    "num_inference_steps": 50,
                    "guidance_scale": 3.0,
                    "height": 480,
                    "width": 704,
                    "num_frames": 161,
                },
            ),
            ModelPreset(
                name="ltx-video-i2v",
                pipeline_class="diffusers.LTXImageToVideoPipeline",
                hub_id="Lightricks/LTX-Video",
                defaults={
                    "num_inference_steps": 50,
                    "guidance_scale": 3.0,
                    "height": 480,
                    "width": 704,
                    "num_frames": 161,
                },
            ),
            ModelPreset(
                name="ltx-video-0.9.5",
                pipeline_class="diffusers.LTXConditionPipeline",
                hub_id="Lightricks/LTX-Video-0.9.5",
                defaults={
                    "num_inference_steps": 40,
                    "guidance_scale": 3.0,
                    "height": 512,
                    "width": 768,
                    "num_frames": 161,
                },
            ),
        ),
        notes=(
            "Latents arrive already packed (B, S, C); RoPE is computed in forward from num_frames/height/width or "
            "the condition pipeline's video_coords. I2V and condition pipelines pass a per-token timestep (B, S) "
            "whose conditioning tokens are 0 (temb per token: split it with the hidden states under context "
            "parallelism; read the step from the largest value). CFG is batched (one call per step)."
            " No spectral signal: the latent arrives packed into a token sequence (batch, tokens, channels): no grid "
            "to filter."
        ),
    )
)
