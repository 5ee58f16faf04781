"""A tiny SigLIP vision tower (``SiglipVisionModel``) and its image processor, built locally (I2V image encoders).

32x32 images in 8x8 patches: 16 image tokens (SigLIP has no CLS token).
"""

from __future__ import annotations

from fastdit.testing.components.encoders import build

__all__ = ["NUM_IMAGE_TOKENS", "siglip_vision_model"]

_IMAGE_SIZE = 32
_PATCH = 8
NUM_IMAGE_TOKENS = (_IMAGE_SIZE // _PATCH) ** 2


def siglip_vision_model(hidden_size: int = 16, seed: int = 0):
    """``(SiglipVisionModel, SiglipImageProcessorPil)``; the processor resizes any image to 32x32."""
    from transformers import SiglipImageProcessorPil, SiglipVisionConfig, SiglipVisionModel

    config = SiglipVisionConfig(
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=_IMAGE_SIZE,
        patch_size=_PATCH,
    )
    processor = SiglipImageProcessorPil(size={"height": _IMAGE_SIZE, "width": _IMAGE_SIZE})
    return build(SiglipVisionModel, config, seed=seed), processor
