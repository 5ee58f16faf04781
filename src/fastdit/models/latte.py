"""Latte: ``LatteTransformer3DModel`` (text-to-video).

Blocks (diffusers 0.42.1): two lists of ``BasicTransformerBlock``s with AdaLN-single modulation, run *interleaved*
by one loop, ``spatial_0, temporal_0, spatial_1, temporal_1, ...``, with reshapes between them:

* ``transformer_blocks`` (spatial): frames as batch, ``(B·F, N, D)``; self-attention over a frame's N tokens, then
  cross-attention to the T5 prompt (read only, never updated), then a feed-forward. Called with ``hidden_states``,
  ``attention_mask``, ``encoder_hidden_states``, ``encoder_attention_mask``, ``timestep``, ... all positionally;
  returns the hidden states alone: pattern 2.
* ``temporal_transformer_blocks``: token positions as batch, ``(B·N, F, D)``; self-attention over the F frames of one
  token position, no cross-attention (``encoder_hidden_states`` is ``None``): pattern 3. Before the first one the
  loop adds a temporal sin-cos position table.

The cache engine runs block groups one after the other, so the two lists cannot both be groups. The cache treats
the spatial blocks as the one group and the temporal blocks as work of the loop body, like the per-block work other
families do between blocks: the segment residual (input of the first middle spatial block to output of the last)
spans the temporal blocks in between. A step that reuses the residual would still run those temporal blocks and
then discard their output; the group declares the temporal list as ``interleaved``, so the cache makes such a
temporal block return its input instead, which leaves outputs unchanged and saves their compute.
"""

from __future__ import annotations

from fastdit.models.base import BlockGroup, ForwardPattern, LatentLayout, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, SplitInput
from fastdit.parallel.tp_plan import TensorParallelPlan
from fastdit.parallel.tp_shapes import attention, feed_forward, under

TRANSFORMER = "diffusers.models.transformers.latte_transformer_3d.LatteTransformer3DModel"

_TEXT_DIM = 32


def tiny_transformer(seed: int = 0, *, video_length: int = 4):
    """A 3 + 3-block ``LatteTransformer3DModel`` (2 heads of 16) predicting noise and variance for 4-channel latents.

    ``video_length`` must equal the number of latent frames: the temporal position table has that many rows.
    """
    from diffusers import LatteTransformer3DModel

    from fastdit.testing.components.encoders import build

    return build(
        LatteTransformer3DModel,
        seed=seed,
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=8,
        num_layers=3,
        cross_attention_dim=32,
        sample_size=16,
        patch_size=2,
        activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000,
        norm_type="ada_norm_single",
        norm_elementwise_affine=False,
        norm_eps=1e-6,
        caption_channels=_TEXT_DIM,
        video_length=video_length,
    )


def tiny_t2v(seed: int = 0):
    """A complete tiny ``LattePipeline`` (T5 prompt, 2-D ``AutoencoderKL`` decoding frame by frame)."""
    from diffusers import DDIMScheduler, LattePipeline

    from fastdit.testing.components.autoencoder_kl import autoencoder_kl
    from fastdit.testing.components.encoders import t5_encoder

    text_encoder, tokenizer = t5_encoder(d_model=_TEXT_DIM, seed=seed + 1)
    return LattePipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=autoencoder_kl(latent_channels=4, seed=seed),
        transformer=tiny_transformer(seed),
        scheduler=DDIMScheduler(),
    )


