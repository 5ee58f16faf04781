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
from fastdit.cache.runs import scheduled_steps
from fastdit.cache.teacache import DEFAULT_DEGREE, TeaCacheEngine
from fastdit.config import MagCache, MagCalibration, MagCalibrations, TeaCache, TeaCalibration

__all__ = ["calibrate", "calibration_of"]


def calibration_of(
    pipe: Any, component: str | None = None, *, degree: int = DEFAULT_DEGREE
) -> MagCalibration | MagCalibrations | TeaCalibration:
    """The calibration recorded by the last run of ``pipe`` accelerated with ``calibrate=True``.

    Args:
        pipe: The accelerated pipeline (or transformer).
        component: The denoiser to read; ``None``: every denoiser — under MagCache its :class:`MagCalibration` when
            the pipeline has one, a :class:`MagCalibrations` keyed by component when it has several (Wan 2.2's
            experts); under TeaCache the first denoiser's (one polynomial serves every denoiser).
        degree: TeaCache only: the degree (1 to 4) of the polynomial fitted to the recorded pairs.

    Returns:
        A :class:`MagCalibration` / :class:`MagCalibrations` (per-step ratios) under MagCache, a
        :class:`TeaCalibration` (the fitted polynomial) under TeaCache.

    Raises:
        ValueError: ``pipe`` is not accelerated with a MagCache or TeaCache, a denoiser recorded nothing, or
            (TeaCache) too few steps for ``degree``.
    """
    context = context_of(pipe)
    denoisers = [] if context is None else [i.name for i in context.components.denoisers]
    several = component is None and len(denoisers) > 1
    if several and isinstance(context.state("cache", denoisers[0]), MagCacheEngine):
        calibrations = tuple(_read(pipe, context, name, degree) for name in denoisers)
        longest, total = max(c.num_steps for c in calibrations), sum(c.num_steps for c in calibrations)
        # The run's length from the scheduler; without one, the denoisers are taken to split the schedule.
        scheduled = scheduled_steps(getattr(context.components.pipeline, "scheduler", None))
        num_steps = scheduled if scheduled is not None and scheduled >= longest else total
        return MagCalibrations(components=tuple(denoisers), calibrations=calibrations, num_steps=num_steps)
    return _read(pipe, context, component or (denoisers[0] if denoisers else "transformer"), degree)


def _read(pipe: Any, context: Any, component: str, degree: int) -> MagCalibration | TeaCalibration:
    engine = None if context is None else context.state("cache", component)
    if not isinstance(engine, (MagCacheEngine, TeaCacheEngine)):
        raise ValueError(f"{type(pipe).__name__}.{component} is not accelerated with a MagCache or TeaCache")
    module = next((i.module for i in context.components.denoisers if i.name == component), None)
    model = model_name(module) if module is not None else component
    try:
        if isinstance(engine, TeaCacheEngine):
            return engine.calibration(model, degree)
        return engine.calibration(model)
    except ValueError as error:
        raise ValueError(f"{component}: {error}") from None


def calibrate(
    pipe: Any,
    run: Callable[[], Any],
    *,
    fn: int = 0,
    bn: int = 0,
    component: str | None = None,
    policy: Literal["magcache", "teacache"] = "magcache",
    degree: int = DEFAULT_DEGREE,
) -> MagCalibration | MagCalibrations | TeaCalibration:
    """Record a calibration: accelerate ``pipe`` in calibration mode, call ``run`` once, take it off.

    One sample is enough (MagCache's ratios follow the schedule far more than the prompt; TeaCache's polynomial is
    fitted on every step of it). Calibrate with the step count, guidance and ``fn``/``bn`` the cache will be used
    with. On a pipeline of several denoisers every one records the ratios of the steps it serves (MagCache).

    Args:
        pipe: An un-accelerated pipeline (or transformer).
        run: Runs one generation, e.g. ``lambda: pipe("a handwritten digit 3", num_inference_steps=28)``.
        fn: Front blocks of the layout to calibrate.
        bn: Back blocks of the layout to calibrate.
        component: The denoiser to read the calibration from (``None``: every denoiser, see
            :func:`calibration_of`).
        policy: ``"magcache"`` (per-step magnitude ratios) or ``"teacache"`` (input → residual change polynomial).
        degree: TeaCache only: the polynomial's degree, 1 to 4.

    Returns:
        The calibration (every step of every branch of the run): for MagCache a :class:`MagCalibration` for one
        denoiser, a :class:`MagCalibrations` for several; for TeaCache a :class:`TeaCalibration`.

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
