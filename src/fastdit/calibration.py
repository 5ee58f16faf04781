"""MagCache calibration runs: accelerate a pipeline in calibration mode, run it once, read the ratios, take it off.

This sits above :mod:`fastdit.api` (it applies and removes a technique), so the cache package below never calls
back into the API.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fastdit.api import accelerate, context_of, disable
from fastdit.cache.magcache import MagCacheEngine, model_name
from fastdit.config import MagCache, MagCalibration

__all__ = ["calibrate", "calibration_of"]


def calibration_of(pipe: Any, component: str = "transformer") -> MagCalibration:
    """The calibration recorded by the last run of ``pipe`` accelerated with ``MagCache(calibrate=True)``.

    Raises:
        ValueError: ``pipe`` is not accelerated with a MagCache, or nothing was recorded.
    """
    context = context_of(pipe)
    engine = None if context is None else context.state("cache", component)
    if not isinstance(engine, MagCacheEngine):
        raise ValueError(f"{type(pipe).__name__}.{component} is not accelerated with a MagCache")
    module = next((i.module for i in context.components.denoisers if i.name == component), None)
    return engine.calibration(model_name(module) if module is not None else component)


def calibrate(
    pipe: Any, run: Callable[[], Any], *, fn: int = 0, bn: int = 0, component: str = "transformer"
) -> MagCalibration:
    """Record a MagCache calibration: accelerate ``pipe`` in calibration mode, call ``run`` once, take it off.

    One sample is enough (the ratios follow the schedule far more than the prompt). Calibrate with the step count,
    guidance and ``fn``/``bn`` the cache will be used with.

    Args:
        pipe: An un-accelerated pipeline (or transformer).
        run: Runs one generation, e.g. ``lambda: pipe("a handwritten digit 3", num_inference_steps=28)``.
        fn: Front blocks of the layout to calibrate.
        bn: Back blocks of the layout to calibrate.
        component: The denoiser to read the calibration from.

    Returns:
        The calibration (every step of every branch of the run).
    """
    accelerate(pipe, cache=MagCache(calibrate=True, fn=fn, bn=bn, threshold=0.0))
    try:
        with torch.no_grad():
            run()
        return calibration_of(pipe, component)
    finally:
        disable(pipe)
