"""SANA-WM stage 2, the LTX-2 chunk-causal refiner: ``SanaWMLTX2RefinerTransformer3DModel``.

Blocks (diffusers 0.42.1): one list, ``transformer_blocks`` (``SanaWMLTX2RefinerTransformerBlock``: LTX-2's block
with the video stream only: self-attention over a KV-cached sliding window, prompt cross-attention, FFN), each called
by keyword (``hidden_states=..., encoder_hidden_states=..., temb=..., video_rotary_emb=..., ...``) and returning the
hidden states alone (pattern 2). Between blocks the forward does nothing. The audio modules of the LTX-2 checkpoint
are built but never run.

``SanaWMLTX2Refiner`` refines stage-1 latents autoregressively: ``block_size`` latent frames at a time, three
distilled Euler steps each (every window is a run of its own: its timesteps start high again), attending to an
attention sink and the already refined history through a ``SanaWMRefinerKVCache`` the pipeline fills with two more
calls at timestep 0: ``kv_cache_mode="capture_pre_rope"`` (the sink) and ``"inject_and_capture_post_rope"`` (a refined
window's keys). Those calls are no denoising steps: they are declared ``unstepped_calls`` (every block computed, no
step counted), so the cache never serves the keys the next windows read.
"""

from __future__ import annotations

from fastdit.models._lazy import Deferred, LazyKwargs
from fastdit.models.base import BlockGroup, ForwardPattern, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, HeadParallel, SplitInput
from fastdit.parallel.tp_plan import TensorParallelPlan
from fastdit.parallel.tp_shapes import feed_forward, under

TRANSFORMER = "diffusers.models.transformers.transformer_sana_wm_refiner.SanaWMLTX2RefinerTransformer3DModel"

_LATENT = 4
_CONNECTOR_DIM = 32  # the tiny LTX-2 text connectors' width: the transformer's caption and cross-attention width


def tiny_transformer(seed: int = 0):
    """A 3-block ``SanaWMLTX2RefinerTransformer3DModel`` (patch 1, video 2x16 attention, split RoPE)."""
    from diffusers import SanaWMLTX2RefinerTransformer3DModel

    from fastdit.testing.components.encoders import build

    return build(
        SanaWMLTX2RefinerTransformer3DModel,
        seed=seed,
        in_channels=_LATENT,
        out_channels=_LATENT,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=2,
        attention_head_dim=16,
        cross_attention_dim=32,
        vae_scale_factors=(8, 8, 8),
        # The audio tower exists for the checkpoint's weights only; it is kept tiny.
        audio_in_channels=4,
        audio_out_channels=4,
        audio_num_attention_heads=2,
        audio_attention_head_dim=8,
        audio_cross_attention_dim=16,
        num_layers=3,
        caption_channels=_CONNECTOR_DIM,
        rope_double_precision=False,
        rope_type="split",
    )


