"""Quality of a run's outputs against a baseline's: PSNR and SSIM over every image or frame; for audio, waveform PSNR
and SNR and the SSIM of the log spectrogram over every waveform."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # scikit-image loads slowly: import it only when comparing
    from fastdit.metrics import Comparison

__all__ = ["compare_outputs"]


def _frames(outputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    return [frame for output in outputs for frame in (output if output.ndim == 4 else [output])]


def compare_outputs(reference: Sequence[np.ndarray], test: Sequence[np.ndarray], *, audio: bool = False) -> Comparison:
    """PSNR and SSIM of ``test`` against ``reference``, frame by frame over every output.

    Args:
        reference: The baseline's outputs, ``(H, W, C)`` images or ``(F, H, W, C)`` videos; with ``audio``,
            ``(channels, samples)`` waveforms in [-1, 1].
        test: The same number of outputs of the same shapes.
        audio: The outputs are waveforms: :func:`fastdit.metrics.compare_audio` (PSNR over full scale, SNR, SSIM of
            the log-magnitude spectrogram), waveform by waveform.

    Returns:
        Means and minima over all images, frames or waveforms.

    Raises:
        ValueError: Outputs the metrics cannot compare (images below the SSIM window, waveforms too short for a
            spectrogram).
    """
    if audio:
        from fastdit.metrics import compare_audio

        return compare_audio(list(reference), list(test))
    from fastdit.metrics import compare

    return compare(_frames(reference), _frames(test))
