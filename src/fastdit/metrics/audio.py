"""Audio quality metrics: waveform PSNR and SNR, and SSIM of the log-magnitude spectrogram.

An audio output is a waveform ``(channels, samples)`` (or ``(samples,)`` for mono), float, at full scale in
[-1, 1]; a batch is ``(N, channels, samples)``. Definitions (what every fastdit report means by them for audio):

* **PSNR** (dB) = ``10 · log10(L² / MSE)`` over every sample of every channel of one waveform, with ``L`` =
  :data:`AUDIO_RANGE` = 2, the peak-to-peak range of full scale. Identical waveforms give ``inf``.
* **SNR** (dB) = ``10 · log10(Σ a² / Σ (a − b)²)``: the reference's energy over the error's. Unlike PSNR it does not
  depend on a nominal range, so a quiet output is not flattered by the headroom it leaves. ``inf`` when identical,
  ``-inf`` when the reference is silent and the test is not.
* **SSIM** is computed on the **log-magnitude spectrogram**, not the waveform: a sample-by-sample structure index of
  a waveform says little (a phase shift that is inaudible decorrelates it), while the spectrogram is the
  time-frequency picture a listener's ear resolves. Per channel: ``torch.stft`` with a periodic Hann window of
  ``n_fft`` samples (:data:`N_FFT`, halved for short waveforms so that the spectrogram has at least
  :data:`~fastdit.metrics.quality.SSIM_WINDOW` frames, at least :data:`MIN_N_FFT`), hop ``n_fft // 4``, centred
  (reflect padding); magnitude in dB, ``20 · log10(max(|X|, 1e-5))``; both spectrograms clipped to the
  :data:`DYNAMIC_RANGE_DB` below the *reference's* peak and scaled to [0, 1] by that same window; then the image
  SSIM of :mod:`fastdit.metrics.quality` (11×11 Gaussian, σ = 1.5, data range 1) on the ``(frequency, time)``
  image, averaged over the channels. A waveform too short for that (fewer than ``2.5 · MIN_N_FFT`` samples) has no
  spectral SSIM: :func:`compare_audio` raises :class:`ValueError` if it is asked for.

Batches are compared item by item; the mean and the minimum (the worst item) are reported, as for images.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from fastdit.metrics.quality import SSIM_WINDOW, Comparison

__all__ = [
    "AUDIO_METRICS",
    "AUDIO_RANGE",
    "DYNAMIC_RANGE_DB",
    "MIN_N_FFT",
    "N_FFT",
    "as_waveforms",
    "compare_audio",
    "log_spectrogram",
    "snr",
    "spectral_n_fft",
    "spectral_ssim",
    "waveform_psnr",
]

AUDIO_METRICS: tuple[str, ...] = ("psnr", "snr", "ssim")
"""Metric names :func:`compare_audio` understands (``ssim``: of the log spectrogram)."""

AUDIO_RANGE = 2.0
"""``L`` of the waveform PSNR: full scale is [-1, 1]."""

N_FFT = 1024
"""STFT size of the spectral SSIM for waveforms long enough (about 23 ms at 44.1 kHz)."""

MIN_N_FFT = 32
"""The smallest STFT size (17 frequency bins, above the 11-bin SSIM window)."""

DYNAMIC_RANGE_DB = 80.0
"""How far below the reference's spectral peak the spectral SSIM looks; quieter bins count as silence."""

_MAG_FLOOR = 1e-5  # -100 dB: log of an exact zero


def _to_numpy(value: Any) -> np.ndarray:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return value.detach().float().cpu().numpy()
    if isinstance(value, np.ndarray):
        return value
    raise TypeError(f"expected a numpy array or torch tensor of audio, got {type(value).__name__}")


def as_waveforms(value: Any) -> list[np.ndarray]:
    """Split audio into a list of ``(channels, samples)`` float64 waveforms.

    Args:
        value: ``(samples,)`` (one mono waveform), ``(channels, samples)`` (one waveform) or
            ``(N, channels, samples)`` (a batch), as a numpy array or torch tensor; or a list/tuple of waveforms.

    Raises:
        ValueError: Another number of dims, or no samples.
    """
    if isinstance(value, (list, tuple)):
        return [w for item in value for w in as_waveforms(item)]
    array = _to_numpy(value).astype(np.float64)
    if array.ndim == 1:
        array = array[None]
    if array.ndim == 2:
        items = [array]
    elif array.ndim == 3:
        items = list(array)
    else:
        raise ValueError(
            f"expected audio of shape (samples,), (channels, samples) or (N, channels, samples), got shape "
            f"{tuple(array.shape)}"
        )
    if items[0].shape[-1] == 0:
        raise ValueError(f"audio of shape {tuple(array.shape)} has no samples")
    return items


def waveform_psnr(a: np.ndarray, b: np.ndarray, data_range: float = AUDIO_RANGE) -> float:
    """PSNR in dB of waveform ``b`` against ``a`` (same shape), ``inf`` when identical."""
    mse = float(np.mean((a - b) ** 2))
    return math.inf if mse == 0 else 10.0 * math.log10(data_range**2 / mse)


