"""The matrices' cache schedules on one process: they serve the steps they promise, and every forecast they run
extrapolates (a schedule that only ever reused a residual would let a broken forecast pass every matrix)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fastdit.diagnostics.family_ladder import (
    FORECAST_STEPS,
    FORECASTS,
    TIMESTEP_FORECAST,
    RungSpec,
    cached_call_overrides,
    forced_teacache,
    forecast_cache,
    forecast_magcache,
    tiny_magcache_calibration,
)
from fastdit.models.registry import get_family
from fastdit.testing.pipelines import build_tiny, run_accelerated


def _run(pipe, tiny, cache, overrides: dict) -> tuple[np.ndarray, dict[str, list[int]]]:
    out, transformers = run_accelerated(pipe, tiny, {"cache": cache}, **overrides)
    served = {
        f"{name}/{branch}": stats["cached_steps"]
        for name, info in transformers.items()
        for branch, stats in info["cache"]["branches"].items()
    }
    return out, served


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_forecast_schedules_serve_their_steps_and_every_method_extrapolates(family: str) -> None:
    variant = get_family(family).tiny_pipelines[0].name
    pipe, tiny = build_tiny(family, variant)
    overrides = cached_call_overrides(family, variant, FORECAST_STEPS)
    calibration = tiny_magcache_calibration(family, variant, overrides)
    for policy, make in (("dbcache", forecast_cache), ("magcache", lambda f: forecast_magcache(calibration, f))):
        reused, served = _run(pipe, tiny, dataclasses.replace(make(FORECASTS["foca"]), taylorseer=None), overrides)
        assert served and all(steps == [3, 4] for steps in served.values()), (policy, served)
        outputs = [reused]
        for method, forecast in {**FORECASTS, "foca-timestep": TIMESTEP_FORECAST}.items():
            out, forecast_served = _run(pipe, tiny, make(forecast), overrides)
            assert forecast_served == served, (policy, method)
            # Steps 3 and 4 replay a forecast from the residuals of steps 0-2, not the residual of step 2.
            assert np.isfinite(out).all() and not any(np.array_equal(out, o) for o in outputs), (policy, method)
            outputs.append(out)
    _, served = _run(pipe, tiny, forced_teacache(), overrides)
    assert served and all(steps == [1, 2, 4] for steps in served.values()), served


def test_a_rung_takes_one_cache() -> None:
    with pytest.raises(ValueError, match=r"RungSpec 'x': cache_bn=0 and cache= both give a cache"):
        RungSpec("x", cache_bn=0, cache=forced_teacache())
    rung = RungSpec("x", {"tp": 2}, cache=forced_teacache()).rung()
    assert rung.reference == {"cache": forced_teacache()}
