"""AnyFlow-FAR (causal chunk-wise flow-map Wan 2.1): ``AnyFlowFARTransformer3DModel``.

Blocks (diffusers 0.42.1): one list ``blocks`` of ``AnyFlowTransformerBlock`` (the class ``anyflow`` uses, built with
the causal self-attention processor), called positionally as
``block(hidden_states, encoder_hidden_states, timestep_proj, rotary_emb, attention_mask, kv_cache[i], kv_cache_flag)``;
each returns ``hidden_states`` alone (pattern 2). ``AnyFlowFARPipeline`` generates the video chunk by chunk
(``chunk_partition`` latent frames per chunk): for each chunk it runs its denoising steps (a run per chunk), whose
calls attend from the chunk's tokens to the keys and values cached for the earlier chunks plus their own (no mask);
between chunks one *prefill* call (``kv_cache_flag["is_cache_step"]``, timestep 0) recomputes the clean chunks so far
(the older ones at a coarser patch size, ``far_patch_embedding``) under a flex ``BlockMask`` and writes every block's
KV cache in place. ``forward`` dispatches on ``kv_cache`` / ``kv_cache_flag``; a call without ``kv_cache`` is the
training rollout (block mask over the whole video).
"""

from __future__ import annotations

from fastdit.models.base import BlockGroup, ForwardPattern, LatentLayout, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, HeadParallel, SplitInput
from fastdit.parallel.tp_plan import LocalArgument, TensorParallelPlan
from fastdit.parallel.tp_shapes import wan_tp_plan

TRANSFORMER = "diffusers.models.transformers.transformer_anyflow_far.AnyFlowFARTransformer3DModel"

_Z_DIM = 16  # the Wan 2.1 VAE's latent channels, so its default latent statistics apply
_TEXT_DIM = 32


def tiny_transformer(seed: int = 0):
    """A 3-block ``AnyFlowFARTransformer3DModel``: chunks of one latent frame, two kept at full resolution."""
    from diffusers import AnyFlowFARTransformer3DModel

    from fastdit.testing.components.encoders import build

    return build(
        AnyFlowFARTransformer3DModel,
        seed=seed,
        patch_size=(1, 2, 2),
        compressed_patch_size=(1, 4, 4),
        # The third chunk's prefill already compresses the first: both patch embeddings and RoPE layouts run.
        full_chunk_limit=2,
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=_Z_DIM,
        out_channels=_Z_DIM,
        text_dim=_TEXT_DIM,
        freq_dim=32,
        ffn_dim=32,
        num_layers=3,
        rope_max_seq_len=32,
        chunk_partition=(1, 1, 1),
    )


def tiny_anyflow_far(seed: int = 0):
    """A complete tiny ``AnyFlowFARPipeline`` (UMT5, Wan 2.1 VAE, the flow-map Euler scheduler)."""
    from diffusers import AnyFlowFARPipeline, FlowMapEulerDiscreteScheduler

    from fastdit.testing.components.autoencoder_kl_wan import wan_components

    components = wan_components(text_dim=_TEXT_DIM, scheduler=FlowMapEulerDiscreteScheduler(), seed=seed)
    return AnyFlowFARPipeline(transformer=tiny_transformer(seed), **components)


_CALL = {
    "prompt": "a cat holding a sign",
    "negative_prompt": "blue",
    "height": 32,
    "width": 32,
    # 9 frames -> 3 latent frames of 4 x 4 tokens: three chunks of one frame (the transformer's chunk_partition).
    "num_frames": 9,
    "num_inference_steps": 2,
    # Above 1 so the tiny run has an unconditional branch (batched CFG); the released checkpoints use 1.
    "guidance_scale": 3.0,
    "max_sequence_length": 16,
}

# Tensor parallelism: the block layout is Wan 2.1's (see anyflow.py), plus the KV cache the pipeline allocates for
# every head (2, B, heads, L, head_dim) and passes each block: a block receives a view of its rank's heads, which
# its causal processor (heads divided) writes in the prefill call and reads in the denoising calls.
_BASE = wan_tp_plan("blocks", notes="")
TP_PLAN = TensorParallelPlan(
    layers={**_BASE.layers, "blocks.*": LocalArgument("kv_cache", dim=2)},
    divide=_BASE.divide,
    optional=_BASE.optional,
    notes="self/cross-attention by heads, QK-norms over the inner dim as ShardedNorm; FFN split; each block's KV "
    "cache passed as a view of the rank's heads; scale_shift_table modulation and the embedders whole.",
)

