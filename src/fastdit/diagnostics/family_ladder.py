"""The family capability matrices as rungs of the verify ladder: one implementation for ``fastdit verify`` and tests.

The context-, tensor- and CFG-parallel matrices run every registered tiny pipeline through
:func:`fastdit.diagnostics.verify.verify_ladder` on gloo ranks, with rungs described as plain data
(:class:`RungSpec`, which pickles to worker processes) and judged at :data:`EXACT`: on CPU in float32 a parallel
layout only reorders float sums, so every output value must stay within ``1e-4`` of the one-process run (> 80 dB on
[0, 1] outputs), not just above the 35 dB a GPU in bf16 is held to.

A rung that adds parallelism to a step cache is judged against the same cache on one process (same outputs, same
steps served from the cache): a cache approximates, parallelism must not change what it decides. Besides DBCache's
forced schedule (:func:`forced_cache`), the matrices run TeaCache's (:func:`forced_teacache`) and the forecast
schedules of DBCache and MagCache (:func:`forecast_cache`, :func:`forecast_magcache`), which compute enough steps
before a cached one for every TaylorSeer method to extrapolate.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastdit.config import (
    Attention,
    CacheConfig,
    Compile,
    DBCache,
    Fuse,
    MagCache,
    MagCalibration,
    MagCalibrations,
    Offload,
    Parallel,
    StepMask,
    TaylorSeer,
    TeaCache,
    TeaCalibration,
)
from fastdit.diagnostics.verify import Rung, Status, Thresholds, VerifyRuntime, fixed_rung, verify_ladder
from fastdit.models.registry import get_family
from fastdit.testing.pipelines import build_tiny, run_tiny, scaled_steps

__all__ = [
    "EXACT",
    "FORCED_CACHE_FN",
    "FORECASTS",
    "FORECAST_STEPS",
    "TIMESTEP_FORECAST",
    "RungSpec",
    "assert_rows",
    "cache_combination_specs",
    "cached_call_overrides",
    "forced_cache",
    "forced_teacache",
    "forecast_cache",
    "forecast_magcache",
    "run_cache_combinations",
    "run_family_ladder",
    "tiny_magcache_calibration",
]

EXACT = Thresholds(max_abs=1e-4)
"""Float32 on CPU: parallelism reorders sums only."""

FORCED_CACHE_FN = 1
"""Front blocks of the forced cache (:func:`forced_cache`)."""

# Tiny pipelines whose step count is not a plain ``num_inference_steps``: SANA-Sprint's SCM schedule takes exactly 2
# steps unless its intermediate timestep is dropped.
_SCHEDULE_OVERRIDES: dict[tuple[str, str], dict[str, Any]] = {("sana", "sprint"): {"intermediate_timesteps": None}}


def forced_cache(bn: int) -> DBCache:
    """A step cache that computes step 0 and serves every later step, the same on every rank.

    Random weights never look converged to a threshold, so a static mask forces the cache's path. With ``bn=0`` the
    last block is a middle block (measured on computed steps, skipped on cached ones), so a plan that gathers at the
    last block meets the cache there; with ``bn=1`` the last block always runs.
    """
    mask = StepMask(compute_steps=(0,), policy="static")
    return DBCache(fn=FORCED_CACHE_FN, bn=bn, warmup_steps=0, step_mask=mask)


FORECAST_STEPS = 5
"""Denoising steps per transformer of the forecast schedules (:func:`forecast_cache`, :func:`forecast_magcache`):
three computed steps, then two from the cache."""

# An accumulated change no run reaches: the whole-step policies' caps and retained steps alone decide.
_UNREACHED = 1e6


def forced_teacache(taylorseer: TaylorSeer | None = None) -> TeaCache:
    """A TeaCache that computes step 0 and then skips two steps in a row out of every three, the same on every rank.

    Over :data:`FORECAST_STEPS` steps it computes steps 0 and 3 (cached 1, 2 and 4), over 3 steps step 0 only: a
    computed step follows skipped ones, so the accumulator restarts and the residual is renewed mid-run. The
    calibration is the identity and the threshold unreachable, so the cap decides while the first block's input
    change is still measured (and reduced over the ranks) at every step.
    """
    identity = TeaCalibration(coefficients=(1.0, 0.0))
    return TeaCache(
        threshold=_UNREACHED,
        max_skip_steps=2,
        retention_ratio=0.0,
        final_steps=0,
        calibration=identity,
        taylorseer=taylorseer,
    )


def forecast_cache(taylorseer: TaylorSeer, bn: int = 0) -> DBCache:
    """DBCache computing steps 0-2 and forecasting steps 3 onwards with ``taylorseer`` (:data:`FORECAST_STEPS`).

    Three computed residuals before the first cached step: enough for every method's order-2 forecast (FoCa's
    quadratic predictor needs three points; :func:`forced_cache` computes one, so a forecast there only reuses it).
    """
    mask = StepMask(compute_steps=(0, 1, 2), policy="static")
    return DBCache(fn=FORCED_CACHE_FN, bn=bn, warmup_steps=0, step_mask=mask, taylorseer=taylorseer)


def forecast_magcache(calibration: MagCalibration | MagCalibrations, taylorseer: TaylorSeer) -> MagCache:
    """MagCache (``fn=0``) computing the first 3 of :data:`FORECAST_STEPS` steps and forecasting the other 2.

    The threshold is unreachable, so the retained steps and the cap decide whatever ``calibration``'s ratios are;
    the calibration only has to name the run's branches and step count (:func:`tiny_magcache_calibration`).
    """
    return MagCache(
        threshold=_UNREACHED,
        max_skip_steps=2,
        retention_ratio=0.6,  # int(0.6 × 5 + 0.5) = 3 retained steps
        final_steps=0,
        calibration=calibration,
        taylorseer=taylorseer,
    )


FORECASTS: dict[str, TaylorSeer] = {
    "foca": TaylorSeer(order=2, method="foca"),
    "hermite": TaylorSeer(order=2, method="hermite"),
}
"""The forecast methods besides the default Taylor series that the combination matrices run, over the step index:
its spacing is the same whatever the schedule, so the forecast amplifies float32's reordering alike on every family.
Over the timestep an uneven schedule amplifies it by its own extrapolation (Stable Audio 3's tiny run, timesteps
1000, 990, 949, 782, 411: the steps forecast 166 and 538 past nodes 10 and 41 apart lift a 1e-6 difference past the
exact threshold); :data:`TIMESTEP_FORECAST` runs where the schedule allows it."""

TIMESTEP_FORECAST = TaylorSeer(order=2, variable="timestep", method="foca")
"""FoCa over the timestep, as the ``fast`` presets forecast (rows ``…-foca-timestep``, with ``timestep=True``)."""


def cache_combination_specs(
    prefix: str,
    parallel: Mapping[str, Any],
    calibration: MagCalibration | MagCalibrations,
    *,
    compile: bool = False,
    timestep: bool = False,
) -> list[RungSpec]:
    """The rungs of the step caches besides DBCache's forced schedule, under one layout: TeaCache's forced
    schedule, DBCache and MagCache forecasting with each of :data:`FORECASTS`, and DBCache deciding ahead.

    Args:
        prefix: Each row's name starts with it (``"tp2"`` gives ``tp2-teacache``, ``tp2-dbcache-foca`` ...).
        parallel: :class:`~fastdit.Parallel` keyword arguments of every rung.
        calibration: The MagCache calibration of the call (:func:`tiny_magcache_calibration`).
        compile: Compile the blocks of every rung (eager backend).
        timestep: Also forecast with :data:`TIMESTEP_FORECAST` (for a schedule of moderate spacing).
    """
    forecasts = {**FORECASTS, **({"foca-timestep": TIMESTEP_FORECAST} if timestep else {})}
    specs = [RungSpec(f"{prefix}-teacache", parallel, cache=forced_teacache(), compile=compile)]
    for name, forecast in forecasts.items():
        specs.append(RungSpec(f"{prefix}-dbcache-{name}", parallel, cache=forecast_cache(forecast), compile=compile))
        magcache = forecast_magcache(calibration, forecast)
        specs.append(RungSpec(f"{prefix}-magcache-{name}", parallel, cache=magcache, compile=compile))
    # Deciding ahead: the forced schedule still launches each step's drift reduction (a collective under
    # parallelism) and reads the previous one, which every rank must do alike.
    ahead = dataclasses.replace(forecast_cache(FORECASTS["foca"]), decide_ahead=True)
    specs.append(RungSpec(f"{prefix}-dbcache-ahead", parallel, cache=ahead, compile=compile))
    return specs


def cached_call_overrides(family: str, variant: str, steps: int = 3) -> dict[str, Any]:
    """Call arguments giving each transformer ``steps`` denoising steps (3: step 0 computed, steps 1-2 from a forced
    cache; :data:`FORECAST_STEPS` for the forecast schedules).

    A tiny run denoises 2 steps per transformer; it asks for 4 where img2img strength 0.5 or a Wan 2.2 expert
    boundary halves them. ``steps``/2 of the declared count gives ``steps`` per transformer either way (per stage,
    for a pipeline that counts its steps per resolution stage: Helios' pyramid).
    """
    scaled = scaled_steps(get_family(family).tiny(variant), steps, 2)
    return {**scaled, **_SCHEDULE_OVERRIDES.get((family, variant), {})}


@dataclass(frozen=True)
class RungSpec:
    """One configuration of a matrix, as plain data.

    Attributes:
        name: Its row's name.
        parallel: :class:`~fastdit.Parallel` keyword arguments.
        cache_bn: Back blocks of a :func:`forced_cache` (``None``: no cache). The row is then judged against the
            same cache on one process.
        cache: Any other step cache instead (:func:`forced_teacache`, :func:`forecast_cache` ...), judged the same
            way; not with ``cache_bn``.
        compile: Compile the blocks and the modules outside them (eager backend: traces through the layouts at
            CPU-test cost).
        offload: Stream the blocks from host memory, keeping this many resident (``None``: no offload).
        check_disable: After this rung's ``disable`` the output must equal the baseline bit for bit.
        attention: An :attr:`~fastdit.Attention.backend` for the rung (``None``: the default). Its reference on one
            process uses the same backend (on one device it takes the transformer's attention calls).
        fuse: Fuse the family's shared-input projections (:class:`~fastdit.Fuse`); its reference on one process
            fuses them too.
    """

    name: str
    parallel: Mapping[str, Any] = field(default_factory=dict)
    cache_bn: int | None = None
    compile: bool = False
    offload: int | None = None
    check_disable: bool = False
    cache: CacheConfig | None = None
    attention: str | None = None
    fuse: bool = False

    def __post_init__(self) -> None:
        if self.cache is not None and self.cache_bn is not None:
            raise ValueError(f"RungSpec {self.name!r}: cache_bn={self.cache_bn} and cache= both give a cache")

    def rung(self) -> Rung:
        """The verify rung this spec describes."""
        cache = self.cache if self.cache_bn is None else forced_cache(self.cache_bn)
        options: dict[str, Any] = {"parallel": Parallel(**self.parallel)}
        if cache is not None:
            options["cache"] = cache
        if self.compile:
            options["compile"] = Compile(backend="eager", fullgraph=False, outer=True)
        if self.offload is not None:
            options["offload"] = Offload(resident_blocks=self.offload)
        reference = {} if cache is None else {"cache": cache}
        if self.attention is not None:
            options["attention"] = reference["attention"] = Attention(backend=self.attention)
        if self.fuse:
            options["fuse"] = reference["fuse"] = Fuse()
        return fixed_rung(self.name, options, reference=reference or None, check_disable=self.check_disable)


@functools.lru_cache(maxsize=4)
def _built(family: str, variant: str) -> tuple[Any, Any]:
    return build_tiny(family, variant)


def run_family_ladder(
    rank: int,
    world_size: int,
    family: str,
    variant: str,
    specs: Sequence[RungSpec],
    overrides: Mapping[str, Any] | None = None,
    check_disable: bool = False,
) -> dict[str, Any]:
    """Run ``specs`` on a family's tiny pipeline against its one-process baseline; the report as plain data.

    A worker-pool function (``pool.run(run_family_ladder, family, variant, specs)``): every rank builds the same
    pipeline and runs the same ladder. ``overrides`` change the call (steps, guidance) for the baseline and every
    rung alike; ``check_disable`` checks that each rung's ``disable`` gives the baseline back bit for bit.
    """
    pipe, tiny = _built(family, variant)
    runtime = VerifyRuntime(thresholds=EXACT, timeout_s=120, check_disable=check_disable, name=f"{family}/{variant}")
    report = verify_ladder(pipe, {**tiny.call_kwargs, **(overrides or {})}, [s.rung() for s in specs], runtime)
    return report.to_dict()


def tiny_magcache_calibration(
    family: str, variant: str, overrides: Mapping[str, Any] | None = None
) -> MagCalibration | MagCalibrations:
    """A MagCache calibration of a family's tiny pipeline (the one :func:`run_family_ladder` runs), on one process.

    Recorded on the call the ladder makes (the tiny call with ``overrides``), so it names that call's branches and
    serves its step count on every denoiser (a :class:`MagCalibrations` for a pipeline of several). A worker-pool
    helper: every rank records the same one.
    """
    from fastdit.calibration import calibrate

    pipe, tiny = _built(family, variant)
    return calibrate(pipe, lambda: run_tiny(pipe, tiny, **(overrides or {})))


def run_cache_combinations(
    rank: int,
    world_size: int,
    family: str,
    variant: str,
    prefix: str,
    parallel: Mapping[str, Any],
    compile: bool = False,
    timestep: bool = False,
) -> dict[str, Any]:
    """:func:`run_family_ladder` over :func:`cache_combination_specs` on :data:`FORECAST_STEPS` steps per
    transformer (a worker-pool function; the MagCache calibration is recorded on each rank, on one process)."""
    overrides = cached_call_overrides(family, variant, FORECAST_STEPS)
    calibration = tiny_magcache_calibration(family, variant, overrides)
    specs = cache_combination_specs(prefix, parallel, calibration, compile=compile, timestep=timestep)
    return run_family_ladder(rank, world_size, family, variant, specs, overrides)


def assert_rows(reports: Sequence[Mapping[str, Any]], refused: Mapping[str, str] | None = None) -> list[dict]:
    """Check every rank's report: each row passes, except those ``refused`` maps to a reason fragment, which must
    be refused (``not available``) with that reason. Returns rank 0's rows.

    The ranks must agree row by row (a verdict that differs between ranks is a bug of its own).
    """
    refused = dict(refused or {})
    rows = reports[0]["rows"]
    for report in reports[1:]:
        assert [(r["name"], r["status"]) for r in report["rows"]] == [(r["name"], r["status"]) for r in rows]
    for report in reports:
        for row in report["rows"][1:]:
            name = row["name"]
            if name in refused:
                assert row["status"] == Status.NOT_AVAILABLE, row
                assert refused[name] in row["reason"], row
            else:
                assert row["status"] == Status.PASS, f"{name}: {row['status']}: {row['reason']}"
    return rows
