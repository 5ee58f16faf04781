"""Deterministic test images for the tiny image-conditioned pipelines (I2V, editing, img2img)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from PIL import Image

__all__ = ["random_image"]


def random_image(size: int = 32, *, seed: int = 0) -> Image.Image:
    """A square RGB image of uniform random pixels, the same for the same arguments.

    Args:
        size: Side in pixels.
        seed: Seed of the NumPy generator drawing the pixels.

    Returns:
        A new ``size`` x ``size`` PIL image (a fresh object on every call: pipelines may resize or convert it).
    """
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8))