def snr(a: np.ndarray, b: np.ndarray) -> float:
    """SNR in dB of waveform ``b`` against the reference ``a``: reference energy over error energy."""
    error = float(np.sum((a - b) ** 2))
    if error == 0:
        return math.inf
    signal = float(np.sum(a**2))
    return -math.inf if signal == 0 else 10.0 * math.log10(signal / error)


def spectral_n_fft(samples: int) -> int:
    """The STFT size for a waveform of ``samples``: :data:`N_FFT`, halved until the centred STFT (hop
    ``n_fft // 4``) has at least 11 frames.

    Raises:
        ValueError: Even :data:`MIN_N_FFT` gives fewer frames (the waveform is shorter than ``2.5 · MIN_N_FFT``).
    """
    n_fft = N_FFT
    while n_fft >= MIN_N_FFT:
        if 1 + samples // (n_fft // 4) >= SSIM_WINDOW:
            return n_fft
        n_fft //= 2
    raise ValueError(
        f"spectral SSIM needs at least {SSIM_WINDOW} STFT frames of {MIN_N_FFT} samples (hop {MIN_N_FFT // 4}), "
        f"i.e. {(SSIM_WINDOW - 1) * MIN_N_FFT // 4} samples; got {samples}"
    )


def log_spectrogram(waveform: np.ndarray, n_fft: int) -> np.ndarray:
    """The magnitude spectrogram in dB of each channel, ``(channels, n_fft // 2 + 1, frames)``, via ``torch.stft``.

    Args:
        waveform: ``(channels, samples)``.
        n_fft: STFT size (a periodic Hann window of that length, hop ``n_fft // 4``, centred with reflect padding).
    """
    import torch

    signal = torch.from_numpy(np.ascontiguousarray(waveform, dtype=np.float64))
    # Reflect padding needs more samples than half the window; shorter waveforms are padded with zeros instead.
    pad_mode = "reflect" if signal.shape[-1] > n_fft // 2 else "constant"
    spectrum = torch.stft(
        signal,
        n_fft=n_fft,
        hop_length=n_fft // 4,
        window=torch.hann_window(n_fft, dtype=torch.float64),
        center=True,
        pad_mode=pad_mode,
        return_complex=True,
    )
    return (20.0 * torch.log10(spectrum.abs().clamp_min(_MAG_FLOOR))).numpy()


def spectral_ssim(a: np.ndarray, b: np.ndarray) -> float:
    """SSIM of the log-magnitude spectrograms of waveforms ``a`` (reference) and ``b`` (see the module docstring).

    Raises:
        ValueError: The waveforms are too short for an 11-frame spectrogram.
    """
    from fastdit.metrics.quality import _pair_ssim

    n_fft = spectral_n_fft(a.shape[-1])
    spec_a, spec_b = log_spectrogram(a, n_fft), log_spectrogram(b, n_fft)
    top = float(spec_a.max())
    # One window for both, set by the reference: the test is judged on the scale the reference is heard at.
    low = top - DYNAMIC_RANGE_DB
    scaled_a = (np.clip(spec_a, low, top) - low) / DYNAMIC_RANGE_DB
    scaled_b = (np.clip(spec_b, low, top) - low) / DYNAMIC_RANGE_DB
    return float(np.mean([_pair_ssim(x, y, 1.0) for x, y in zip(scaled_a, scaled_b, strict=True)]))


_PAIR = {"psnr": waveform_psnr, "snr": snr, "ssim": spectral_ssim}


def compare_audio(a: Any, b: Any, *, metrics: Sequence[str] = AUDIO_METRICS) -> Comparison:
    """Compare reference audio ``a`` with test audio ``b``, waveform by waveform.

    Args:
        a: Reference waveform(s), as :func:`as_waveforms` reads them.
        b: Test waveform(s): the same count and shapes.
        metrics: Names from :data:`AUDIO_METRICS`; the others stay ``None`` in the result.

    Returns:
        A :class:`~fastdit.metrics.Comparison`: ``psnr`` of the waveform, ``snr``, and ``ssim`` of the log
        spectrogram (means, minima and per-waveform values).

    Raises:
        ValueError: An unknown metric, different counts or shapes (naming both), or ``ssim`` of waveforms too
            short for a spectrogram.
    """
    unknown = [name for name in metrics if name not in _PAIR]
    if unknown or not metrics:
        raise ValueError(f"metrics={list(metrics)!r}: each must be one of {', '.join(AUDIO_METRICS)}")
    items_a, items_b = as_waveforms(a), as_waveforms(b)
    if len(items_a) != len(items_b):
        raise ValueError(f"inputs hold different numbers of waveforms: a has {len(items_a)}, b has {len(items_b)}")
    values: dict[str, list[float]] = {name: [] for name in metrics}
    for index, (item_a, item_b) in enumerate(zip(items_a, items_b, strict=True)):
        if item_a.shape != item_b.shape:
            raise ValueError(
                f"waveforms differ at index {index}: a has shape {item_a.shape}, b has shape {item_b.shape}"
            )
        for name in metrics:
            values[name].append(_PAIR[name](item_a, item_b))
    summary: dict[str, Any] = {}
    for name, per_item in values.items():
        summary[name] = float(np.mean(per_item)) if not any(v == -math.inf for v in per_item) else -math.inf
        summary[f"{name}_min"] = float(np.min(per_item))
        summary[f"{name}_per_frame"] = tuple(per_item)
    return Comparison(count=len(items_a), **summary)
