"""A tiny CLIP vision tower (``CLIPVisionModel``) and its PIL image processor, built locally (I2V image encoders).

32x32 images in 8x8 patches: 16 patch tokens plus the class token. Wan 2.1 I2V, SkyReels-V2 I2V and ChronoEdit
condition on these features; LLaVA-style encoders reuse the processor.
"""

from __future__ import annotations

from fastdit.testing.components.encoders import build

__all__ = ["CLIP_IMAGE_SIZE", "CLIP_PATCH_SIZE", "clip_image_processor", "clip_vision_config", "clip_vision_model"]

CLIP_IMAGE_SIZE = 32
CLIP_PATCH_SIZE = 8


def clip_image_processor(size: int = CLIP_IMAGE_SIZE):
    """A PIL ``CLIPImageProcessor`` that resizes the shorter side to ``size`` and centre-crops to ``size`` squared."""
    from transformers import CLIPImageProcessorPil

    return CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size})


def clip_vision_config(hidden_size: int = 8):
    """A ``CLIPVisionConfig`` for 32x32 images: 2 layers, 2 heads, an MLP twice ``hidden_size`` wide."""
    from transformers import CLIPVisionConfig

    return CLIPVisionConfig(
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=CLIP_IMAGE_SIZE,
        patch_size=CLIP_PATCH_SIZE,
    )


def clip_vision_model(hidden_size: int = 8, seed: int = 0):
    """``(CLIPVisionModel, CLIPImageProcessorPil)`` of :func:`clip_vision_config` and :func:`clip_image_processor`.

    Args:
        hidden_size: Width of the tower (the transformer's ``image_dim``).
        seed: RNG seed for the weights.

    Returns:
        The vision model in ``eval()`` mode and the processor for its 32x32 input.
    """
    from transformers import CLIPVisionModel

    return build(CLIPVisionModel, clip_vision_config(hidden_size), seed=seed), clip_image_processor()
