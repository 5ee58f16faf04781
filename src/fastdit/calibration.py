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
from fastdit.cache.runs import scheduled_steps
from fastdit.config import MagCache, MagCalibration, MagCalibrations

__all__ = ["calibrate", "calibration_of"]


def calibration_of(pipe: Any, component: str | None = None) -> MagCalibration | MagCalibrations:
    """The calibration recorded by the last run of ``pipe`` accelerated with ``MagCache(calibrate=True)``.

    Args:
        pipe: The accelerated pipeline (or transformer).
        component: The denoiser to read; ``None``: every denoiser — its :class:`MagCalibration` when the pipeline
            has one, a :class:`MagCalibrations` keyed by component when it has several (Wan 2.2's experts).

    Raises:
        ValueError: ``pipe`` is not accelerated with a MagCache, or a denoiser recorded nothing.
    """
    context = context_of(pipe)
    denoisers = [] if context is None else [i.name for i in context.components.denoisers]
    if component is None and len(denoisers) > 1:
        calibrations = tuple(_read(pipe, context, name) for name in denoisers)
        longest, total = max(c.num_steps for c in calibrations), sum(c.num_steps for c in calibrations)
        # The run's length from the scheduler; without one, the denoisers are taken to split the schedule.
        scheduled = scheduled_steps(getattr(context.components.pipeline, "scheduler", None))
        num_steps = scheduled if scheduled is not None and scheduled >= longest else total
        return MagCalibrations(components=tuple(denoisers), calibrations=calibrations, num_steps=num_steps)
    return _read(pipe, context, component or (denoisers[0] if denoisers else "transformer"))


def _read(pipe: Any, context: Any, component: str) -> MagCalibration:
    engine = None if context is None else context.state("cache", component)
    if not isinstance(engine, MagCacheEngine):
        raise ValueError(f"{type(pipe).__name__}.{component} is not accelerated with a MagCache")
    module = next((i.module for i in context.components.denoisers if i.name == component), None)
    try:
        return engine.calibration(model_name(module) if module is not None else component)
    except ValueError as error:
        raise ValueError(f"{component}: {error}") from None


def calibrate(
    pipe: Any, run: Callable[[], Any], *, fn: int = 0, bn: int = 0, component: str | None = None
) -> MagCalibration | MagCalibrations:
    """Record a MagCache calibration: accelerate ``pipe`` in calibration mode, call ``run`` once, take it off.

    One sample is enough (the ratios follow the schedule far more than the prompt). Calibrate with the step count,
    guidance and ``fn``/``bn`` the cache will be used with. On a pipeline of several denoisers every one records
    the ratios of the steps it serves.

    Args:
        pipe: An un-accelerated pipeline (or transformer).
        run: Runs one generation, e.g. ``lambda: pipe("a handwritten digit 3", num_inference_steps=28)``.
        fn: Front blocks of the layout to calibrate.
        bn: Back blocks of the layout to calibrate.
        component: The denoiser to read the calibration from (``None``: every denoiser, see
            :func:`calibration_of`).

    Returns:
        The calibration (every step of every branch of the run): a :class:`MagCalibration` for one denoiser, a
        :class:`MagCalibrations` for several.
    """
    accelerate(pipe, cache=MagCache(calibrate=True, fn=fn, bn=bn, threshold=0.0))
    try:
        with torch.no_grad():
            run()
        return calibration_of(pipe, component)
    finally:
        disable(pipe)
