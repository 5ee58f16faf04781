"""Qwen-Image 2.1: ``QwenImage21Transformer2DModel``, a single-stream DiT with block-causal attention.

Blocks (diffusers 0.42.1): one list, ``transformer_blocks`` (32 single-stream ``QwenImage21TransformerBlock``), called
by keyword with ``(hidden_states, modulation, rotary_emb, attention_mask, target_token_mask, layer_cache,
kv_cache_mode, cache_write_slice, segments, key_valid)`` on the joint sequence and returning one tensor (pattern 3).
Nothing runs between blocks.

How it differs from Qwen-Image (``qwenimage.py``):

- one joint stream instead of two: the root substitutes the condition images' latent tokens into the text stream at
  the vision-language encoder's ``<|image_pad|>`` slots (one slot = 2x2 latent tokens) and appends the target image;
  the output covers the whole joint sequence and the pipeline keeps its last (target) tokens;
- one shared ``modulation`` projection computed before the loop (blocks hold no modulation weights); with
  ``causal_condition`` text and condition-image tokens modulate from ``t = 0`` (``target_token_mask``);
- block-causal attention: causal over the sequence, bidirectional inside each image block. The default processor
  runs it as one attention call per prefix segment plus one for the target, slicing q/k/v by global positions;
- a text-side KV cache (``use_kv_cache=True``, the pipeline default): the first step prefills the prefix keys and
  values, later steps feed only the target image's tokens through the blocks;
- the text encoder is Qwen3-VL (``Qwen3VLForConditionalGeneration`` + ``Qwen3VLProcessor``), the VAE
  ``AutoencoderKLQwenImage21`` (16x, RGBA), latents unpatched.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from fastdit.models._lazy import LazyKwargs, tiny_image
from fastdit.models.base import BlockGroup, ForwardPattern, ModelAdapter, ModelPreset, StepInvariant, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, HeadParallel, SplitInput
from fastdit.parallel.tp_plan import Colwise, Rowwise, TensorParallelPlan
from fastdit.parallel.tp_shapes import attention, under

TRANSFORMER = "diffusers.models.transformers.transformer_qwenimage21.QwenImage21Transformer2DModel"

_LATENT_CHANNELS = 4
# The pipeline hard-codes a 16x VAE; condition images are resized to about ``output_resolution`` squared pixels.
_RESOLUTION = 64


def tiny_transformer(seed: int = 0, *, num_layers: int = 3):
    """A 3-block ``QwenImage21Transformer2DModel`` (2 heads x 16, text width 32) for 4-channel unpatched latents."""
    from diffusers import QwenImage21Transformer2DModel

    from fastdit.testing.components.encoders import build

    return build(
        QwenImage21Transformer2DModel,
        seed=seed,
        in_channels=_LATENT_CHANNELS,
        out_channels=_LATENT_CHANNELS,
        num_layers=num_layers,
        attention_head_dim=16,
        num_attention_heads=2,
        context_in_dim=32,
        axes_dims_rope=(4, 6, 6),
    )


def tiny_vae(seed: int = 0):
    """A tiny ``AutoencoderKLQwenImage21``: 4 spatial downsamples (the pipeline's fixed 16x), RGBA in and out."""
    from diffusers import AutoencoderKLQwenImage21

    from fastdit.testing.components.encoders import build

    return build(
        AutoencoderKLQwenImage21,
        seed=seed,
        base_dim=4,
        decoder_base_dim=4,
        z_dim=_LATENT_CHANNELS,
        dim_mult=[1] * 5,
        num_res_blocks=0,
        temperal_downsample=[False] * 4,
        latents_mean=[0.0] * _LATENT_CHANNELS,
        latents_std=[1.0] * _LATENT_CHANNELS,
    )


@cache
def _image_only_processor_class() -> type:
    """``Qwen3VLProcessor`` without its video slot.

    transformers 5 validates every sub-processor slot at construction and the video processor's base class needs
    torchvision; the pipeline never passes videos, so the slot is left out (built on first use: transformers loads
    lazily).
    """
    from transformers import Qwen3VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlyQwen3VLProcessor(Qwen3VLProcessor):
        """``Qwen3VLProcessor`` without a video processor slot (images and text only)."""

        def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None):
            # The attributes Qwen3VLProcessor.__init__ sets around ProcessorMixin.__init__; the mixin derives the
            # sub-processor slots from this signature, so leaving video_processor out removes the slot.
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
            self.vision_start_token, self.vision_end_token = "<|vision_start|>", "<|vision_end|>"
            self.vision_start_token_id = tokenizer.convert_tokens_to_ids(self.vision_start_token)
            self.vision_end_token_id = tokenizer.convert_tokens_to_ids(self.vision_end_token)

    ImageOnlyQwen3VLProcessor.__module__ = __name__
    return ImageOnlyQwen3VLProcessor


