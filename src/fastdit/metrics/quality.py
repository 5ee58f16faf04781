"""PSNR and SSIM between a reference and a test image, batch or video, computed with scikit-image.

Definitions (what every fastdit report means by these names):

* **PSNR** = ``10 · log10(L² / MSE)`` in dB, with the MSE over all pixels and channels of one image and ``L`` the
  data range. Identical images have MSE 0 and PSNR ``inf`` (a float, returned as such; JSON output writes it as the
  string ``"inf"``, see :func:`json_safe`).
* **SSIM** as defined by Wang et al. (2004), "Image quality assessment: from error visibility to structural
  similarity": local statistics under an 11×11 Gaussian window with σ = 1.5, constants ``C1 = (K1·L)²`` and
  ``C2 = (K2·L)²`` with K1 = 0.01 and K2 = 0.03, population (not sample) variances and covariance, averaged over the
  positions where the window fits inside the image (a 5-pixel border is left out). For colour images SSIM is computed
  per channel and averaged over the channels.
* ``L`` is the data range of the image type: 255 for uint8, 65535 for uint16, 1.0 for floats (which must lie in
  [0, 1]); pass ``data_range`` for anything else.

Batches and videos are compared item by item (frame by frame); the reported value is the arithmetic mean over items
and the minimum is reported beside it, because one bad frame is what a mean hides. A mean over PSNRs that include an
``inf`` (an identical frame) is ``inf``; the minimum then still tells the worst frame.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from skimage.metrics import peak_signal_noise_ratio, structural_similarity

from fastdit.metrics.convert import Layout, as_images, default_data_range

__all__ = ["METRICS", "SSIM_WINDOW", "Comparison", "compare", "json_safe", "psnr", "ssim"]

METRICS: tuple[str, ...] = ("psnr", "ssim")
"""Metric names understood by :func:`compare` and the ``fastdit metrics`` command."""

SSIM_WINDOW = 11
"""Side of the Gaussian SSIM window; images must be at least this large in height and width."""

_SSIM_SIGMA = 1.5
_SSIM_K1 = 0.01
_SSIM_K2 = 0.03


@dataclass(frozen=True)
class Comparison:
    """Result of :func:`compare`: means, minima and per-item values of the requested metrics.

    Attributes:
        count: Number of compared image pairs (1 for single images, frames for a video).
        psnr: Mean PSNR in dB over items, or ``None`` if PSNR was not requested.
        ssim: Mean SSIM over items, or ``None`` if SSIM was not requested.
        psnr_min: Lowest per-item PSNR, or ``None``.
        ssim_min: Lowest per-item SSIM, or ``None``.
        psnr_per_frame: PSNR of each item, in input order (empty if not requested).
        ssim_per_frame: SSIM of each item, in input order (empty if not requested).
        snr: Mean SNR in dB over items (audio only, :func:`fastdit.metrics.audio.compare_audio`), else ``None``.
        snr_min: Lowest per-item SNR, or ``None``.
        snr_per_frame: SNR of each item (empty if not computed).
    """

    count: int
    psnr: float | None = None
    ssim: float | None = None
    psnr_min: float | None = None
    ssim_min: float | None = None
    psnr_per_frame: tuple[float, ...] = ()
    ssim_per_frame: tuple[float, ...] = ()
    snr: float | None = None
    snr_min: float | None = None
    snr_per_frame: tuple[float, ...] = ()

    def to_dict(self, *, per_frame: bool = False) -> dict[str, Any]:
        """Return a JSON-safe dict of the computed metrics (``inf`` written as the string ``"inf"``).

        Args:
            per_frame: Also include the ``psnr_per_frame``/``ssim_per_frame`` lists.

        Returns:
            ``count`` plus, for each computed metric, its mean and minimum (and per-item values if asked).
        """
        out: dict[str, Any] = {"count": self.count}
        for name in (*METRICS, "snr"):
            mean = getattr(self, name)
            if mean is None:
                continue
            out[name] = json_safe(mean)
            out[f"{name}_min"] = json_safe(getattr(self, f"{name}_min"))
            if per_frame:
                out[f"{name}_per_frame"] = [json_safe(v) for v in getattr(self, f"{name}_per_frame")]
        return out


def json_safe(value: float) -> float | str:
    """Return ``value`` unchanged if finite, else the string ``"inf"``, ``"-inf"`` or ``"nan"``.

    JSON has no infinity; Python's ``json`` would write the invalid token ``Infinity``. PSNR of identical images is
    infinite, so fastdit writes it as the string ``"inf"``, which ``float("inf")`` reads back.

    Args:
        value: A metric value.

    Returns:
        A value ``json.dumps(..., allow_nan=False)`` accepts.
    """
    if math.isfinite(value):
        return float(value)
    if math.isnan(value):
        return "nan"
    return "inf" if value > 0 else "-inf"


def _check_pair(a: np.ndarray, b: np.ndarray, where: str) -> None:
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(
            f"images differ{where}: a has shape {tuple(a.shape)} dtype {a.dtype}, "
            f"b has shape {tuple(b.shape)} dtype {b.dtype}"
        )


def _pair_psnr(a: np.ndarray, b: np.ndarray, data_range: float) -> float:
    # skimage divides by an MSE of 0 for identical images; the limit, inf, is the documented answer.
    with np.errstate(divide="ignore"):
        return float(peak_signal_noise_ratio(a.astype(np.float64), b.astype(np.float64), data_range=data_range))


def _pair_ssim(a: np.ndarray, b: np.ndarray, data_range: float) -> float:
    height, width = a.shape[:2]
    if min(height, width) < SSIM_WINDOW:
        raise ValueError(f"SSIM needs images of at least {SSIM_WINDOW}×{SSIM_WINDOW} pixels, got shape {a.shape}")
    return float(
        structural_similarity(
            a.astype(np.float64),
            b.astype(np.float64),
            win_size=SSIM_WINDOW,
            gaussian_weights=True,
            sigma=_SSIM_SIGMA,
            K1=_SSIM_K1,
            K2=_SSIM_K2,
            use_sample_covariance=False,
            data_range=data_range,
            channel_axis=-1 if a.ndim == 3 else None,
        )
    )


_PAIR_METRICS = {"psnr": _pair_psnr, "ssim": _pair_ssim}


def _describe(value: Any, items: list[np.ndarray]) -> str:
    shape = getattr(value, "shape", None)
    return f"shape {tuple(shape)}" if shape is not None else f"{len(items)} images"


def _paired_items(a: Any, b: Any, layout: Layout | None) -> list[tuple[np.ndarray, np.ndarray]]:
    items_a, items_b = as_images(a, layout=layout), as_images(b, layout=layout)
    if len(items_a) != len(items_b):
        raise ValueError(
            f"inputs hold different numbers of images: a has {_describe(a, items_a)}, b has {_describe(b, items_b)}"
        )
    if not items_a:
        raise ValueError("no images to compare")
    for index, (item_a, item_b) in enumerate(zip(items_a, items_b, strict=True)):
        _check_pair(item_a, item_b, f" at index {index}" if len(items_a) > 1 else "")
    return list(zip(items_a, items_b, strict=True))


def compare(
    a: Any,
    b: Any,
    *,
    metrics: Sequence[str] = METRICS,
    data_range: float | None = None,
    layout: Layout | None = None,
) -> Comparison:
    """Compare a reference ``a`` with a test ``b``: one image, a batch, a video, or a sequence of images.

    Inputs are numpy arrays, PIL images or torch tensors; numpy/PIL are channels-last and torch channels-first unless
    ``layout`` says otherwise; 4-D inputs are batches or videos (see :mod:`fastdit.metrics.convert`). Lists/tuples
    hold one image per item, and the items may differ in size from one position to the next.

    Args:
        a: Reference image(s).
        b: Test image(s), same count, shapes and dtype as ``a``.
        metrics: Names from :data:`METRICS` to compute; the others stay ``None`` in the result.
        data_range: ``L`` in the PSNR/SSIM formulas; by default implied by the dtype (see module docstring).
        layout: ``"HWC"`` or ``"CHW"`` to override the per-type default layout.

    Returns:
        A :class:`Comparison` with mean, minimum and per-item values.

    Raises:
        ValueError: On an unknown metric, different counts, shapes or dtypes (naming both shapes), a float image
            outside [0, 1] without ``data_range``, or an image smaller than the SSIM window.
    """
    unknown = [name for name in metrics if name not in _PAIR_METRICS]
    if unknown or not metrics:
        raise ValueError(f"metrics={list(metrics)!r}: each must be one of {', '.join(METRICS)}")
    pairs = _paired_items(a, b, layout)
    values: dict[str, list[float]] = {name: [] for name in metrics}
    for item_a, item_b in pairs:
        item_range = data_range if data_range is not None else default_data_range(item_a)
        if data_range is None:
            default_data_range(item_b)  # b must be in range too, or the metric silently means something else
        for name in metrics:
            values[name].append(_PAIR_METRICS[name](item_a, item_b, item_range))
    summary: dict[str, Any] = {}
    for name, per_item in values.items():
        summary[name] = float(np.mean(per_item))
        summary[f"{name}_min"] = float(np.min(per_item))
        summary[f"{name}_per_frame"] = tuple(per_item)
    return Comparison(count=len(pairs), **summary)


def psnr(a: Any, b: Any, *, data_range: float | None = None, layout: Layout | None = None) -> float:
    """PSNR in dB between ``a`` and ``b`` (mean over items for batches and videos; ``inf`` if identical).

    Args:
        a: Reference image(s), as for :func:`compare`.
        b: Test image(s).
        data_range: ``L`` in the formula; implied by the dtype by default.
        layout: ``"HWC"`` or ``"CHW"`` to override the per-type default layout.

    Returns:
        The PSNR.
    """
    value = compare(a, b, metrics=("psnr",), data_range=data_range, layout=layout).psnr
    assert value is not None
    return value


def ssim(a: Any, b: Any, *, data_range: float | None = None, layout: Layout | None = None) -> float:
    """SSIM between ``a`` and ``b`` (Wang et al. 2004, see the module docstring; mean over items for batches).

    Args:
        a: Reference image(s), as for :func:`compare`.
        b: Test image(s).
        data_range: ``L`` in the formula; implied by the dtype by default.
        layout: ``"HWC"`` or ``"CHW"`` to override the per-type default layout.

    Returns:
        The SSIM, at most 1.0.
    """
    value = compare(a, b, metrics=("ssim",), data_range=data_range, layout=layout).ssim
    assert value is not None
    return value
