"""The scheduler clock: steps told apart on the host, the same decisions as reading each timestep, and its checks.

On a CPU a timestep tensor is read exactly (that costs nothing), so these tests let the clock serve CPU tensors too
(``TimestepReader.exact_devices`` emptied), which is what it does for device tensors.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import fastdit
from fastdit.cache.runs import SchedulerClock
from fastdit.cache.steptime import TimestepReader
from fastdit.errors import FastditWarning
from fastdit.testing.pipelines import build_tiny, run_tiny

STEPS = 6


@pytest.fixture
def clocked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TimestepReader, "exact_devices", frozenset())


@pytest.fixture(scope="module")
def flux():
    return build_tiny("flux")


def _forced() -> fastdit.DBCache:
    mask = fastdit.StepMask(compute_steps=(0, 1, 3), policy="static")
    return fastdit.DBCache(fn=1, bn=0, warmup_steps=0, step_mask=mask)


def _run(pipe, tiny, cache, **kwargs) -> tuple[np.ndarray, dict]:
    fastdit.accelerate(pipe, cache=cache)
    try:
        out = run_tiny(pipe, tiny, num_inference_steps=STEPS, **kwargs)
        stats = fastdit.summary(pipe).transformers["transformer"]["cache"]["branches"]
    finally:
        fastdit.disable(pipe)
    return out, {name: (b["cached_steps"], b["blocks_computed"]) for name, b in stats.items()}


def _exact_and_clocked(monkeypatch, pipe, tiny, cache, **kwargs):
    exact = _run(pipe, tiny, cache, **kwargs)
    monkeypatch.setattr(TimestepReader, "exact_devices", frozenset())
    reads = []
    index = SchedulerClock.index
    monkeypatch.setattr(SchedulerClock, "index", lambda self: reads.append(1) or index(self))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FastditWarning)  # the end-of-run check finds nothing to report
        clocked = _run(pipe, tiny, cache, **kwargs)
    assert len(reads) >= STEPS  # every call was placed by the clock
    return exact, clocked


@pytest.mark.parametrize("true_cfg", [False, True], ids=["one-call", "true-cfg"])
def test_clock_gives_the_decisions_of_exact_reads(monkeypatch, flux, true_cfg: bool) -> None:
    pipe, tiny = flux
    kwargs = {"true_cfg_scale": 2.0, "negative_prompt": "bad"} if true_cfg else {}
    (exact_out, exact_stats), (clock_out, clock_stats) = _exact_and_clocked(
        monkeypatch, pipe, tiny, _forced(), **kwargs
    )
    assert exact_stats == clock_stats and exact_stats["cond"][0] == [2, 4, 5]
    assert len(exact_stats) == (2 if true_cfg else 1)
    np.testing.assert_array_equal(exact_out, clock_out)


def test_forecast_over_the_timestep_is_affine_invariant(monkeypatch, flux) -> None:
    # The clock's positions are the scheduler's timesteps (0-1000), the exact ones the model's (t / 1000): the same
    # forecast up to rounding.
    pipe, tiny = flux
    cache = fastdit.DBCache(
        fn=1, bn=0, warmup_steps=0, step_mask=_forced().step_mask, taylorseer=fastdit.TaylorSeer(variable="timestep")
    )
    (exact_out, exact_stats), (clock_out, clock_stats) = _exact_and_clocked(monkeypatch, pipe, tiny, cache)
    assert exact_stats == clock_stats
    np.testing.assert_allclose(exact_out, clock_out, atol=1e-4)


def test_magcache_runs_on_the_clock(monkeypatch, flux) -> None:
    pipe, tiny = flux
    ratios = (1.0,) + (0.99,) * (STEPS - 1)
    calibration = fastdit.MagCalibration(branches=("cond",), ratios=(ratios,), num_steps=STEPS, fn=0, bn=0)
    cache = fastdit.MagCache(threshold=0.5, max_skip_steps=2, calibration=calibration)
    (exact_out, exact_stats), (clock_out, clock_stats) = _exact_and_clocked(monkeypatch, pipe, tiny, cache)
    assert exact_stats == clock_stats and exact_stats["cond"][0]
    np.testing.assert_array_equal(exact_out, clock_out)


def test_clock_reads_the_scheduler() -> None:
    from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler()
    scheduler.set_timesteps(4)
    clock = SchedulerClock(scheduler)
    assert SchedulerClock.supports(scheduler) and not SchedulerClock.supports(DDIMScheduler())
    assert clock.index() == 0 and clock.timestep(0) == pytest.approx(float(scheduler.timesteps[0]))
    sample = torch.zeros(1, 2)
    scheduler.step(sample, scheduler.timesteps[0], sample)
    assert clock.index() == 1 and clock.timestep(4) is None
    scheduler.set_begin_index(2)
    fresh = FlowMatchEulerDiscreteScheduler()
    fresh.set_timesteps(4)
    fresh.set_begin_index(2)
    assert SchedulerClock(fresh).index() == 2


class _Stalled:
    """A scheduler clock that never advances: every call seems to be the first step's."""

    def index(self) -> int:
        return 0

    def timestep(self, index: int) -> float:
        return 1000.0


class _Clock:
    def __init__(self, positions: list[float]) -> None:
        self.positions = positions
        self.step = 0

    def index(self) -> int:
        return self.step

    def timestep(self, index: int) -> float:
        return self.positions[index]


def test_calls_of_one_index_at_different_timesteps_turn_it_exact(clocked) -> None:
    reader = TimestepReader(torch.amax, "Model")
    clock = _Stalled()
    assert reader.read(torch.tensor([0.9]), clock, "cond") == (1000.0, 0)
    reader.read(torch.tensor([0.8]), clock, "cond")  # a second "branch" at another timestep: not one step
    with pytest.warns(FastditWarning, match="step index 0 received different timesteps"):
        reader.check()
    assert reader.exact and reader.read(torch.tensor([0.7]), clock, "cond") == (pytest.approx(0.7), None)


def test_a_timestep_not_affine_in_the_schedule_turns_it_exact(clocked) -> None:
    positions = [1000.0, 750.0, 500.0, 250.0]
    clock = _Clock(positions)
    for transform, exact in ((lambda t: 1 - t / 1000, False), (lambda t: np.sin(t / 300), True)):
        reader = TimestepReader(torch.amax, "Model")
        for step, t in enumerate(positions):
            clock.step = step
            reader.read(torch.tensor([transform(t)], dtype=torch.bfloat16), clock, "cond")
        if exact:
            with pytest.warns(FastditWarning, match="not an affine function"):
                reader.check()
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("error", FastditWarning)  # bf16 rounding is not a mismatch
                reader.check()
        assert reader.exact is exact


def test_host_tensors_are_read_exactly() -> None:
    reader = TimestepReader(torch.amax, "Model")
    assert reader.read(torch.tensor([0.25, 0.5]), _Clock([1.0]), "cond") == (0.5, None)
    assert reader.read(torch.tensor([0.25]), None, "cond") == (0.25, None)
