"""Audio metrics of fastdit.metrics.audio: waveform PSNR and SNR by their formulas, the log spectrogram against an
independent numpy STFT, spectral SSIM on real distortions, and the errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fastdit.bench.compare import compare_outputs
from fastdit.metrics import AUDIO_RANGE, compare_audio
from fastdit.metrics.audio import as_waveforms, log_spectrogram, snr, spectral_n_fft, spectral_ssim, waveform_psnr

RATE = 8000


def _music(seconds: float = 0.5, channels: int = 2, seed: int = 0) -> np.ndarray:
    """A stereo chord with a decaying envelope and a little noise, (channels, samples) in [-1, 1]."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * RATE)) / RATE
    envelope = np.exp(-3.0 * t)
    rows = []
    for channel in range(channels):
        tone = sum(0.2 * np.sin(2 * np.pi * f * (1 + 0.01 * channel) * t) for f in (220.0, 277.2, 329.6))
        rows.append(envelope * tone + 0.01 * rng.standard_normal(t.size))
    return np.stack(rows)


def test_psnr_and_snr_follow_their_formulas() -> None:
    a = _music()
    b = a + 0.01 * np.random.default_rng(1).standard_normal(a.shape)
    mse = np.mean((a - b) ** 2)
    result = compare_audio(a, b)
    assert result.psnr == pytest.approx(10 * math.log10(AUDIO_RANGE**2 / mse), abs=1e-9)
    assert result.snr == pytest.approx(10 * math.log10(np.sum(a**2) / np.sum((a - b) ** 2)), abs=1e-9)
    assert result.count == 1 and result.psnr_min == result.psnr and result.snr_min == result.snr
    # Halving the signal and the error together keeps the SNR and lowers the PSNR by 6 dB: SNR is scale-free.
    assert snr(a / 2, b / 2) == pytest.approx(result.snr)
    assert waveform_psnr(a / 2, b / 2) == pytest.approx(result.psnr + 20 * math.log10(2), abs=1e-9)


def test_identical_waveforms_give_inf_and_unit_ssim() -> None:
    a = _music()
    result = compare_audio(a, a.copy())
    assert result.psnr == math.inf and result.snr == math.inf and result.ssim == pytest.approx(1.0)
    assert snr(np.zeros((1, 100)), np.ones((1, 100))) == -math.inf  # a silent reference: the test is all error
    assert result.to_dict() == {
        "count": 1,
        "psnr": "inf",
        "psnr_min": "inf",
        "ssim": pytest.approx(1.0),
        "ssim_min": pytest.approx(1.0),
        "snr": "inf",
        "snr_min": "inf",
    }


def _numpy_log_spectrogram(waveform: np.ndarray, n_fft: int) -> np.ndarray:
    """The same spectrogram written out with numpy: centred (reflect) frames, periodic Hann window, |rfft| in dB."""
    hop = n_fft // 4
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n_fft) / n_fft)
    out = []
    for channel in waveform:
        padded = np.pad(channel, n_fft // 2, mode="reflect")
        frames = [padded[i : i + n_fft] * window for i in range(0, len(padded) - n_fft + 1, hop)]
        magnitude = np.abs(np.fft.rfft(np.stack(frames), axis=-1)).T
        out.append(20 * np.log10(np.maximum(magnitude, 1e-5)))
    return np.stack(out)


def test_log_spectrogram_agrees_with_an_independent_stft() -> None:
    a = _music()
    n_fft = spectral_n_fft(a.shape[-1])
    assert n_fft == 1024
    np.testing.assert_allclose(log_spectrogram(a, n_fft), _numpy_log_spectrogram(a, n_fft), atol=1e-6)


def test_spectral_ssim_falls_with_the_damage() -> None:
    a = _music()
    rng = np.random.default_rng(2)
    light = compare_audio(a, a + 0.001 * rng.standard_normal(a.shape))
    heavy = compare_audio(a, a + 0.05 * rng.standard_normal(a.shape))
    assert 0.9 < light.ssim < 1.0 and heavy.ssim < light.ssim - 0.2 and heavy.snr < light.snr - 30
    # Structure, not level: the same waveform reversed in time has the same energy and a different spectrogram.
    reversed_ = compare_audio(a, a[:, ::-1].copy())
    assert reversed_.ssim < 0.7


def test_short_waveforms_get_a_smaller_stft_or_no_spectral_ssim() -> None:
    assert spectral_n_fft(128) == 32  # 17 frames of 32 samples (hop 8)
    assert spectral_n_fft(4000) == 1024
    a = _music(seconds=0.016)  # 128 samples
    assert 0.0 < spectral_ssim(a, a + 0.01) <= 1.0
    too_short = np.zeros((2, 79))
    with pytest.raises(ValueError, match=r"spectral SSIM needs at least 11 STFT frames.*got 79"):
        compare_audio(too_short, too_short)
    assert compare_audio(too_short, too_short, metrics=("psnr", "snr")).psnr == math.inf


def test_layouts_batches_and_errors() -> None:
    a = _music()
    assert [w.shape for w in as_waveforms(a[0])] == [(1, a.shape[-1])]  # mono (samples,)
    assert len(as_waveforms(np.stack([a, a]))) == 2  # (N, channels, samples)
    assert len(as_waveforms(torch.from_numpy(a).half())) == 1  # tensors, half precision widened
    batch = compare_audio(np.stack([a, a]), np.stack([a, a + 0.01]))
    assert batch.count == 2 and batch.psnr == math.inf and batch.psnr_min < 50
    with pytest.raises(ValueError, match="different numbers of waveforms"):
        compare_audio(np.stack([a, a]), a)
    with pytest.raises(ValueError, match=r"waveforms differ at index 0: a has shape \(2, 4000\)"):
        compare_audio(a, a[:, :-1])
    with pytest.raises(ValueError, match="expected audio of shape"):
        compare_audio(np.zeros((1, 1, 1, 8)), np.zeros((1, 1, 1, 8)))
    with pytest.raises(ValueError, match="metrics=\\['lpips'\\]"):
        compare_audio(a, a, metrics=("lpips",))
    with pytest.raises(TypeError, match="numpy array or torch tensor"):
        compare_audio([1.0, 2.0], [1.0, 2.0])


def test_compare_outputs_reads_waveforms_when_told() -> None:
    a = _music()
    result = compare_outputs([a], [a + 0.01], audio=True)
    assert result.snr is not None and result.ssim is not None and result.count == 1
