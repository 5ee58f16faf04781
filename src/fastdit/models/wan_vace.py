"""Wan 2.1 VACE (video creation and editing from control videos, masks, reference images).

Transformer: ``WanVACETransformer3DModel``.

Blocks (diffusers 0.42.1): the Wan list ``blocks`` of ``WanTransformerBlock`` (called positionally as
``block(hidden_states, encoder_hidden_states, timestep_proj, rotary_emb)``, returns ``hidden_states``: pattern 2),
preceded in forward by a second list ``vace_blocks`` of ``WanVACETransformerBlock``. Forward runs *all* the VACE
blocks first, on the control tokens (``control_hidden_states``, patchified by ``vace_patch_embedding`` from the same
latent grid as the video and zero-padded to its length; ``vace_blocks.0`` adds the video tokens to them once); each
returns ``(hint, control_hidden_states)``. Then the main loop runs ``blocks`` and, after block ``i`` for each ``i`` in
``config.vace_layers``, adds ``hint * scale`` to the hidden states in the loop body.

Cache: only ``blocks`` is a block group. The VACE blocks are work done before the cached loop, as the patch
embedding is: they compute on every call. They cannot be a cached group: each returns its own hint that a later
main block consumes, and a cached segment replays one residual for the segment's last block only (earlier blocks
pass their inputs through), so the skipped blocks' hints would be lost; and the cache decision is taken after the
first main block, when every VACE block has already run. The hint additions between main blocks are loop-body work:
on a computed step they are inside the stored segment residual, on a cached step the pass-through blocks' additions
are superseded by that residual at the segment's last block (as for any loop-body work), so threshold 0 and a
disabled cache stay bit-identical.
"""

from __future__ import annotations

import numpy as np

from fastdit.models.base import BlockGroup, ForwardPattern, LatentLayout, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, SplitInput, SplitOutput
from fastdit.parallel.tp_shapes import wan_tp_plan

TRANSFORMER = "diffusers.models.transformers.transformer_wan_vace.WanVACETransformer3DModel"

_Z_DIM = 16  # the Wan 2.1 VAE's latent channels, so its default latent statistics apply
_TEXT_DIM = 32
# Control latents: inactive + reactive video latents (2 x 16) and the mask folded to 8 x 8 = 64 channels.
_VACE_IN = 2 * _Z_DIM + 8 * 8
# Four main blocks with hints after blocks 0 (the front block under fn=1), 1 (inside the cached middle segment,
# between two middle blocks) and 3 (the back block under bn=1): every position a hint can take relative to the cache.
_VACE_LAYERS = (0, 1, 3)
_HEIGHT = _WIDTH = 32
_FRAMES = 5


def tiny_transformer(seed: int = 0):
    """A 4-block ``WanVACETransformer3DModel`` with 3 VACE blocks (hints after main blocks 0, 1 and 3)."""
    from diffusers import WanVACETransformer3DModel

    from fastdit.testing.components.encoders import build

    return build(
        WanVACETransformer3DModel,
        seed=seed,
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=_Z_DIM,
        out_channels=_Z_DIM,
        text_dim=_TEXT_DIM,
        freq_dim=32,
        ffn_dim=32,
        num_layers=4,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
        vace_layers=list(_VACE_LAYERS),
        vace_in_channels=_VACE_IN,
    )


def _components(seed: int) -> dict:
    from diffusers import FlowMatchEulerDiscreteScheduler

    from fastdit.testing.components.autoencoder_kl_wan import wan_components

    return wan_components(text_dim=_TEXT_DIM, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), seed=seed)


def tiny_wan_vace(seed: int = 0):
    """A complete tiny Wan 2.1 ``WanVACEPipeline``."""
    from diffusers import WanVACEPipeline

    return WanVACEPipeline(transformer=tiny_transformer(seed), **_components(seed))


def tiny_wan22_vace(seed: int = 0):
    """A complete tiny two-expert ``WanVACEPipeline`` (high- and low-noise transformers switched at the boundary)."""
    from diffusers import WanVACEPipeline

    return WanVACEPipeline(
        transformer=tiny_transformer(seed),
        transformer_2=tiny_transformer(seed + 1),
        # With shift 3 and 4 steps the timesteps are about 1000, 858, 602, 9: two steps per expert.
        boundary_ratio=0.85,
        **_components(seed),
    )


def _frames(count: int, seed: int) -> list:
    """``count`` random RGB frames of the tiny size (deterministic)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [
        Image.fromarray(rng.integers(0, 256, (_HEIGHT, _WIDTH, 3), dtype=np.uint8), mode="RGB") for _ in range(count)
    ]


def _first_last_frame_control() -> dict:
    """The pipeline docstring's first/last-frame task: known end frames, grey frames in between to generate."""
    from PIL import Image

    first, last = _frames(2, seed=1)
    grey = Image.new("RGB", (_WIDTH, _HEIGHT), (128, 128, 128))
    keep, generate = Image.new("L", (_WIDTH, _HEIGHT), 0), Image.new("L", (_WIDTH, _HEIGHT), 255)
    return {
        "video": [first, *[grey] * (_FRAMES - 2), last],
        "mask": [keep, *[generate] * (_FRAMES - 2), keep],
    }


