"""A tiny Qwen2-VL/Qwen2.5-VL processor (text + images) built locally, for the image-editing pipelines.

The model and tokenizer come from :func:`fastdit.testing.components.encoders.qwen2_5_vl_model`; this module adds the
processor that turns a prompt with ``<|image_pad|>`` placeholders and PIL images into ``input_ids``,
``pixel_values`` and ``image_grid_thw``.

transformers 5 validates every sub-processor slot of ``Qwen2VLProcessor`` at construction, including the video
processor, whose base class only exists when torchvision is installed. The editing pipelines never pass videos, so
the processor class here declares no video slot; everything else is the stock processor.
"""

from __future__ import annotations

from functools import cache
from typing import Any

__all__ = ["image_only_processor_class", "qwen2_vl_processor"]


@cache
def image_only_processor_class() -> type:
    """The ``Qwen2VLProcessor`` subclass without a video slot (built on first use: transformers loads lazily)."""
    from transformers import Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        """``Qwen2VLProcessor`` without a video processor slot (images and text only)."""

        def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None):
            # The attributes Qwen2VLProcessor.__init__ sets before delegating to ProcessorMixin; the mixin derives
            # the sub-processor slots from this signature, so leaving video_processor out removes the slot.
            self.image_token = getattr(tokenizer, "image_token", "<|image_pad|>")
            self.video_token = getattr(tokenizer, "video_token", "<|video_pad|>")
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    ImageOnlyQwen2VLProcessor.__module__ = __name__
    return ImageOnlyQwen2VLProcessor


def qwen2_vl_processor(tokenizer: Any = None, *, image_size: int = 56):
    """A Qwen2-VL processor whose image processor resizes every image to about ``image_size`` squared pixels.

    Args:
        tokenizer: The Qwen2 tokenizer to wrap (the shared tiny one if ``None``).
        image_size: Target side in pixels; a multiple of 28 (patch 14 x merge 2). 56 gives 4 image tokens.

    Returns:
        An image-only ``Qwen2VLProcessor`` matching the vision tower of ``qwen2_5_vl_model`` (patch 14, merge 2,
        temporal patch 2).
    """
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from fastdit.testing.components.tokenizers import qwen2_tokenizer

    if image_size % 28:
        raise ValueError(f"image_size={image_size}: must be a multiple of 28 (patch 14 x spatial merge 2)")
    pixels = image_size * image_size
    # min == max pins the resize: real checkpoints allow up to ~1 MP, which is far too slow for CPU tests.
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=pixels, max_pixels=pixels, patch_size=14, merge_size=2, temporal_patch_size=2
    )
    return image_only_processor_class()(image_processor=image_processor, tokenizer=tokenizer or qwen2_tokenizer())
