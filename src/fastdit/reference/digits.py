"""Generate digits with the reference pipeline and check which digit was drawn.

The check is an independent classifier: an SVC fitted on scikit-learn's original 8x8 digits, applied to generated
images pooled back down to 8x8. scikit-learn is a test/benchmark dependency, so it is imported only when used.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from fastdit.reference import REFERENCE_DEFAULTS, digit_prompt

__all__ = ["digit_accuracy", "digit_features", "fit_digit_classifier", "generate_digits"]


def generate_digits(pipe: Any, digits: Sequence[int], seeds: Sequence[int], **overrides: Any) -> np.ndarray:
    """Generate one image per ``(digit, seed)`` pair in a single batched pipeline call.

    Each image draws its initial noise from its own CPU generator seeded with its seed, so an image depends on its
    seed alone (not on its place in the batch) and CPU and GPU runs start from the same noise.

    Args:
        pipe: The reference ``FluxPipeline`` (or an accelerated one).
        digits: Digits to draw (0-9).
        seeds: One seed per digit.
        **overrides: Call arguments replacing :data:`REFERENCE_DEFAULTS` (e.g. ``negative_prompt``,
            ``true_cfg_scale``).

    Returns:
        ``(N, H, W, 3)`` float32 images in [0, 1].
    """
    if len(digits) != len(seeds):
        raise ValueError(f"len(digits)={len(digits)} != len(seeds)={len(seeds)}: pass one seed per digit")
    kwargs = {**REFERENCE_DEFAULTS, "output_type": "np", **overrides}
    generators = [torch.Generator().manual_seed(int(s)) for s in seeds]
    with torch.no_grad():
        images = pipe([digit_prompt(int(d)) for d in digits], generator=generators, **kwargs).images
    return np.asarray(images, dtype=np.float32)


def digit_features(images: np.ndarray) -> np.ndarray:
    """Pool ``(N, H, W, C)`` images in [0, 1] to scikit-learn's digit format: ``(N, 64)`` grey levels in 0-16."""
    n, h, w, _ = images.shape
    if h % 8 or w % 8:
        raise ValueError(f"image size {h}x{w}: must be a multiple of 8 to pool to 8x8")
    grey = images.mean(axis=-1)
    pooled = grey.reshape(n, 8, h // 8, 8, w // 8).mean(axis=(2, 4))
    return (pooled * 16.0).reshape(n, 64)


def fit_digit_classifier() -> Any:
    """An RBF SVC fitted on all 1,797 scikit-learn digits (about 99% accurate on held-out digits)."""
    from sklearn.datasets import load_digits
    from sklearn.svm import SVC

    data = load_digits()
    return SVC(gamma=0.001, C=10.0).fit(data.data, data.target)


def digit_accuracy(images: np.ndarray, digits: Sequence[int], classifier: Any) -> float:
    """Fraction of ``images`` the classifier reads as the digit that was requested."""
    predicted = classifier.predict(digit_features(images))
    return float(np.mean(predicted == np.asarray(digits)))
