"""Helios (long-video generation chunk by chunk, with multi-term memory): ``HeliosTransformer3DModel``.

Blocks (diffusers 0.42.1): one list ``blocks`` of ``HeliosTransformerBlock``, called positionally as
``block(hidden_states, encoder_hidden_states, timestep_proj, rotary_emb, original_context_length)``; each returns
``hidden_states`` (pattern 2). Forward patchifies the current chunk's latents and prepends the history tokens
(``patch_short`` / ``patch_mid`` / ``patch_long`` over the last 1 + 1, 2 and 16 generated latent frames, coarser the
older), so the sequence is ``[long, mid, short, current]``; the per-token RoPE table ``rotary_emb`` (B, S, C) and the
per-token modulation ``timestep_proj`` (B, S, 6, D) (the history at timestep 0) span it alike.
``original_context_length`` is the number of current tokens, the *last* ones: the blocks' cross-attention runs on
them only, and, with ``is_amplify_history``, self-attention scales the keys of the tokens before them. The pipelines
generate a video chunk by chunk (a run per chunk; the pyramid pipeline also a run per resolution stage).
"""

from __future__ import annotations

from fastdit.models._lazy import LazyKwargs, tiny_image
from fastdit.models.base import BlockGroup, ForwardPattern, LatentLayout, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, SplitInput, TrailingCount
from fastdit.parallel.tp_plan import SplitParameter, TensorParallelPlan
from fastdit.parallel.tp_shapes import wan_tp_plan

TRANSFORMER = "diffusers.models.transformers.transformer_helios.HeliosTransformer3DModel"
_MODULE = "diffusers.models.transformers.transformer_helios"

_Z_DIM = 16  # the Wan 2.1 VAE's latent channels, so its default latent statistics apply
_TEXT_DIM = 32
# Tiny chunks: 2 latent frames (5 pixel frames) a chunk, and a history of 2 long, 2 mid and 1 short latent frames.
_CHUNK = {"num_latent_frames_per_chunk": 2, "history_sizes": [2, 2, 1]}


def tiny_transformer(seed: int = 0):
    """A 3-block ``HeliosTransformer3DModel`` with the multi-term memory patches and amplified history keys."""
    from diffusers import HeliosTransformer3DModel

    from fastdit.testing.components.encoders import build

    return build(
        HeliosTransformer3DModel,
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
        rope_dim=(4, 4, 4),
        # Exercised so that the split count of current tokens is checked by the history key scaling too, and the
        # per-head key scale by tensor parallelism.
        is_amplify_history=True,
        history_scale_mode="per_head",
    )


def _components(seed: int, scheduler) -> dict:
    from fastdit.testing.components.autoencoder_kl_wan import wan_components

    return wan_components(text_dim=_TEXT_DIM, scheduler=scheduler, seed=seed)


def tiny_helios(seed: int = 0):
    """A complete tiny ``HeliosPipeline`` (UMT5, Wan 2.1 VAE, the Helios UniPC scheduler)."""
    from diffusers import HeliosPipeline, HeliosScheduler

    # One stage (the base model samples at full resolution; the pyramid variant below has several).
    scheduler = HeliosScheduler(stages=1, stage_range=[0, 1], use_dynamic_shifting=True)
    return HeliosPipeline(transformer=tiny_transformer(seed), **_components(seed, scheduler))


def tiny_helios_pyramid(seed: int = 0):
    """A complete tiny ``HeliosPyramidPipeline``: two resolution stages (half, then full size) per chunk."""
    from diffusers import HeliosPyramidPipeline, HeliosScheduler

    # gamma below 1/3: the renoise covariance of a 2x2 patch, (1 + g) I - g J, is then clearly positive-definite.
    scheduler = HeliosScheduler(stages=2, stage_range=[0, 0.5, 1], gamma=0.25)
    return HeliosPyramidPipeline(transformer=tiny_transformer(seed), **_components(seed, scheduler))


_CALL = {
    "prompt": "a cat holding a sign",
    "negative_prompt": "blue",
    "height": 32,
    "width": 32,
    "num_frames": 5,
    "num_inference_steps": 2,
    "guidance_scale": 5.0,
    "max_sequence_length": 16,
    **_CHUNK,
}

