"""Quality metrics: PSNR and SSIM (Wang et al. 2004) of images and videos through scikit-image; for audio, waveform
PSNR and SNR and the SSIM of the log-magnitude spectrogram (:mod:`fastdit.metrics.audio`).

>>> from fastdit.metrics import compare
>>> result = compare(baseline_frames, accelerated_frames)  # doctest: +SKIP
>>> result.psnr, result.psnr_min, result.ssim, result.ssim_min  # doctest: +SKIP

See :mod:`fastdit.metrics.quality` for the exact definitions, :mod:`fastdit.metrics.convert` for input layouts and
:mod:`fastdit.metrics.audio` for audio.
"""

from fastdit.metrics.audio import AUDIO_METRICS, AUDIO_RANGE, compare_audio
from fastdit.metrics.convert import Layout, as_image, as_images, default_data_range
from fastdit.metrics.quality import METRICS, SSIM_WINDOW, Comparison, compare, json_safe, psnr, ssim

__all__ = [
    "AUDIO_METRICS",
    "AUDIO_RANGE",
    "METRICS",
    "SSIM_WINDOW",
    "Comparison",
    "Layout",
    "as_image",
    "as_images",
    "compare",
    "compare_audio",
    "default_data_range",
    "json_safe",
    "psnr",
    "ssim",
]