def tiny_processor(tokenizer: Any):
    """A Qwen3-VL processor whose images become 4x4 patches of 16 px (2x2 merged slots) at ``_RESOLUTION`` squared.

    min == max pins the resize so that each merged slot stands for exactly the 2x2 latent tokens the transformer
    expects of a square condition image resized to ``output_resolution = _RESOLUTION``.
    """
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    pixels = _RESOLUTION * _RESOLUTION
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=pixels, max_pixels=pixels, patch_size=16, merge_size=2, temporal_patch_size=2
    )
    return _image_only_processor_class()(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=tokenizer.chat_template
    )


def tiny_qwen_image21(seed: int = 0):
    """A complete tiny ``QwenImage21Pipeline`` (Qwen3-VL encoder with a one-block vision tower, 16x RGBA VAE)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline
    from transformers import Qwen3VLForConditionalGeneration

    from fastdit.testing.components.encoders import build
    from fastdit.testing.components.qwen3_vl import qwen3_vl_model

    # The component gives the bare Qwen3VLModel; the pipeline reads ``text_encoder.model``, so wrap its config.
    encoder, tokenizer = qwen3_vl_model(seed=seed)
    text_encoder = build(Qwen3VLForConditionalGeneration, encoder.config, seed=seed)
    return QwenImage21Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=tiny_vae(seed),
        text_encoder=text_encoder,
        processor=tiny_processor(tokenizer),
        transformer=tiny_transformer(seed),
    )


# A negative prompt with true_cfg_scale > 1 runs true CFG: two transformer calls per step ("cond"/"uncond" contexts).
# The prefix KV cache (the pipeline default) is off here: with it the joint stream shrinks after the first step, so
# the step after the first is always computed, which the shared forced-schedule test does not expect; the family's
# test file runs it on its own (tests/models/test_qwenimage21.py).
_CALL = {
    "prompt": "a cat holding a sign",
    "negative_prompt": "blue",
    "true_cfg_scale": 4.0,
    "num_inference_steps": 2,
    "use_kv_cache": False,
}

# Context parallelism: forward builds the joint sequence itself (condition-image tokens substituted into the text at
# the encoder's image slots, the target appended), so the tokens are split at the first block, and the per-token
# modulation-row mask (`target_token_mask`, (S,)) at every block. Both processors work on the global sequence: the
# default one slices q/k/v by global segment positions for one attention call per segment, the flex one hands a
# BlockMask over the whole sequence to flex attention, and the prefix KV cache stores the prefix's keys and values
# whole. So every block's attention is head-parallel: q/k/v leave to_q/to_k/to_v (the QK-norms are per head) as the
# whole sequence of this rank's heads, the processor runs as on one device with the RoPE table, segments, key mask,
# BlockMask and cache slice all global (passed whole), each rank's KV cache holding its heads, and to_out.0 takes the
# result back to the rank's tokens. The processors reshape by `inner_dim // heads` (the head dim), which stays right
# with both attributes whole. The output is gathered after the last block (norm_out reads the whole mask).
CP_PLAN = ContextParallelPlan(
    inputs={
        "transformer_blocks.0": {"hidden_states": SplitInput(dim=1, expected_dims=3)},
        "transformer_blocks.*": {"target_token_mask": SplitInput(dim=0, expected_dims=1)},
    },
    gather={"transformer_blocks.-1": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(
        head_parallel={"transformer_blocks.*.attn": HeadParallel(inputs=("to_q", "to_k", "to_v"), output="to_out.0")}
    ),
    notes="Joint tokens split at transformer_blocks.0 and the target-token mask at every block; attention "
    "head-parallel (each processor, its global segments, BlockMask and prefix KV cache on the whole sequence of the "
    "rank's heads); gathered after the last block.",
)

# Tensor parallelism (diffusers' `_tp_plan`): one joint stream whose attention and SwiGLU (separate gate and up
# projections) split Megatron-style. The one shared modulation linear feeds every block and stays whole. The
# processors take head_dim as inner_dim // heads, so both are divided.
TP_PLAN = TensorParallelPlan(
    layers=under(
        "transformer_blocks.*",
        {
            **attention("attn"),
            "img_mlp.proj": Colwise(),
            "img_mlp.gate_layer": Colwise(),
            "img_mlp.out": Rowwise(),
        },
    ),
    divide=("transformer_blocks.*.attn.heads", "transformer_blocks.*.attn.inner_dim"),
    notes="diffusers' plan (attention and SwiGLU split); the shared modulation stays whole.",
)

# The pipeline passes the same prompt embeddings, img_shapes and image-slot mask (img_mask) at every step (one set per
# CFG branch, made before the loop). The text projection reads encoder_hidden_states directly; the rotary table is
# computed from img_shapes[0] and a token mask forward expands from img_mask (a new tensor every call): keyed on the
# transformer's img_mask, img_shapes by value. Serving it also saves the table's host read of the mask (.tolist()).
STEP_INVARIANT = (
    StepInvariant("txt_in", inputs=("encoder_hidden_states",)),
    StepInvariant("pos_embed", inputs=("img_mask",)),
)

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "transformer_blocks": (
        ("attn.to_q", "attn.to_k", "attn.to_v"),
        ("img_mlp.gate_layer", "img_mlp.proj"),
    ),
}

ADAPTER = register(
    ModelAdapter(
        family="qwenimage21",
        fused_projections=FUSED_PROJECTIONS,
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="transformer_blocks", pattern=ForwardPattern.P3),),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        step_invariant=STEP_INVARIANT,
        tiny_pipelines=(
            TinyPipeline(
                name="t2i",
                build=tiny_qwen_image21,
                call_kwargs={**_CALL, "height": _RESOLUTION, "width": _RESOLUTION},
            ),
            # A condition image: its latent tokens are substituted into the text stream at the encoder's image slots.
            TinyPipeline(
                name="edit",
                build=tiny_qwen_image21,
                call_kwargs=LazyKwargs({**_CALL, "image": tiny_image(_RESOLUTION), "output_resolution": _RESOLUTION}),
            ),
        ),
        presets=(
            ModelPreset(
                name="qwen-image-2.1",
                pipeline_class="diffusers.QwenImage21Pipeline",
                hub_id="Qwen/Qwen-Image-2.1",
                defaults={"num_inference_steps": 40, "true_cfg_scale": 1.0, "height": 1024, "width": 1024},
            ),
        ),
        notes=(
            "One joint text/image stream (pattern 3): condition-image tokens sit inside the text at the encoder's "
            "image slots and the output covers the whole sequence (the pipeline keeps the target tokens). RoPE, the "
            "block-causal structure and the shared modulation are built per forward from img_shapes and img_mask. "
            "With the pipeline's default prefix KV cache (use_kv_cache=True) the first step runs the whole joint "
            "sequence and later steps only the target tokens, so the step after the first is always computed (its "
            "residuals do not match the first step's shape) and caching starts from the third step; the blocks' KV "
            "cache is only read on later steps, so skipped blocks leave it valid. Sampled without CFG by default "
            "(true_cfg_scale 1.0). Context parallelism splits the joint tokens at the first block; since both "
            "processors work on the global sequence (the default one slices q/k/v by global segment positions, the "
            "flex one passes a BlockMask over the whole sequence, the prefix KV cache stores the prefix whole), the "
            "attention is head-parallel (`AttentionRouting.head_parallel`): each processor runs unchanged on the "
            "whole sequence of the rank's heads (Ulysses: heads/U each; ring: the sequence gathered, all heads), "
            "every rank's KV cache holding its heads."
            " No spectral signal: the latent arrives packed into a token sequence (batch, tokens, channels): no grid "
            "to filter."
        ),
    )
)
