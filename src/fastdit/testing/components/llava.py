"""A tiny LLaVA text-and-image encoder (``LlavaForConditionalGeneration``) built locally (HunyuanVideo I2V).

A CLIP vision tower (32x32 images, 8x8 patches: 16 image features) feeds a tiny Llama through the LLaVA projector;
the tokenizer is :func:`fastdit.testing.components.llama.llama_tokenizer`, whose ``<image>`` token is the
placeholder the features replace.
"""

from __future__ import annotations

from fastdit.testing.components.clip_vision import (
    CLIP_IMAGE_SIZE,
    CLIP_PATCH_SIZE,
    clip_image_processor,
    clip_vision_config,
)
from fastdit.testing.components.encoders import build
from fastdit.testing.components.llama import llama_config, llama_tokenizer

__all__ = ["IMAGE_SIZE", "NUM_IMAGE_TOKENS", "llava_image_processor", "llava_model"]

IMAGE_SIZE = CLIP_IMAGE_SIZE
# The default feature selection drops the CLS token: one feature per patch.
NUM_IMAGE_TOKENS = (IMAGE_SIZE // CLIP_PATCH_SIZE) ** 2


def llava_image_processor():
    """A PIL ``CLIPImageProcessor`` that resizes and centre-crops to the vision tower's 32x32 input."""
    return clip_image_processor(IMAGE_SIZE)


def llava_model(hidden_size: int = 32, num_layers: int = 2, seed: int = 0):
    """``(LlavaForConditionalGeneration, PreTrainedTokenizerFast)`` with a CLIP vision tower and a Llama text model."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    tok = llama_tokenizer()
    config = LlavaConfig(
        vision_config=clip_vision_config(hidden_size=16),
        text_config=llama_config(hidden_size, num_layers),
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        pad_token_id=tok.pad_token_id,
    )
    return build(LlavaForConditionalGeneration, config, seed=seed), tok
