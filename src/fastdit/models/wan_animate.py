"""Wan 2.2 Animate (character animation and replacement): ``WanAnimateTransformer3DModel``.

Blocks (diffusers 0.42.1): one list ``blocks`` of Wan's ``WanTransformerBlock``, called positionally as
``block(hidden_states, encoder_hidden_states, timestep_proj, rotary_emb)`` and returning ``hidden_states`` (pattern 2).
Before the loop, forward adds the pose latents (``pose_patch_embedding``) to every frame's tokens but the first (the
reference frame) and encodes the face video into per-frame motion tokens (``motion_encoder`` then ``face_encoder``,
``motion_vec`` of shape ``(B, frames, heads + 1, dim)``). Inside the loop, after block ``i`` for every ``i`` that is a
multiple of ``config.inject_face_latents_blocks``, it adds ``face_adapter[i // inject](hidden_states, motion_vec)``
to the hidden states: loop-body work that depends on the block index. Each face adapter is a cross-attention grouped
by frame: the tokens of latent frame ``t`` attend to the motion tokens of frame ``t``.

Cache: only ``blocks`` is a block group; the face adapters are loop-body work, as Wan-VACE's hints are. On a computed
step they are inside the stored segment residual; on a cached step the pass-through blocks' additions are superseded
by that residual at the segment's last block, so threshold 0 and a disabled cache stay bit-identical.

``WanAnimate2Transformer3DModel`` (``transformer_wan_animate_2``) is another model, not a variant of this one: see
``wan_animate2.py``.
"""

from __future__ import annotations

import numpy as np

from fastdit.models._lazy import Deferred, LazyKwargs
from fastdit.models.base import BlockGroup, ForwardPattern, LatentLayout, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import (
    AttentionRouting,
    ContextParallelPlan,
    GatherInput,
    GatherOutput,
    SplitInput,
    SplitOutput,
)
from fastdit.parallel.tp_plan import TensorParallelPlan
from fastdit.parallel.tp_shapes import attention, wan_tp_plan

TRANSFORMER = "diffusers.models.transformers.transformer_wan_animate.WanAnimateTransformer3DModel"
_MODULE = "diffusers.models.transformers.transformer_wan_animate"

_Z_DIM = 16  # the Wan 2.1 VAE's latent channels, so its default latent statistics apply
_TEXT_DIM = 32
_IMAGE_DIM = 8  # the tiny CLIP vision tower's width
_FACE_SIZE = 16  # motion_encoder_size: the face video's square resolution
_SIZE = 32
_FRAMES = 5  # one segment of 5 pixel frames: 2 latent frames plus the reference frame
# Four blocks with a face adapter after blocks 0 and 2: after the front block (fn=1), and after the last middle block
# (inside the cached segment); none after the middle block 1 or the back block 3 (bn=1).
_LAYERS = 4
_INJECT = 2


def tiny_transformer(seed: int = 0):
    """A 4-block ``WanAnimateTransformer3DModel`` with face adapters after blocks 0 and 2."""
    from diffusers import WanAnimateTransformer3DModel

    from fastdit.testing.components.encoders import build

    return build(
        WanAnimateTransformer3DModel,
        seed=seed,
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=2 * _Z_DIM + 4,
        latent_channels=_Z_DIM,
        out_channels=_Z_DIM,
        text_dim=_TEXT_DIM,
        freq_dim=32,
        ffn_dim=32,
        num_layers=_LAYERS,
        image_dim=_IMAGE_DIM,
        rope_max_seq_len=32,
        # A 16-pixel face: two residual blocks (16 -> 8 -> 4), then a 4x4 convolution to one style vector.
        motion_encoder_channel_sizes={"16": 8, "8": 8, "4": 8},
        motion_encoder_size=_FACE_SIZE,
        motion_style_dim=8,
        motion_dim=4,
        motion_encoder_dim=8,
        face_encoder_hidden_dim=8,
        face_encoder_num_heads=2,
        inject_face_latents_blocks=_INJECT,
        motion_encoder_batch_size=4,
    )


def tiny_wan_animate(seed: int = 0):
    """A complete tiny ``WanAnimatePipeline`` (UMT5 text encoder, CLIP image encoder, Wan 2.1 VAE, UniPC)."""
    from diffusers import UniPCMultistepScheduler, WanAnimatePipeline

    from fastdit.testing.components.autoencoder_kl_wan import wan_components
    from fastdit.testing.components.clip_vision import clip_vision_model

    image_encoder, image_processor = clip_vision_model(hidden_size=_IMAGE_DIM, seed=seed)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0)
    return WanAnimatePipeline(
        transformer=tiny_transformer(seed),
        image_encoder=image_encoder,
        image_processor=image_processor,
        **wan_components(text_dim=_TEXT_DIM, scheduler=scheduler, seed=seed),
    )