# Context parallelism: the tokens (the chunk's noisy tokens in a denoising call, the clean chunks so far in a prefill)
# split at blocks.0 and the per-token modulation (timestep_proj, (B, S, 6, D); (B, 1, 6, D) broadcast) at every
# block; gathered after the last block (norm_out's modulation is per token, built whole by forward). The causal
# self-attention works on the global sequence: it writes the KV cache by global token index, concatenates the cached
# keys and values with the chunk's own, and the prefill attends through a flex BlockMask over the padded sequence. So
# it is head-parallel: q/k/v leave norm_q / norm_k (RMSNorms over the whole width, exact on a token shard) and to_v as
# the whole sequence of this rank's heads; the RoPE dict is passed whole (forward builds it for the global positions
# and trims the query table to the chunk); each block's KV cache ((2, B, heads, L, D) tensors) becomes this rank's
# heads (`arguments`), so each rank caches its heads in the pipeline's buffer. Cross-attention to the text is local.
CP_PLAN = ContextParallelPlan(
    inputs={
        "blocks.0": {"hidden_states": SplitInput(dim=1, expected_dims=3)},
        "blocks.*": {"temb": SplitInput(dim=1, expected_dims=4, keep_singleton=True)},
    },
    gather={"blocks.-1": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(
        head_parallel={
            "blocks.*.attn1": HeadParallel(
                inputs=("norm_q", "norm_k", "to_v"),
                output="to_out.0",
                divide=("heads",),
                arguments={"kv_cache": 2},
            )
        },
        local=("blocks.*.attn2",),
    ),
    notes="Tokens split at blocks.0 and the per-token modulation at every block; causal self-attention "
    "head-parallel (its KV cache writes, cache concatenation and prefill BlockMask on the whole sequence of the "
    "rank's heads, each rank caching its heads); cross-attention local; gathered after the last block.",
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
        family="anyflow_far",
        fused_projections=FUSED_PROJECTIONS,
        # hidden_states is the chunk's (batch, frames, channels, height, width); the prefill calls are not steps and
        # are not read.
        latent=LatentLayout(channel_dim=2),
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="blocks", pattern=ForwardPattern.P2),),
        # The prefill call writes every block's KV cache: it must compute every block, and is no denoising step.
        unstepped_calls={"kv_cache_flag": ({"is_cache_step": True},)},
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        cfg_parallel=False,
        tiny_pipelines=(TinyPipeline(name="t2v", build=tiny_anyflow_far, call_kwargs=_CALL),),
        presets=(
            ModelPreset(
                name="anyflow-far-t2v",
                pipeline_class="diffusers.AnyFlowFARPipeline",
                hub_id="nvidia/AnyFlow-FAR-Wan2.1-1.3B-Diffusers",
                defaults={
                    "num_inference_steps": 4,
                    "guidance_scale": 1.0,
                    "height": 480,
                    "width": 832,
                    "num_frames": 81,
                },
            ),
        ),
        notes=(
            "Chunk-wise causal generation: a run of denoising steps per chunk, attending to the KV cache of the "
            "earlier chunks; between chunks a prefill call (`kv_cache_flag['is_cache_step']`, timestep 0) writes "
            "every block's KV cache, declared an unstepped call (computed in full, not counted). Per-frame "
            "timesteps (B, F) and a per-token modulation, as in `anyflow`. Context parallelism splits the tokens of "
            "every call (the chunk in a denoising call, the clean chunks in a prefill); the causal processor joins "
            "the cached keys and values with the chunk's own, writes the cache by global token index and attends "
            "through a flex BlockMask over the padded sequence in the prefill, so its self-attention is "
            "head-parallel (`AttentionRouting.head_parallel`): it runs unchanged on the whole sequence of the "
            "rank's heads, and each rank caches its heads in the pipeline's buffer (`HeadParallel.arguments`). "
            "No CFG parallelism: the two branches share "
            "one batched KV cache that the pipeline allocates for both (batch 2B) and every block writes in place, "
            "which a split batch would leave half written."
        ),
    )
)
