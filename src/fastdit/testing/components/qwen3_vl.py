"""A tiny Qwen3-VL encoder (``Qwen3VLModel``: text tower plus a one-block vision tower) built locally (Krea 2).

It shares the Qwen3 tokenizer of :mod:`fastdit.testing.components.qwen3` (Qwen3-VL checkpoints use the same
vocabulary and ChatML special tokens).
"""

from __future__ import annotations

from functools import cache
from typing import Any

from fastdit.testing.components.decoder_lm import decoder_lm_kwargs, vision_token_ids
from fastdit.testing.components.encoders import build
from fastdit.testing.components.qwen3 import qwen3_tokenizer

__all__ = [
    "image_only_processor_class",
    "qwen3_vl_config",
    "qwen3_vl_generation_model",
    "qwen3_vl_model",
    "qwen3_vl_processor",
]


def qwen3_vl_config(hidden_size: int = 32, num_layers: int = 2):
    """A ``Qwen3VLConfig`` for :func:`qwen3_tokenizer`: 2 query heads over 1 KV head of 16, interleaved M-RoPE
    (2, 3, 3), a one-block vision tower."""
    from transformers import Qwen3VLConfig

    tok = qwen3_tokenizer()
    return Qwen3VLConfig(
        text_config=decoder_lm_kwargs(
            tok,
            hidden_size,
            num_layers,
            token_ids=("pad",),
            # The three sections split head_dim / 2 frequencies over the (t, h, w) position axes.
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        ),
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_heads": 2,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": hidden_size,
            "num_position_embeddings": 16,
            "deepstack_visual_indexes": [0],
        },
        **vision_token_ids(tok),
    )


def qwen3_vl_model(hidden_size: int = 32, num_layers: int = 2, seed: int = 0):
    """``(Qwen3VLModel, Qwen2TokenizerFast)`` of :func:`qwen3_vl_config`."""
    from transformers import Qwen3VLModel

    return build(Qwen3VLModel, qwen3_vl_config(hidden_size, num_layers), seed=seed), qwen3_tokenizer()


def qwen3_vl_generation_model(hidden_size: int = 32, num_layers: int = 2, seed: int = 0):
    """``(Qwen3VLForConditionalGeneration, Qwen2TokenizerFast)`` of :func:`qwen3_vl_config` (DreamLite's encoder:
    the pipelines read its last hidden states)."""
    from transformers import Qwen3VLForConditionalGeneration

    config = qwen3_vl_config(hidden_size, num_layers)
    return build(Qwen3VLForConditionalGeneration, config, seed=seed), qwen3_tokenizer()


@cache
def image_only_processor_class() -> type:
    """``Qwen3VLProcessor`` without its video slot (images and text only).

    transformers 5 validates every sub-processor slot at construction and the video processor's base class needs
    torchvision; the pipelines never pass videos, so the slot is left out (built on first use: transformers loads
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


def qwen3_vl_processor(tokenizer: Any, *, image_size: int = 32):
    """A Qwen3-VL processor for :func:`qwen3_vl_model` that resizes every image to ``image_size`` squared pixels.

    Args:
        tokenizer: The tokenizer :func:`qwen3_vl_model` returned.
        image_size: Target side in pixels, a multiple of 32 (patch 16 x spatial merge 2); 32 gives one merged token.

    Returns:
        An image-only ``Qwen3VLProcessor`` (min == max pixels pins the resize: real checkpoints allow ~1 MP).
    """
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if image_size % 32:
        raise ValueError(f"image_size={image_size}: must be a multiple of 32 (patch 16 x spatial merge 2)")
    pixels = image_size * image_size
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=pixels, max_pixels=pixels, patch_size=16, merge_size=2, temporal_patch_size=2
    )
    return image_only_processor_class()(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=tokenizer.chat_template
    )
