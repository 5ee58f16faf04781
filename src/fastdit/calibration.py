"""Calibration runs of the calibrated whole-step caches (MagCache, TeaCache): accelerate a pipeline in calibration
mode, run it once, read what it recorded, take it off.

This sits above :mod:`fastdit.api` (it applies and removes a technique), so the cache package below never calls
back into the API.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch

from fastdit.api import accelerate, context_of, disable
from fastdit.cache.magcache import MagCacheEngine, model_name
from fastdit.cache.teacache import DEFAULT_DEGREE, TeaCacheEngine
from fastdit.config import MagCache, MagCalibration, TeaCache, TeaCalibration

__all__ = ["calibrate", "calibration_of"]


def calibration_of(
    pipe: Any, component: str = "transformer", *, degree: int = DEFAULT_DEGREE
) -> MagCalibration | TeaCalibration:
    """The calibration recorded by the last run of ``pipe`` accelerated with ``calibrate=True``.

    Args:
        pipe: The accelerated pipeline (or transformer).
        component: The denoiser to read.
        degree: TeaCache only: the degree (1 to 4) of the polynomial fitted to the recorded pairs.

    Returns:
        A :class:`MagCalibration` (per-step ratios) under MagCache, a :class:`TeaCalibration` (the fitted
        polynomial) under TeaCache.

    Raises:
        ValueError: ``pipe`` is not accelerated with a MagCache or TeaCache, nothing was recorded, or (TeaCache) too
            few steps for ``degree``.
    """
    context = context_of(pipe)
    engine = None if context is None else context.state("cache", component)
    if not isinstance(engine, (MagCacheEngine, TeaCacheEngine)):
        raise ValueError(f"{type(pipe).__name__}.{component} is not accelerated with a MagCache or TeaCache")
    module = next((i.module for i in context.components.denoisers if i.name == component), None)
    model = model_name(module) if module is not None else component
    if isinstance(engine, TeaCacheEngine):
        return engine.calibration(model, degree)
    return engine.calibration(model)


def calibrate(
    pipe: Any,
    run: Callable[[], Any],
    *,
    fn: int = 0,
    bn: int = 0,
    component: str = "transformer",
    policy: Literal["magcache", "teacache"] = "magcache",
    degree: int = DEFAULT_DEGREE,
) -> MagCalibration | TeaCalibration:
    """Record a calibration: accelerate ``pipe`` in calibration mode, call ``run`` once, take it off.

    One sample is enough (MagCache's ratios follow the schedule far more than the prompt; TeaCache's polynomial is
    fitted on every step of it). Calibrate with the step count, guidance and ``fn``/``bn`` the cache will be used
    with.

    Args:
        pipe: An un-accelerated pipeline (or transformer).
        run: Runs one generation, e.g. ``lambda: pipe("a handwritten digit 3", num_inference_steps=28)``.
        fn: Front blocks of the layout to calibrate.
        bn: Back blocks of the layout to calibrate.
        component: The denoiser to read the calibration from.
        policy: ``"magcache"`` (per-step magnitude ratios) or ``"teacache"`` (input → residual change polynomial).
        degree: TeaCache only: the polynomial's degree, 1 to 4.

    Returns:
        The calibration (every step of every branch of the run).

    Raises:
        ValueError: An unknown ``policy``; see also :func:`calibration_of`.
    """
    if policy == "magcache":
        config: MagCache | TeaCache = MagCache(calibrate=True, fn=fn, bn=bn, threshold=0.0)
    elif policy == "teacache":
        config = TeaCache(calibrate=True, fn=fn, bn=bn, threshold=0.0)
    else:
        raise ValueError(f"policy={policy!r}: expected 'magcache' or 'teacache'")
    accelerate(pipe, cache=config)
    try:
        with torch.no_grad():
            run()
        return calibration_of(pipe, component, degree=degree)
    finally:
        disable(pipe)
