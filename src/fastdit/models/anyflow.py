"""AnyFlow (bidirectional flow-map distilled Wan 2.1): ``AnyFlowTransformer3DModel``.

Blocks (diffusers 0.42.1): one list ``blocks`` of ``AnyFlowTransformerBlock``; forward calls each positionally as
``block(hidden_states, encoder_hidden_states, timestep_proj, rotary_emb, attention_mask)`` and the block returns
``hidden_states`` alone (pattern 2). The backbone is Wan 2.1's; what differs is the conditioning: every call takes a
source timestep ``timestep`` and a target timestep ``r_timestep``, both per frame ``(B, F)``, which
``condition_embedder`` turns into a per-token modulation (``temb`` (B, S, D) for ``norm_out``, ``timestep_proj``
(B, S, 6·D) for the blocks, each frame's value repeated over its tokens). RoPE comes from the module ``rope`` as a
dict ``{"query": table, "key": table}`` of complex tables (1, 1, S, head_dim / 2). The pipeline (``AnyFlowPipeline``)
runs one call per step with batched CFG (``guidance_scale > 1``: ``[uncond, cond]`` in one batch); the released
checkpoints fold guidance into the weights (``guidance_scale=1``). Video conditioning (``video`` / ``video_latents``)
pins the leading latent frames and their timesteps to 0.

The causal chunk-wise sibling ``AnyFlowFARTransformer3DModel`` is its own family (``anyflow_far``): its KV cache and
flex-attention block mask make it plan differently.
"""

from __future__ import annotations

from fastdit.models.base import BlockGroup, ForwardPattern, LatentLayout, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, SplitInput, SplitOutput
from fastdit.parallel.tp_shapes import wan_tp_plan

TRANSFORMER = "diffusers.models.transformers.transformer_anyflow.AnyFlowTransformer3DModel"
_MODULE = "diffusers.models.transformers.transformer_anyflow"

_Z_DIM = 16  # the Wan 2.1 VAE's latent channels, so its default latent statistics apply
_TEXT_DIM = 32


def tiny_transformer(seed: int = 0):
    """A 3-block ``AnyFlowTransformer3DModel`` (2 heads of 12, the Wan 2.1 tiny layout)."""
    from diffusers import AnyFlowTransformer3DModel

    from fastdit.testing.components.encoders import build

    return build(
        AnyFlowTransformer3DModel,
        seed=seed,
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=_Z_DIM,
        out_channels=_Z_DIM,
        text_dim=_TEXT_DIM,
        freq_dim=32,
        ffn_dim=32,
        num_layers=3,
        rope_max_seq_len=32,
    )


def tiny_anyflow(seed: int = 0):
    """A complete tiny ``AnyFlowPipeline`` (UMT5, Wan 2.1 VAE, the flow-map Euler scheduler)."""
    from diffusers import AnyFlowPipeline, FlowMapEulerDiscreteScheduler

    from fastdit.testing.components.autoencoder_kl_wan import wan_components

    components = wan_components(text_dim=_TEXT_DIM, scheduler=FlowMapEulerDiscreteScheduler(), seed=seed)
    return AnyFlowPipeline(transformer=tiny_transformer(seed), **components)


_CALL = {
    "prompt": "a cat holding a sign",
    "negative_prompt": "blue",
    "height": 32,
    "width": 32,
    # 5 frames -> 2 latent frames of 4 x 4 tokens: 32 tokens.
    "num_frames": 5,
    "num_inference_steps": 2,
    # Above 1 so the tiny run has an unconditional branch (batched CFG); the released checkpoints use 1.
    "guidance_scale": 3.0,
    "max_sequence_length": 16,
}

# Context parallelism. The tokens exist only after patch_embedding + flatten inside forward: they are split at
# blocks.0 (called positionally). Everything outside attention is token-wise: the per-token modulation that
# condition_embedder returns (temb for norm_out, timestep_proj for the blocks, both (B, S, ·)) is split on its token
# dim like the tokens, and so is each complex RoPE table of the dict `rope` returns (1, 1, S, head_dim / 2). The
# output is gathered at proj_out, before forward unpatchifies. Self-attention is context-parallel; cross-attention
# (`attn2`, whose processor also passes its _parallel_config) stays local: local image queries attend to the whole,
# replicated text on every rank. The per-frame timesteps (B, F) enter the embedder whole.
CP_PLAN = ContextParallelPlan(
    inputs={"blocks.0": {"hidden_states": SplitInput(dim=1, expected_dims=3)}},
    outputs={
        "condition_embedder": (
            SplitOutput(dim=1, expected_dims=3, index=0),
            SplitOutput(dim=1, expected_dims=3, index=1),
        ),
        "rope": SplitOutput(dim=2, expected_dims=4),
    },
    gather={"proj_out": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(modules=(_MODULE,), local=("blocks.*.attn2",)),
    notes="Tokens split at blocks.0; the per-token modulation (condition_embedder) and the RoPE dict (rope) split "
    "alike; text replicated (cross-attention local).",
)

# Tensor parallelism: Wan 2.1's block layout (AnyFlowAttention keeps diffusers' attribute names: to_q/to_k/to_v,
# to_out.0, and norm_q/norm_k RMSNorms over the whole inner dim, made ShardedNorm). The processors reshape with
# attn.heads, which is divided.
TP_PLAN = wan_tp_plan(
    "blocks",
    notes="self/cross-attention by heads, QK-norms over the inner dim as ShardedNorm (mean square summed over ranks); "
    "FFN split; scale_shift_table modulation and the dual-timestep embedder whole.",
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
        family="anyflow",
        fused_projections=FUSED_PROJECTIONS,
        # hidden_states is (batch, frames, channels, height, width) (forward permutes it).
        latent=LatentLayout(channel_dim=2),
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="blocks", pattern=ForwardPattern.P2),),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        tiny_pipelines=(TinyPipeline(name="t2v", build=tiny_anyflow, call_kwargs=_CALL),),
        presets=(
            ModelPreset(
                name="anyflow-t2v",
                pipeline_class="diffusers.AnyFlowPipeline",
                hub_id="nvidia/AnyFlow-Wan2.1-T2V-14B-Diffusers",
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
            "Flow-map model: each call takes a source `timestep` and a target `r_timestep`, both per frame (B, F); "
            "the step is read from the largest entry of `timestep` (video-conditioned frames are pinned at 0). The "
            "modulation is per token (temb (B, S, D)), so under context parallelism it is split with the tokens. "
            "Distilled for few-step sampling (1-8 steps): a step cache has few steps to reuse. CFG is batched "
            "(`guidance_scale > 1`); the released checkpoints fold it into the weights and run `guidance_scale=1`, "
            "a single branch, where CFG parallelism has nothing to split."
        ),
    )
)
