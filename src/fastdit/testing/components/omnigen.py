"""OmniGen's multimodal processor without torchvision (the tiny OmniGen pipelines).

``OmniGenPipeline.__init__`` wraps its tokenizer in ``OmniGenMultiModalProcessor``, which diffusers defines only
when torchvision is installed (its image transform is a torchvision ``Compose``). :func:`local_processor_class` is
that processor with the same transform written in torch: OmniGen's crop to multiples of 16 pixels, then
``ToTensor`` (HWC bytes to CHW floats in [0, 1]) and ``Normalize(0.5, 0.5)``. Prompt handling, placeholders, masks,
positions and padding are the processor's own (inherited).
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["local_processor_class", "omnigen_pipeline"]


def _processor_base() -> type:
    from diffusers.pipelines.omnigen.processor_omnigen import OmniGenMultiModalProcessor

    return OmniGenMultiModalProcessor


class _Transform:
    """crop_image, ToTensor and Normalize(mean=0.5, std=0.5) of one PIL image."""

    def __init__(self, max_image_size: int) -> None:
        self.max_image_size = max_image_size

    def __call__(self, image: Any) -> Any:
        import numpy as np
        import torch
        from diffusers.pipelines.omnigen.processor_omnigen import crop_image

        pixels = np.asarray(crop_image(image.convert("RGB"), self.max_image_size), dtype=np.uint8)
        tensor = torch.from_numpy(pixels.copy()).permute(2, 0, 1).float().div(255.0)
        return tensor.sub(0.5).div(0.5)


@functools.cache
def local_processor_class() -> type:
    """``LocalOmniGenProcessor``: diffusers' ``OmniGenMultiModalProcessor`` with a torch image transform (built on
    first use: the base class is imported from diffusers then)."""
    base = _processor_base()

    class LocalOmniGenProcessor(base):  # type: ignore[misc, valid-type]
        """``OmniGenMultiModalProcessor`` whose image transform needs no torchvision."""

        def __init__(self, text_tokenizer: Any, max_image_size: int = 1024) -> None:
            from diffusers.pipelines.omnigen.processor_omnigen import OmniGenCollator

            self.text_tokenizer = text_tokenizer
            self.max_image_size = max_image_size
            self.image_transform = _Transform(max_image_size)
            self.collator = OmniGenCollator()

        def reset_max_image_size(self, max_image_size: int) -> None:
            self.max_image_size = max_image_size
            self.image_transform = _Transform(max_image_size)

    LocalOmniGenProcessor.__module__ = __name__
    return LocalOmniGenProcessor


def omnigen_pipeline(**components: Any) -> Any:
    """``OmniGenPipeline(**components)``, its multimodal processor the local one when torchvision is missing.

    With torchvision installed the pipeline builds diffusers' own processor, as ``from_pretrained`` would.
    """
    from unittest import mock

    from diffusers import OmniGenPipeline
    from diffusers.pipelines.omnigen import pipeline_omnigen

    if hasattr(pipeline_omnigen, "OmniGenMultiModalProcessor"):
        return OmniGenPipeline(**components)
    # The name the pipeline's __init__ looks up, provided for that call only.
    with mock.patch.object(pipeline_omnigen, "OmniGenMultiModalProcessor", local_processor_class(), create=True):
        return OmniGenPipeline(**components)
