"""Image and video quality metrics: PSNR and SSIM (Wang et al. 2004) through scikit-image.

>>> from fastdit.metrics import compare
>>> result = compare(baseline_frames, accelerated_frames)  # doctest: +SKIP
>>> result.psnr, result.psnr_min, result.ssim, result.ssim_min  # doctest: +SKIP

See :mod:`fastdit.metrics.quality` for the exact definitions and :mod:`fastdit.metrics.convert` for input layouts.
"""

from fastdit.metrics.convert import Layout, as_image, as_images, default_data_range
from fastdit.metrics.quality import METRICS, SSIM_WINDOW, Comparison, compare, json_safe, psnr, ssim

__all__ = [
    "METRICS",
    "SSIM_WINDOW",
    "Comparison",
    "Layout",
    "as_image",
    "as_images",
    "compare",
    "default_data_range",
    "json_safe",
    "psnr",
    "ssim",
]
