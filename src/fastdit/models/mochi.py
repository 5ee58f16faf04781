"""Mochi 1: ``MochiTransformer3DModel``.

Blocks (diffusers 0.42.1): one list ``transformer_blocks`` of ``MochiTransformerBlock``; the model calls each by
keyword as ``block(hidden_states=..., encoder_hidden_states=..., temb=..., encoder_attention_mask=...,
image_rotary_emb=...)`` and the block returns ``(hidden_states, encoder_hidden_states)`` (pattern 0). The last block
is built with ``context_pre_only=True``: it returns the encoder stream it was given, unchanged.
"""

from __future__ import annotations

from fastdit.models.base import BlockGroup, ForwardPattern, LatentLayout, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, SplitInput, SplitOutput
from fastdit.parallel.plan_shapes import streams
from fastdit.parallel.tp_plan import Colwise, LocalSlice, Rowwise, TensorParallelPlan
from fastdit.parallel.tp_shapes import attention, feed_forward, modulation, under

TRANSFORMER = "diffusers.models.transformers.transformer_mochi.MochiTransformer3DModel"

# The pipeline hard-codes 12 latent channels (its latent statistics) and the VAE factors 8 (space) and 6 (time).
_LATENT = 12
_TEXT_DIM = 32
_TEXT_LEN = 16


def tiny_transformer(seed: int = 0):
    """A 3-block ``MochiTransformer3DModel`` (patch 2, 2 heads of 24).

    Width 48 makes the SwiGLU width (8 · 48) // 3 = 128 even, so the FFN splits over 2 tensor-parallel ranks.
    """
    from diffusers import MochiTransformer3DModel

    from fastdit.testing.components.encoders import build

    return build(
        MochiTransformer3DModel,
        seed=seed,
        patch_size=2,
        num_attention_heads=2,
        attention_head_dim=24,
        num_layers=3,
        pooled_projection_dim=16,
        in_channels=_LATENT,
        text_embed_dim=_TEXT_DIM,
        time_embed_dim=8,
        max_sequence_length=_TEXT_LEN,
    )


def tiny_vae(seed: int = 0):
    """An ``AutoencoderKLMochi`` with 32 channels per level (space x8, time x6 as the real one).

    Only the innermost level keeps a ResNet layer and there is no attention: full-resolution 3-D convolutions
    dominate a tiny run otherwise.
    """
    from diffusers import AutoencoderKLMochi

    from fastdit.testing.components.encoders import build

    return build(
        AutoencoderKLMochi,
        seed=seed,
        # Its group norms have 32 groups: 32 channels is the least.
        encoder_block_out_channels=(32, 32, 32, 32),
        decoder_block_out_channels=(32, 32, 32, 32),
        latent_channels=_LATENT,
        layers_per_block=(0, 0, 0, 0, 1),
        add_attention_block=(False,) * 5,
    )


