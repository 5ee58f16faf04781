"""Quality of a run's outputs against a baseline's: PSNR and SSIM over every image or frame."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # scikit-image loads slowly: import it only when comparing
    from fastdit.metrics import Comparison

__all__ = ["compare_outputs"]


def _frames(outputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    return [frame for output in outputs for frame in (output if output.ndim == 4 else [output])]


def compare_outputs(reference: Sequence[np.ndarray], test: Sequence[np.ndarray]) -> Comparison:
    """PSNR and SSIM of ``test`` against ``reference``, frame by frame over every output.

    Args:
        reference: The baseline's outputs, ``(H, W, C)`` images or ``(F, H, W, C)`` videos.
        test: The same number of outputs of the same shapes.

    Returns:
        Means and minima over all images or frames.
    """
    from fastdit.metrics import compare

    return compare(_frames(reference), _frames(test))
