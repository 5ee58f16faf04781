"""Quality of a run's outputs against a baseline's: PSNR and SSIM over every image or frame; for audio, waveform PSNR
and SNR and the SSIM of the log spectrogram over every waveform."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # scikit-image loads slowly: import it only when comparing
    from fastdit.metrics import Comparison

__all__ = ["clip_minima", "compare_outputs"]


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


def clip_minima(outputs: Sequence[np.ndarray], quality: Comparison) -> tuple[float, float] | None:
    """The worst clip's PSNR and SSIM, each clip judged by its mean over its frames (``None``: no video output).

    A video's quality goal is per clip (a clip whose frames score 40, 40 and 26 dB is a 35 dB clip), while
    :func:`compare_outputs` reports the worst *frame*; the clip means are read off its per-frame values, in order.

    Args:
        outputs: The outputs ``quality`` was computed on (one per case, in order).
        quality: :func:`compare_outputs` of them, with per-frame values.
    """
    if not any(output.ndim == 4 for output in outputs):
        return None
    psnr, ssim, start = [], [], 0
    for output in outputs:
        count = output.shape[0] if output.ndim == 4 else 1
        psnr.append(float(np.mean(quality.psnr_per_frame[start : start + count])))
        ssim.append(float(np.mean(quality.ssim_per_frame[start : start + count])))
        start += count
    return min(psnr), min(ssim)