# Context parallelism: the Wan plan (RoPE tables from `rope` split on dim 1, tokens split at blocks.0, output gathered
# at proj_out, text replicated with cross-attention local) plus the VACE branch. The control tokens are patchified
# from the same latent grid as the video tokens (forward zero-pads them to the video's length before any block, should
# a caller pass fewer control frames), so they are split with the same shard sizes, at vace_blocks.0, before any VACE
# block runs. vace_blocks.0 also receives the video tokens (it adds them to the control tokens): they are split there
# too. Forward passes its own, unsplit video tokens to blocks.0, which is why blocks.0 keeps its split. Each VACE
# block then returns the hint of this rank's tokens, which the loop adds to this rank's hidden states. The VACE
# blocks' attention uses the Wan processors of `transformer_wan`, so routing that module covers both lists.
CP_PLAN = ContextParallelPlan(
    inputs={
        "": {"timestep": SplitInput(dim=1, expected_dims=2)},
        "vace_blocks.0": {
            "hidden_states": SplitInput(dim=1, expected_dims=3),
            "control_hidden_states": SplitInput(dim=1, expected_dims=3),
        },
        "blocks.0": {"hidden_states": SplitInput(dim=1, expected_dims=3)},
    },
    outputs={"rope": (SplitOutput(dim=1, expected_dims=4, index=0), SplitOutput(dim=1, expected_dims=4, index=1))},
    gather={"proj_out": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(modules=("diffusers.models.transformers.transformer_wan",)),
    notes=(
        "Wan plan (RoPE from `rope` split on dim 1, tokens split at blocks.0, text replicated) plus video and "
        "control tokens split alike at vace_blocks.0, so every hint matches its rank's tokens."
    ),
)

_CALL = {
    "prompt": "a cat holding a sign",
    "negative_prompt": "blue",
    "height": _HEIGHT,
    "width": _WIDTH,
    "num_frames": _FRAMES,
    "num_inference_steps": 2,
    "guidance_scale": 5.0,
    "max_sequence_length": 16,
}

TP_PLAN = wan_tp_plan(
    "blocks",
    "vace_blocks",
    notes="Wan's plan over blocks and vace_blocks; the VACE hint projections (dim → dim) stay whole.",
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
        family="wan_vace",
        fused_projections=FUSED_PROJECTIONS,
        # hidden_states is (batch, channels, frames, height, width). The control latents arrive apart
        # (control_hidden_states).
        latent=LatentLayout(),
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="blocks", pattern=ForwardPattern.P2),),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        tiny_pipelines=(
            # No control video: the pipeline conditions on an all-zero video under an all-ones mask (text to video).
            TinyPipeline(name="t2v", build=tiny_wan_vace, call_kwargs=_CALL),
            TinyPipeline(name="flf2v", build=tiny_wan_vace, call_kwargs={**_CALL, **_first_last_frame_control()}),
            # A reference image is encoded as one extra leading latent frame of both the video and the control
            # latents (more tokens: 12, split 4/4/4 on 3 ranks where the others split 8 tokens unevenly).
            TinyPipeline(
                name="reference",
                build=tiny_wan_vace,
                call_kwargs={**_CALL, "reference_images": _frames(1, seed=2), "conditioning_scale": 0.5},
            ),
            # Two experts: 4 steps so that each runs two of them (cache tests need a step to reuse).
            TinyPipeline(
                name="wan2.2-a14b",
                build=tiny_wan22_vace,
                call_kwargs={**_CALL, **_first_last_frame_control(), "num_inference_steps": 4},
            ),
        ),
        presets=(
            ModelPreset(
                name="wan2.1-vace-1.3b",
                pipeline_class="diffusers.WanVACEPipeline",
                hub_id="Wan-AI/Wan2.1-VACE-1.3B-diffusers",
                defaults={
                    "num_inference_steps": 30,
                    "guidance_scale": 5.0,
                    "height": 480,
                    "width": 832,
                    "num_frames": 81,
                },
            ),
            ModelPreset(
                name="wan2.1-vace-14b",
                pipeline_class="diffusers.WanVACEPipeline",
                hub_id="Wan-AI/Wan2.1-VACE-14B-diffusers",
                defaults={
                    "num_inference_steps": 30,
                    "guidance_scale": 5.0,
                    "height": 720,
                    "width": 1280,
                    "num_frames": 81,
                },
            ),
        ),
        notes=(
            "Only `blocks` is cached: the VACE blocks (`vace_blocks`, one per entry of `vace_layers`) all run before "
            "the main loop and compute on every call, cached or not (each returns its own hint, which a cached "
            "segment could not replay, and the cache decision comes after them); the hints the loop adds between "
            "main blocks are loop-body work, inside the stored residual. Control inputs (video, mask, reference "
            "images) are encoded once per call by the pipeline. Under context parallelism the control tokens share "
            "the video tokens' grid and are split alike at vace_blocks.0."
        ),
    )
)
