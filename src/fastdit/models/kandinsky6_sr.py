"""Kandinsky 6 video super-resolution: ``Kandinsky6SRTransformer3DModel`` (``Kandinsky6SRPipeline``).

Blocks (diffusers 0.42.1): one list ``visual_transformer_blocks`` of ``Kandinsky6SRTransformerBlock``, called
positionally as ``block(visual_embed, temb, visual_rope, sparse_params)`` and returning the tokens (pattern 3,
hidden ``hidden_states``). The model is text-free. Forward orders the tokens in 8 x 8 spatial groups; every
self-attention builds a NABLA block mask from block-pooled queries and keys (per head) plus a sliding-tile prior and
runs flex attention with it. The pipeline refines the video tile by tile, one transformer call per step (a run per
tile) and no guidance.
"""

from __future__ import annotations

from fastdit.models._lazy import Deferred, LazyKwargs
from fastdit.models.base import BlockGroup, ForwardPattern, LatentLayout, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, HeadParallel, SplitInput
from fastdit.parallel.tp_plan import TensorParallelPlan
from fastdit.parallel.tp_shapes import attention, feed_forward, modulation, under

TRANSFORMER = "diffusers.models.transformers.transformer_kandinsky6_sr.Kandinsky6SRTransformer3DModel"

_LATENT = 4
# The tiny K-VAE compresses space 16x (5 levels), so a 128-pixel tile is an 8 x 8 token grid: the least NABLA's
# 8 x 8 token groups take. A 64-pixel, 5-frame input upscaled 2x is one such tile (2 latent frames, 128 tokens).
_TILE = 128
_INPUT = 64
_FRAMES = 5


def tiny_transformer(seed: int = 0):
    """A 3-block ``Kandinsky6SRTransformer3DModel`` trained on one tile size, 128 x 128 pixels."""
    from diffusers import Kandinsky6SRTransformer3DModel

    from fastdit.testing.components.encoders import build

    return build(
        Kandinsky6SRTransformer3DModel,
        seed=seed,
        in_visual_dim=_LATENT,
        out_visual_dim=_LATENT,
        time_dim=16,
        model_dim=32,
        ff_dim=64,
        num_visual_blocks=3,
        axes_dims=(4, 6, 6),
        nabla_window=(3, 3, 3),
        tile_sizes=((_TILE, _TILE),),
    )


def tiny_kandinsky6_sr(seed: int = 0):
    """A complete tiny ``Kandinsky6SRPipeline`` (the tiny K-VAE, no latent upscaler: tiles upscaled in pixels)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Kandinsky6SRPipeline, Kandinsky6SRVAE

    from fastdit.testing.components.encoders import build

    vae = build(
        Kandinsky6SRVAE,
        seed=seed,
        latent_channels=_LATENT,
        encoder_block_out_channels=(4,) * 5,
        decoder_block_out_channels=(4,) * 5,
        layers_per_block=1,
    )
    return Kandinsky6SRPipeline(
        transformer=tiny_transformer(seed), vae=vae, scheduler=FlowMatchEulerDiscreteScheduler()
    )


def _video(seed: int) -> list:
    """A random low-resolution video of the tiny size (PIL frames)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [
        Image.fromarray(rng.integers(0, 256, (_INPUT, _INPUT, 3), dtype=np.uint8), mode="RGB") for _ in range(_FRAMES)
    ]


_CALL = LazyKwargs({"video": Deferred(_video, (1,)), "resolution_scale": 2, "num_inference_steps": 2})

# Context parallelism: forward orders the tokens in 8 x 8 spatial groups and computes the RoPE table and the
# sliding-tile prior over the whole grid, so the tokens are split at the first block and gathered after the last
# (before forward merges the groups back into the grid). Every self-attention builds its NABLA BlockMask from block
# averages of its queries and keys over the whole sequence, so it is head-parallel: q/k/v leave to_query/to_key/
# to_value as the whole sequence of this rank's heads (num_heads, which the processor unflattens with, holds the
# rank's share meanwhile), the processor builds exactly those heads' masks as on one device, with the RoPE table and
# the prior whole, and out_layer takes the result back to the rank's tokens.
CP_PLAN = ContextParallelPlan(
    inputs={"visual_transformer_blocks.0": {"hidden_states": SplitInput(dim=1, expected_dims=3)}},
    gather={"visual_transformer_blocks.-1": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(
        head_parallel={
            "visual_transformer_blocks.*.self_attention": HeadParallel(
                inputs=("to_query", "to_key", "to_value"), output="out_layer", heads="num_heads", divide=("num_heads",)
            )
        }
    ),
    notes="Tokens (in NABLA's 8 x 8 group order) split at the first block, gathered after the last; self-attention "
    "head-parallel: each rank builds its heads' NABLA BlockMasks from the whole sequence.",
)

# Tensor parallelism: the self-attention by heads (to_query/to_key/to_value column-wise, out_layer row-wise,
# num_heads divided); the NABLA mask is computed per head from that head's pooled queries and keys, so each rank
# builds exactly its heads' masks, and the QK-norms (over head_dim) and RoPE stay whole. FFN (GELU) split; the AdaLN
# modulation split with a gathered output; embeddings and the output layer whole.
TP_PLAN = TensorParallelPlan(
    layers=under(
        "visual_transformer_blocks.*",
        {
            **attention("self_attention", qkv=("to_query", "to_key", "to_value"), out="out_layer"),
            **feed_forward("feed_forward"),
            **modulation("visual_modulation.out_layer"),
        },
    ),
    divide=("visual_transformer_blocks.*.self_attention.num_heads",),
    notes="Self-attention by heads (each rank builds its heads' NABLA masks), FFN split, AdaLN modulation split with a "
    "gathered output; embeddings and out_layer whole.",
)

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "visual_transformer_blocks": (("self_attention.to_query", "self_attention.to_key", "self_attention.to_value"),),
}

ADAPTER = register(
    ModelAdapter(
        family="kandinsky6_sr",
        fused_projections=FUSED_PROJECTIONS,
        # hidden_states is the tile's (batch, frames, height, width, channels) with the low-resolution video's
        # latents appended (they stay put: they dilute the signal).
        latent=LatentLayout(channel_dim=-1),
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="visual_transformer_blocks", pattern=ForwardPattern.P3),),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        cfg_parallel=False,
        tiny_pipelines=(TinyPipeline(name="vsr", build=tiny_kandinsky6_sr, call_kwargs=_CALL),),
        presets=(
            ModelPreset(
                name="kandinsky6-vsr-distilled",
                pipeline_class="diffusers.Kandinsky6SRPipeline",
                hub_id="kandinskylab/Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers",
                defaults={"num_inference_steps": 2, "resolution_scale": 2.25},
            ),
        ),
        notes=(
            "One run per tile (the pipeline restarts the schedule for every tile), one call per step; the pipeline "
            "has no latent output type. Context parallelism splits the tokens at the first block; every "
            "self-attention builds its NABLA BlockMask inside the processor from block averages of the queries and "
            "keys over the whole sequence, so it is head-parallel (`AttentionRouting.head_parallel`): each rank runs "
            "the processor on the whole sequence of its heads and builds exactly their masks. No CFG parallelism: "
            "the pipeline has no guidance (one transformer call per step)."
        ),
    )
)