def _video(count: int, size: int, seed: int, mode: str = "RGB") -> list:
    """``count`` random frames of ``size`` squared pixels (deterministic)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    shape = (size, size, 3) if mode == "RGB" else (size, size)
    return [Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode=mode) for _ in range(count)]


def _image(seed: int) -> object:
    """One random character image of the tiny size."""
    return _video(1, _SIZE, seed)[0]


_CALL = {
    "image": Deferred(_image, (1,)),
    "pose_video": Deferred(_video, (_FRAMES, _SIZE, 2)),
    "face_video": Deferred(_video, (_FRAMES, _FACE_SIZE, 3)),
    "prompt": "a cat dancing",
    "negative_prompt": "blue",
    "height": _SIZE,
    "width": _SIZE,
    "segment_frame_length": _FRAMES,
    "num_inference_steps": 2,
    "guidance_scale": 5.0,
    "max_sequence_length": 16,
}

# The replacement task: the character is composited into a background video inside a per-frame mask.
_REPLACE = {
    **_CALL,
    "mode": "replace",
    "background_video": Deferred(_video, (_FRAMES, _SIZE, 4)),
    "mask_video": Deferred(_video, (_FRAMES, _SIZE, 5, "L")),
}

# Context parallelism: Wan's plan (RoPE tables from `rope` split on dim 1, tokens split at blocks.0, output gathered at
# proj_out, text and CLIP tokens replicated with cross-attention local; the pose latents are added before the first
# block, so the split tokens already carry them) plus the face adapters. A face adapter groups its queries by latent
# frame (`unflatten(1, (frames, -1))`), which a token shard holding part of a frame cannot do, so each adapter
# gathers the hidden states it receives, runs on every token against the whole (replicated) motion tokens, as local
# attention, and its output is split again to this rank's shard (the same sizes as the blocks' split: one token
# sequence, one rule), which the loop adds to this rank's hidden states. The adapters are small (one attention of
# heads + 1 keys per frame, every `inject_face_latents_blocks` blocks), so computing them whole costs little.
CP_PLAN = ContextParallelPlan(
    inputs={
        "blocks.0": {"hidden_states": SplitInput(dim=1, expected_dims=3)},
        "face_adapter.*": {"hidden_states": GatherInput(dim=1, expected_dims=3)},
    },
    outputs={
        "rope": (SplitOutput(dim=1, expected_dims=4, index=0), SplitOutput(dim=1, expected_dims=4, index=1)),
        "face_adapter.*": SplitOutput(dim=1, expected_dims=3),
    },
    gather={"proj_out": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(modules=(_MODULE,), local=("face_adapter",)),
    notes=(
        "Wan plan (RoPE from `rope` split on dim 1, tokens split at blocks.0, text replicated); each face adapter "
        "gathers its input, attends frame by frame on every token, and its output is split again (GatherInput)."
    ),
)

# Tensor parallelism: Wan's plan over `blocks` plus the face adapters split by heads (their QK-norms are per head,
# over head_dim, so they stay local; the pre-norms are over the model width, which is not split).
_WAN_TP = wan_tp_plan("blocks", notes="")
TP_PLAN = TensorParallelPlan(
    layers={
        **_WAN_TP.layers,
        **attention("face_adapter.*", out="to_out"),
    },
    divide=(*_WAN_TP.divide, "face_adapter.*.heads"),
    optional=_WAN_TP.optional,
    notes=(
        "Wan's plan over blocks (attention by heads, QK-norms over the inner dim as ShardedNorm, FFN split); face "
        "adapters by heads (per-head QK-norms local); motion and face encoders, pose embedding whole."
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
        family="wan_animate",
        fused_projections=FUSED_PROJECTIONS,
        # hidden_states is (batch, channels, frames, height, width). The reference and mask channels appended to it
        # stay put from step to step (they dilute the signal); pose and face inputs arrive apart.
        latent=LatentLayout(),
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="blocks", pattern=ForwardPattern.P2),),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        tiny_pipelines=(
            TinyPipeline(name="animate", build=tiny_wan_animate, call_kwargs=LazyKwargs(_CALL)),
            TinyPipeline(name="replace", build=tiny_wan_animate, call_kwargs=LazyKwargs(_REPLACE)),
        ),
        presets=(
            ModelPreset(
                name="wan2.2-animate-14b",
                pipeline_class="diffusers.WanAnimatePipeline",
                hub_id="Wan-AI/Wan2.2-Animate-14B-Diffusers",
                defaults={
                    "num_inference_steps": 20,
                    "guidance_scale": 1.0,
                    "height": 720,
                    "width": 1280,
                    "segment_frame_length": 77,
                },
            ),
        ),
        notes=(
            "Loop-body work that depends on the block index: after every `inject_face_latents_blocks`-th block "
            "(0, 5, 10, ...) a face adapter adds frame-aligned cross-attention to the motion tokens; it is not a block "
            "group (it computes on every call, cached or not; on cached steps its additions are superseded by the "
            "segment residual). The motion and face encoders run once per call before the loop. The pipeline "
            "generates long videos segment by segment (a new run per segment) and by default runs without CFG "
            "(guidance_scale 1); with guidance the unconditional branch gets a blank face video."
        ),
    )
)
