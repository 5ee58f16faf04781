"""A tiny LLaVA text-and-image encoder (``LlavaForConditionalGeneration``) built locally (HunyuanVideo I2V).

A CLIP vision tower (32x32 images, 8x8 patches: 16 image features) feeds a tiny Llama through the LLaVA projector;
the tokenizer is :func:`fastdit.testing.components.llama.llama_tokenizer`, whose ``<image>`` token is the
placeholder the features replace.
"""

from __future__ import annotations

from fastdit.testing.components.encoders import build
from fastdit.testing.components.llama import llama_config, llama_tokenizer

__all__ = ["IMAGE_SIZE", "NUM_IMAGE_TOKENS", "llava_image_processor", "llava_model"]

IMAGE_SIZE = 32
_PATCH = 8
# The default feature selection drops the CLS token: one feature per patch.
NUM_IMAGE_TOKENS = (IMAGE_SIZE // _PATCH) ** 2


def llava_image_processor():
    """A PIL ``CLIPImageProcessor`` that resizes and centre-crops to the vision tower's 32x32 input."""
    from transformers import CLIPImageProcessorPil

    return CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )


def llava_model(hidden_size: int = 32, num_layers: int = 2, seed: int = 0):
    """``(LlavaForConditionalGeneration, PreTrainedTokenizerFast)`` with a CLIP vision tower and a Llama text model."""
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    tok = llama_tokenizer()
    vision = CLIPVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=_PATCH,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=llama_config(hidden_size, num_layers),
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        pad_token_id=tok.pad_token_id,
    )
    return build(LlavaForConditionalGeneration, config, seed=seed), tok
