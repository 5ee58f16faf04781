"""Calibration runs: of the calibrated whole-step caches (MagCache, TeaCache) and of static FP8's activation scales.
Each accelerates a pipeline in calibration mode, runs it, reads what it recorded and takes it off.

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
from fastdit.config import (
    ActivationScales,
    Attention,
    MagCache,
    MagCalibration,
    MagCalibrations,
    Parallel,
    Quantize,
    TeaCache,
    TeaCalibration,
)

__all__ = ["calibrate", "calibrate_scales", "calibration_of"]


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


def calibrate_scales(
    pipe: Any,
    run: Callable[[], Any],
    *,
    include: tuple[str, ...] = (),
    exclude: tuple[str, ...] = (),
    parallel: Parallel | None = None,
) -> ActivationScales:
    """Record static FP8's activation scales: every quantizable Linear's largest absolute input over ``run``, and
    every attention module's largest |Q|, |K| and |V|.

    ``run`` may make several generations (prompts, seeds, resolutions, guidance); the maxima are over all of them,
    every step and every CFG branch. The model computes in its own dtype meanwhile. Under a process group (context,
    tensor or CFG parallelism) every process must call this: the maxima are reduced over the group, so every rank
    gets the same scales. The attention inputs are recorded (for ``Attention(backend="cudnn-fp8", scales=...)``)
    where every denoiser's attention goes through diffusers' dispatch and the sequence is not split by context
    parallelism.

    Args:
        pipe: An un-accelerated pipeline (or transformer); under parallelism, each process's.
        run: Runs the calibration generations, e.g. ``lambda: [pipe(p, num_inference_steps=28) for p in prompts]``.
        include: The layer patterns the quantization will use (:class:`Quantize` ``include``).
        exclude: Its ``exclude`` patterns.
        parallel: Record under this layout (a model that fits only split by tensor parallelism; each rank watches
            its own part of every input, and the maxima are reduced over the group).

    Returns:
        The scales, for ``Quantize(mode="fp8_static", scales=...)``; :func:`fastdit.quantize.save_scales` writes them.

    Raises:
        ImportError: torchao is not installed.
        ValueError: No layer was called during ``run``.
    """
    recording = Quantize(mode="fp8_static", calibrate=True, include=include, exclude=exclude)
    attention = Attention(calibrate=True) if _records_attention(pipe, parallel) else None
    accelerate(pipe, quantize=recording, attention=attention, parallel=parallel)
    try:
        with torch.no_grad():
            run()
        context = context_of(pipe)
        items = [(i.name, i.module) for i in context.components.denoisers]
        table = [_reduced(name, context.state("quantize", name), _device(module)) for name, module in items]
        if attention is not None:
            table += [_reduced(n, context.state("attention", n).recorder, _device(m)) for n, m in items]
    finally:
        disable(pipe)
    layers = [(name, amax, ndim) for rows in table for name, amax, ndim in rows]
    if not layers:
        raise ValueError(f"{type(pipe).__name__}: no quantizable layer was called during the calibration run")
    names, amax, ndims = zip(*layers, strict=True)
    model = "; ".join(model_name(module) for _, module in items)
    return ActivationScales(layers=names, amax=amax, ndims=ndims, model=model)


def _records_attention(pipe: Any, parallel: Parallel | None) -> bool:
    """Whether a calibration of ``pipe`` can record the attention inputs per module (see :func:`calibrate_scales`)."""
    from fastdit.components import walk
    from fastdit.parallel.attention.single import dispatch_routed

    if parallel is not None and parallel.ulysses * parallel.ring > 1:
        return False
    plans = [item.adapter.cp_plan for item in walk(pipe).denoisers]
    return bool(plans) and all(dispatch_routed(plan.attention if plan is not None else None) for plan in plans)


def _device(module: torch.nn.Module) -> torch.device:
    parameter = next(module.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


def _reduced(component: str, recorder: Any, device: torch.device) -> list[tuple[str, float, int]]:
    """One denoiser's recorded maxima, the largest over the process group; layers no rank called are left out.

    Every rank reduces the same layer list in the same order (the model's) on the denoiser's device, whatever it
    called itself.
    """
    if not recorder.layers:
        return []
    missing = torch.tensor(-1.0, device=device)
    maxima = torch.stack([recorder.amax.get(n, missing).to(device) for n in recorder.layers])
    ranks = torch.tensor([float(recorder.ndims.get(n, 0)) for n in recorder.layers], device=device)
    table = torch.stack([maxima, ranks])  # one collective for both rows (input ranks are small exact integers)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(table, op=torch.distributed.ReduceOp.MAX)
    values, ndims = table.tolist()
    return [
        (f"{component}.{name}", a, int(d)) for name, a, d in zip(recorder.layers, values, ndims, strict=True) if a >= 0
    ]