def tiny_refiner(seed: int = 0):
    """A complete tiny ``SanaWMLTX2Refiner`` (Gemma 3 text encoder, LTX-2 text connectors; no VAE: latents out)."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.sana_wm.refiner import SanaWMLTX2Refiner

    from fastdit.models.ltx2 import tiny_connectors
    from fastdit.testing.components.gemma3 import gemma3_model

    text_encoder, tokenizer = gemma3_model(hidden_size=32, num_layers=2, seed=seed)
    return SanaWMLTX2Refiner(
        transformer=tiny_transformer(seed),
        connectors=tiny_connectors(seed),
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        # shift=1: the distilled sigmas pass through unchanged (as the pipeline expects).
        scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0),
        text_max_sequence_length=16,
    )


def stage1_latent(seed: int = 0):
    """A stage-1 latent ``(1, C, 5, 4, 4)``: the sink frame and two refinement windows of two frames."""
    import torch

    return torch.randn((1, _LATENT, 5, 4, 4), generator=torch.Generator().manual_seed(seed))


# Tensor parallelism: the video FFN only (GELU up column-wise, down row-wise: one all-reduce per block). The
# attentions stay replicated: splitting them by heads needs each rank's slice of the RoPE tables, and the pipeline
# builds those tables itself (`build_rotary_emb_for_absolute_positions`, for the window and the sink) and passes them
# into forward, so a slice taken at the rope module would reach the transformer as a different input on every rank,
# where the parallel input check (rightly) refuses it; a plan has no style that slices a forward argument. The unused
# audio tower, the AdaLN tables and the embedders stay whole.
TP_PLAN = TensorParallelPlan(
    layers=under("transformer_blocks.*", feed_forward("ff")),
    notes="Video GELU FFN split; the attentions (their RoPE tables come into forward for all heads, built by the "
    "pipeline), the unused audio tower, AdaLN tables and embedders replicated.",
)

# Context parallelism: the window's tokens split at transformer_blocks.0 and the modulation (temb, (B, S, 6·D) per
# token or (B, 1, 6·D)) at every block; gathered after the last block (norm_out's modulation is built whole). The
# self-attention prepends the cached sink and history keys/values to the window's own, and the pipeline trims the
# history by a global token count (`history[:, -keep_tokens:]`), so it is head-parallel: q/k/v leave norm_q / norm_k
# (RMSNorms over the whole width) and to_v, and the optional per-head gate logits leave to_gate_logits, as the whole
# window of this rank's heads; what the cache captures is then the whole window of the rank's heads, so the trim
# keeps the right keys and every rank's cache holds its heads. The RoPE tables the pipeline builds for the window
# and the sink hold every head ((B, H, S, r) for split RoPE, (B, S, H·D) interleaved): each becomes this rank's
# heads. Cross-attention to the prompt is local.
_AUDIO_ATTENTION = ("audio_attn1", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn")
CP_PLAN = ContextParallelPlan(
    inputs={
        "transformer_blocks.0": {"hidden_states": SplitInput(dim=1, expected_dims=3)},
        "transformer_blocks.*": {"temb": SplitInput(dim=1, expected_dims=3, keep_singleton=True)},
    },
    gather={"transformer_blocks.-1": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(
        head_parallel={
            "transformer_blocks.*.attn1": HeadParallel(
                inputs=("norm_q", "norm_k", "to_v", "to_gate_logits"),
                output="to_out.0",
                divide=("heads",),
                arguments={"query_rotary_emb": {4: 1, 3: 2}, "sink_rotary_emb": {4: 1, 3: 2}},
                optional=("to_gate_logits", "sink_rotary_emb"),
            )
        },
        # The prompt cross-attention, and the audio tower's attentions (built for the checkpoint, never run).
        local=(
            "transformer_blocks.*.attn2",
            *(f"transformer_blocks.*.{a}" for a in _AUDIO_ATTENTION),
        ),
    ),
    notes="Window tokens split at transformer_blocks.0 and the modulation at every block; self-attention "
    "head-parallel (sink and history KV cache, captured and trimmed on the whole window of the rank's heads; RoPE "
    "tables sliced to the rank's heads); cross-attention local; gathered after the last block.",
)

_CALL = {
    "sana_latent": Deferred(stage1_latent),
    "prompt": "a cat holding a sign",
    "fps": 16.0,
    "sink_size": 1,
    "block_size": 2,
    "kv_max_frames": 3,  # the second window already trims the history to the last refined frames
    # Two distilled Euler steps per window (the released schedule has three); the last sigma ends the run.
    "sigmas": (0.909375, 0.5, 0.0),
    # Without a VAE the pipeline returns the refined latents whatever the output type.
    "output_type": "latent",
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
        family="sana_wm_refiner",
        fused_projections=FUSED_PROJECTIONS,
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="transformer_blocks", pattern=ForwardPattern.P2),),
        tiny_pipelines=(TinyPipeline(name="refine", build=tiny_refiner, call_kwargs=LazyKwargs(_CALL)),),
        presets=(
            ModelPreset(
                name="sana-wm-refiner",
                pipeline_class="diffusers.pipelines.sana_wm.refiner.SanaWMLTX2Refiner",
                hub_id="Efficient-Large-Model/SANA-WM_bidirectional",
                defaults={"fps": 16.0, "block_size": 3, "kv_max_frames": 11},
            ),
        ),
        unstepped_calls={"kv_cache_mode": ("capture_pre_rope", "inject_and_capture_post_rope")},
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        cfg_parallel=False,
        notes=(
            "Refines a stage-1 latent (`sana_latent`, a tensor) window by window with a sliding KV cache: every "
            "window is a 3-step run of its own, and the two key-capturing calls at timestep 0 are unstepped calls. "
            "The pipeline returns a bare tensor (latents without a VAE, frames with one). Context parallelism splits "
            "the window's tokens; the pipeline trims each layer's cached history by a global token count "
            "(`history[:, -keep_tokens:]`), so the self-attention is head-parallel: the cache captures the whole "
            "window of the rank's heads and the trim keeps the right keys; the pipeline's RoPE tables are sliced "
            "to the rank's heads (`HeadParallel.arguments`). No CFG parallelism: the refiner runs "
            "one conditional call per step (distilled, no guidance)."
            " No spectral signal: the latent arrives packed into a token sequence (batch, tokens, channels): no grid "
            "to filter."
        ),
    )
)