# Context parallelism splits the N tokens of every frame. forward patch-embeds (with sin-cos positions) before the
# loop, so the split is at the first spatial block's input, (B·F, N, D) on dim 1. The spatial self-attention over a
# frame's tokens is context-parallel; its cross-attention reads the whole, replicated prompt (local). The loop reshapes
# the rank's (B·F, N_local, D) shard to (B·N_local, F, D) for the temporal blocks, whose attention over the frames of
# one token position is whole on the rank (local), and whose temporal position table (1, F, D) broadcasts over the
# rows. Their timestep, repeated in forward to (B·N, 6·D) from the full N, is split group by group: each sample's N
# rows as the spatial tokens were (`groups_of`). The output is gathered after proj_out, before unpatchify.
CP_PLAN = ContextParallelPlan(
    inputs={
        "transformer_blocks.0": {"hidden_states": SplitInput(dim=1, expected_dims=3)},
        "temporal_transformer_blocks.*": {
            "timestep": SplitInput(dim=0, expected_dims=2, groups_of="hidden_states"),
        },
    },
    gather={"proj_out": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(
        sdpa_modules=("diffusers.models.attention_processor",),
        local=("transformer_blocks.*.attn2", "temporal_transformer_blocks"),
    ),
    notes="Each frame's tokens split at transformer_blocks.0 (positions added before); the temporal blocks' "
    "(B·N, 6·D) timestep split per sample (`groups_of`); cross-attention and the temporal attention over frames "
    "are local.",
)

# Tensor parallelism: both block lists use AttnProcessor2_0, which views q/k/v with attn.heads, so every attention's
# heads are divided and its q/k/v split by heads (to_out row-wise): the spatial blocks' self- and cross-attention
# (q from the frame, k/v from the prompt) and the temporal blocks' self-attention. Every FFN is split by hidden size.
# Modulation is the global adaln_single plus per-block scale_shift_table parameters: small, replicated, like the
# embedders, the caption projection and the output layer.
TP_PLAN = TensorParallelPlan(
    layers={
        **under("transformer_blocks.*", {**attention("attn1"), **attention("attn2"), **feed_forward()}),
        **under("temporal_transformer_blocks.*", {**attention("attn1"), **feed_forward()}),
    },
    divide=(
        "transformer_blocks.*.attn1.heads",
        "transformer_blocks.*.attn2.heads",
        "temporal_transformer_blocks.*.attn1.heads",
    ),
    notes="Spatial (self + cross) and temporal attention split by heads, FFNs by hidden size; the global "
    "adaln_single and the per-block scale_shift_table are replicated.",
)

_CALL = {
    "prompt": "a cat walking on the grass",
    "height": 32,
    "width": 32,
    "video_length": 4,
    "num_inference_steps": 2,
    "guidance_scale": 7.5,
    "clean_caption": False,
    "decode_chunk_size": 4,
}

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "transformer_blocks": (
        ("attn1.to_q", "attn1.to_k", "attn1.to_v"),
        ("attn2.to_k", "attn2.to_v"),
    ),
    "temporal_transformer_blocks": (("attn1.to_q", "attn1.to_k", "attn1.to_v"),),
}

ADAPTER = register(
    ModelAdapter(
        family="latte",
        fused_projections=FUSED_PROJECTIONS,
        # hidden_states is (batch, channels, frames, height, width).
        latent=LatentLayout(),
        transformer_classes=(TRANSFORMER,),
        block_groups=(
            BlockGroup(
                path="transformer_blocks",
                pattern=ForwardPattern.P2,
                interleaved=BlockGroup(path="temporal_transformer_blocks", pattern=ForwardPattern.P3),
            ),
        ),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        tiny_pipelines=(TinyPipeline(name="t2v", build=tiny_t2v, call_kwargs=_CALL),),
        presets=(
            ModelPreset(
                name="latte",
                pipeline_class="diffusers.LattePipeline",
                hub_id="maxin-cn/Latte-1",
                defaults={
                    "num_inference_steps": 50,
                    "guidance_scale": 7.5,
                    "height": 512,
                    "width": 512,
                    "video_length": 16,
                },
            ),
        ),
        notes=(
            "Spatial (`transformer_blocks`, pattern 2) and temporal (`temporal_transformer_blocks`, pattern 3) blocks"
            " run interleaved with reshapes between them; the cache groups the spatial blocks only and treats each "
            "temporal block as loop-body work (fn/bn count spatial blocks; the residual of the middle segment spans "
            "the temporal blocks inside it, which a cached step skips: the group declares them as interleaved). CFG "
            "is batched. Context parallelism splits the N tokens of each frame at the first spatial block (exact "
            "for both block kinds: the spatial self-attention is context-parallel, the temporal attention over one "
            "token position's frames is whole on each rank); the temporal blocks' `timestep`, which forward repeats "
            "to (B·N, 6·D) from the full N, is split per sample (`SplitInput.groups_of`), since for B > 1 (CFG) a "
            "rank's rows are N-strided. The frames are not split: the temporal position table is a "
            "(1, video_length, D) buffer added in forward. The latent frame count must equal the model's "
            "`video_length` (16)."
        ),
    )
)