def tiny_mochi(seed: int = 0):
    """A complete tiny ``MochiPipeline`` (T5 text encoder, flow matching)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, MochiPipeline

    from fastdit.testing.components.encoders import t5_encoder

    text_encoder, tokenizer = t5_encoder(d_model=_TEXT_DIM, seed=seed)
    return MochiPipeline(
        transformer=tiny_transformer(seed),
        vae=tiny_vae(seed),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        scheduler=FlowMatchEulerDiscreteScheduler(),
    )


# Text stays split like the video: kept whole on every rank, its keys would count once per rank. The processor keeps
# each sample's valid text tokens, so the ranks' lengths inside attention depend on the mask: exchanged per call.
CP_PLAN = ContextParallelPlan(
    inputs={
        "transformer_blocks.0": streams(),
        "transformer_blocks.*": {"encoder_attention_mask": SplitInput(dim=1, expected_dims=2)},
    },
    outputs={"rope": (SplitOutput(dim=0, expected_dims=3, index=0), SplitOutput(dim=0, expected_dims=3, index=1))},
    gather={"proj_out": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(sdpa_modules=("diffusers.models.attention_processor",), exchange_lengths=True),
    notes="Video and text tokens split at transformer_blocks.0, the prompt mask at every block; RoPE tables from "
    "`rope` split on dim 0; the ranks' joint lengths (padded text dropped per sample) exchanged at every attention.",
)

# Tensor parallelism. MochiAttnProcessor2_0 unflattens both streams' q/k/v with ``attn.heads`` (divided), applies
# per-head QK-norms (replicated) and the RoPE tables, then joins [video | valid text] per sample: every rank runs its
# heads of the joint attention. The tables come from the `rope` module as (cos, sin) of (S, heads, head_dim / 2)
# (the model's pos_frequencies are per head), so each rank keeps its heads' slice (LocalSlice on dim 1). Video q/k/v
# and the text stream's add_q/k/v_proj are column-wise; to_out and to_add_out (absent in the last block, whose text
# output is dropped) row-wise. Both SwiGLU FFNs (video, and text in all but the last block) split their fused
# [hidden | gate] up-projection per half. Modulation: the per-block MochiRMSNormZero linears (norm1: dim -> 4·dim;
# norm1_context: dim -> 4·text dim, ~10 % of a block) are split with a gathered output, as their chunk(4) runs over
# the whole vector; the last block's small norm1_context.linear_1 (dim -> text dim) stays whole, like the
# embedders, time_embed (with its attention pool), norm_out and proj_out.
_BLOCK = {
    **attention("attn1"),
    **{f"attn1.add_{name}_proj": Colwise() for name in ("q", "k", "v")},
    "attn1.to_add_out": Rowwise(),
    **feed_forward("ff", gated=True),
    **feed_forward("ff_context", gated=True),
    **modulation("norm1.linear", "norm1_context.linear"),
}
TP_PLAN = TensorParallelPlan(
    layers={"rope": LocalSlice(dim=1), **under("transformer_blocks.*", _BLOCK)},
    divide=("transformer_blocks.*.attn1.heads",),
    notes="Joint attention split by heads (both streams), RoPE tables sliced to the local heads, SwiGLU FFNs split; "
    "per-block RMSNormZero modulation split (gathered), embedders and the output layer replicated.",
)

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "transformer_blocks": (
        ("attn1.to_q", "attn1.to_k", "attn1.to_v"),
        ("attn1.add_q_proj", "attn1.add_k_proj", "attn1.add_v_proj"),
    ),
}

ADAPTER = register(
    ModelAdapter(
        family="mochi",
        fused_projections=FUSED_PROJECTIONS,
        # hidden_states is (batch, channels, frames, height, width).
        latent=LatentLayout(),
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="transformer_blocks", pattern=ForwardPattern.P0),),
        tiny_pipelines=(
            TinyPipeline(
                name="t2v",
                build=tiny_mochi,
                # 7 frames -> 2 latent frames; 32x32 -> 4x4 latents -> 2x2 tokens per frame.
                call_kwargs={
                    "prompt": "a cat holding a sign",
                    "negative_prompt": "blue",
                    "height": 32,
                    "width": 32,
                    "num_frames": 7,
                    "num_inference_steps": 2,
                    "guidance_scale": 4.5,
                    "max_sequence_length": _TEXT_LEN,
                },
            ),
        ),
        presets=(
            ModelPreset(
                name="mochi",
                pipeline_class="diffusers.MochiPipeline",
                hub_id="genmo/mochi-1-preview",
                defaults={
                    "num_inference_steps": 64,
                    "guidance_scale": 4.5,
                    "height": 480,
                    "width": 848,
                    "num_frames": 85,
                },
            ),
        ),
        notes=(
            "Text is padded to max_sequence_length; blocks take encoder_attention_mask and the attention processor "
            "drops padded text tokens per sample before joint attention. RoPE is computed from the latent shape "
            "in forward. CFG is batched (one call per step, batch 2). "
            "Context parallel: video and text tokens split at the first block, the prompt mask at every block; "
            "MochiAttnProcessor2_0 drops each sample's padded text tokens inside attention, so the ranks' joint "
            "lengths depend on their shards of the mask and are exchanged at every attention call "
            "(AttentionRouting.exchange_lengths: no USP, no CUDA graphs). Exact for right-padded prompt masks (what "
            "the tokenizer gives): the processor packs valid text first within each shard."
        ),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
    )
)