# Context parallelism: the sequence [history..., current] only exists inside forward, so the tokens are split at
# blocks.0; the RoPE table and the per-token modulation are loop constants that forward passes whole to every block,
# so every block splits them like the tokens. `original_context_length` counts the last tokens (the current chunk):
# each rank gets how many of them it holds (TrailingCount), which are the last of its shard too, so the block's
# `split(x, [len - n, n])` and the history key scaling keep working locally. The output is gathered after the last
# block, before `norm_out` keeps the last `original_context_length` tokens (forward passes it the global count).
# Cross-attention (to the replicated text) is local: the processor passes no parallel_config for it.
_TOKENS = SplitInput(dim=1, expected_dims=3)
CP_PLAN = ContextParallelPlan(
    inputs={
        "blocks.0": {"hidden_states": _TOKENS},
        "blocks.*": {
            "rotary_emb": _TOKENS,
            "temb": SplitInput(dim=1, expected_dims=4),
            "original_context_length": TrailingCount(of="hidden_states"),
        },
    },
    gather={"blocks.-1": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(modules=(_MODULE,)),
    notes=(
        "tokens [history, current] split at blocks.0, RoPE and per-token modulation at every block, the current "
        "tokens' count narrowed from the end (TrailingCount); gathered after the last block; text replicated."
    ),
)

# Tensor parallelism: Wan's plan (attention by heads, QK-norms over the inner dim as ShardedNorm, FFN split) plus the
# amplified history's key scale, which the processor reads directly and views per head (`view(1, 1, -1, 1)`): split
# with the heads (a scalar scale, size 1, stays whole; a model without amplified history has none: optional).
_WAN_TP = wan_tp_plan("blocks", notes="")
_SCALE = "blocks.*.attn1"
TP_PLAN = TensorParallelPlan(
    layers={**_WAN_TP.layers, _SCALE: SplitParameter("history_key_scale")},
    divide=_WAN_TP.divide,
    optional=(*_WAN_TP.optional, _SCALE),
    notes=(
        "Wan's plan: attention by heads, QK-norms over the inner dim as ShardedNorm, FFN split; the per-head history "
        "key scale split with the heads; the history patches whole."
    ),
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
        family="helios",
        fused_projections=FUSED_PROJECTIONS,
        # hidden_states is (batch, channels, frames, height, width). The history latents arrive apart; each pyramid
        # stage is a grid of its own.
        latent=LatentLayout(),
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="blocks", pattern=ForwardPattern.P2),),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        tiny_pipelines=(
            TinyPipeline(name="t2v", build=tiny_helios, call_kwargs=_CALL),
            TinyPipeline(name="i2v", build=tiny_helios, call_kwargs=LazyKwargs({**_CALL, "image": tiny_image()})),
            TinyPipeline(
                name="pyramid",
                build=tiny_helios_pyramid,
                call_kwargs={
                    **{k: v for k, v in _CALL.items() if k != "num_inference_steps"},
                    "pyramid_num_inference_steps_list": [2, 2],
                },
            ),
        ),
        presets=(
            ModelPreset(
                name="helios-base",
                pipeline_class="diffusers.HeliosPipeline",
                hub_id="BestWishYsh/Helios-Base",
                defaults={
                    "num_inference_steps": 50,
                    "guidance_scale": 5.0,
                    "height": 384,
                    "width": 640,
                    "num_frames": 132,
                },
            ),
            ModelPreset(
                name="helios-mid",
                pipeline_class="diffusers.HeliosPyramidPipeline",
                hub_id="BestWishYsh/Helios-Mid",
                defaults={"guidance_scale": 5.0, "height": 384, "width": 640, "num_frames": 132},
            ),
        ),
        notes=(
            "The blocks see [long, mid, short history, current chunk] tokens; `original_context_length` counts the "
            "current ones at the end (cross-attention and the output use only them). One run per chunk (the pyramid "
            "pipeline: per chunk and resolution stage), so cache state never crosses chunks."
        ),
    )
)
