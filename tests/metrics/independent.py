"""An independent PSNR/SSIM written from the formulas with numpy only, to check the library against.

SSIM follows Wang et al. (2004): an 11×11 Gaussian window (σ = 1.5) truncated and renormalised, population
statistics, K1 = 0.01, K2 = 0.03, the mean over the positions where the whole window lies inside the image, and the
mean over colour channels.
"""

from __future__ import annotations

import io

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view
from PIL import Image
from scipy import ndimage
from skimage import data


def gaussian_window(size: int = 11, sigma: float = 1.5) -> np.ndarray:
    offsets = np.arange(size, dtype=np.float64) - (size - 1) / 2
    profile = np.exp(-(offsets**2) / (2.0 * sigma**2))
    window = np.outer(profile, profile)
    return window / window.sum()


def _local_mean(image: np.ndarray, window: np.ndarray) -> np.ndarray:
    # Weighted mean over every window position that fits entirely inside the image ("valid" region).
    patches = sliding_window_view(image, window.shape)
    return np.einsum("ijkl,kl->ij", patches, window)


def ssim_channel(x: np.ndarray, y: np.ndarray, data_range: float) -> float:
    x, y = x.astype(np.float64), y.astype(np.float64)
    window = gaussian_window()
    mu_x, mu_y = _local_mean(x, window), _local_mean(y, window)
    var_x = _local_mean(x * x, window) - mu_x**2
    var_y = _local_mean(y * y, window) - mu_y**2
    cov_xy = _local_mean(x * y, window) - mu_x * mu_y
    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    index = ((2 * mu_x * mu_y + c1) * (2 * cov_xy + c2)) / ((mu_x**2 + mu_y**2 + c1) * (var_x + var_y + c2))
    return float(index.mean())


def ssim_reference(x: np.ndarray, y: np.ndarray, data_range: float) -> float:
    """SSIM of two channels-last images (greyscale 2-D or colour 3-D)."""
    if x.ndim == 2:
        return ssim_channel(x, y, data_range)
    return float(np.mean([ssim_channel(x[..., c], y[..., c], data_range) for c in range(x.shape[-1])]))


def psnr_reference(x: np.ndarray, y: np.ndarray, data_range: float) -> float:
    mse = float(np.mean((x.astype(np.float64) - y.astype(np.float64)) ** 2))
    return float("inf") if mse == 0.0 else 10.0 * np.log10(data_range**2 / mse)


# Real test images (they ship with scikit-image) and deterministic distortions.


def astronaut_small() -> np.ndarray:
    """The astronaut downscaled 4× by block averaging: (128, 128, 3) uint8."""
    image = data.astronaut().astype(np.float64)
    return np.round(image.reshape(128, 4, 128, 4, 3).mean(axis=(1, 3))).astype(np.uint8)


def coffee_crop() -> np.ndarray:
    """A non-square crop of the coffee image: (96, 144, 3) uint8."""
    return data.coffee()[100:292:2, 150:438:2].copy()


def camera_small() -> np.ndarray:
    """The greyscale camera man downscaled 4×: (128, 128) uint8."""
    return data.camera()[::4, ::4].copy()


def add_noise(image: np.ndarray, sigma: float, seed: int = 0) -> np.ndarray:
    noisy = image.astype(np.float64) + np.random.default_rng(seed).normal(0.0, sigma, image.shape)
    return np.clip(np.round(noisy), 0, 255).astype(np.uint8)


def blur(image: np.ndarray, sigma: float) -> np.ndarray:
    spatial = (sigma, sigma) + (0.0,) * (image.ndim - 2)
    return np.clip(np.round(ndimage.gaussian_filter(image.astype(np.float64), spatial)), 0, 255).astype(np.uint8)


def jpeg(image: np.ndarray, quality: int) -> np.ndarray:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="JPEG", quality=quality)
    buffer.seek(0)
    return np.asarray(Image.open(buffer).convert(Image.fromarray(image).mode)).copy()
