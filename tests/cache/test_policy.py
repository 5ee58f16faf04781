"""The DBCache decision as a function of schedule, caps and residual difference."""

from __future__ import annotations

import torch

from fastdit.cache.policy import decide, relative_l1
from fastdit.cache.state import BranchState, RunTracker
from fastdit.cache.taylorseer import taylor_position, taylor_predict, taylor_update
from fastdit.config import DBCache, StepMask, TaylorSeer


def _run(config: DBCache, residuals: list[float]) -> BranchState:
    """Feed a sequence of (scalar-filled) front residuals through the decision, as the hooks do."""
    state = BranchState()
    for value in residuals:
        state.step += 1
        decide(config, state, torch.full((4,), value), None)
        state.segment(0).hidden_residual = torch.zeros(4)  # a computed step leaves a segment residual behind
    return state


def test_relative_l1() -> None:
    assert abs(relative_l1(torch.tensor([1.1, 2.2]), torch.tensor([1.0, 2.0])) - 0.1) < 1e-6
    assert relative_l1(torch.ones(3), torch.zeros(3)) == float("inf")


def test_relative_l1_uses_the_reducer() -> None:
    calls = []

    def reduce(t: torch.Tensor) -> torch.Tensor:
        calls.append(t.clone())
        return t * torch.tensor([1.0, 2.0])  # as if another rank had the same numerator and a larger denominator

    assert abs(relative_l1(torch.full((2,), 1.5), torch.ones(2), reduce) - 0.25) < 1e-6
    assert len(calls) == 1


def test_threshold_zero_never_caches() -> None:
    state = _run(DBCache(fn=1, threshold=0.0, warmup_steps=0), [1.0] * 6)
    assert state.cached_steps == []


def test_warmup_then_cache_below_threshold() -> None:
    state = _run(DBCache(fn=1, threshold=0.1, warmup_steps=3), [1.0, 1.0, 1.0, 1.01, 1.02, 1.5, 1.5])
    # Steps 3-4 stay within 10% of step 2's residual; step 5 jumps (computes), step 6 matches step 5.
    assert state.cached_steps == [3, 4, 6]
    assert state.diffs[0] is None


def test_drift_accumulates_against_last_computed_step() -> None:
    state = _run(DBCache(fn=1, threshold=0.1, warmup_steps=1), [1.0, 1.06, 1.12, 1.18, 1.24])
    # Each step differs by ~6% from the previous one, but by >10% from the last computed one after two steps.
    assert state.cached_steps == [1, 3]


def test_warmup_interval_lets_odd_warmup_steps_cache() -> None:
    state = _run(DBCache(fn=1, threshold=0.5, warmup_steps=4, warmup_interval=2), [1.0] * 6)
    assert state.cached_steps == [1, 3, 4, 5]


def test_caps() -> None:
    state = _run(DBCache(fn=1, threshold=1.0, warmup_steps=1, max_continuous_cached_steps=2), [1.0] * 8)
    assert state.cached_steps == [1, 2, 4, 5, 7]
    state = _run(DBCache(fn=1, threshold=1.0, warmup_steps=1, max_cached_steps=3), [1.0] * 8)
    assert state.cached_steps == [1, 2, 3]


def test_step_masks() -> None:
    static = StepMask(compute_steps=(0, 3), policy="static")
    state = _run(DBCache(fn=1, threshold=0.0, warmup_steps=0, step_mask=static), [1.0, 9.0, 9.0, 1.0, 5.0])
    assert state.cached_steps == [1, 2, 4]
    dynamic = StepMask(compute_steps=(0, 3), policy="dynamic")
    state = _run(DBCache(fn=1, threshold=0.1, warmup_steps=0, step_mask=dynamic), [1.0, 1.0, 9.0, 1.0, 1.0])
    assert state.cached_steps == [1, 4]


def test_step_mask_presets() -> None:
    fast = StepMask.preset("fast", 28)
    assert fast.compute_steps[:3] == (0, 1, 2) and fast.compute_steps[-1] == 27
    assert len(StepMask.preset("ultra", 28).compute_steps) < len(fast.compute_steps)
    assert len(StepMask.preset("slow", 28).compute_steps) > len(StepMask.preset("medium", 28).compute_steps)


def test_taylor_series_is_exact_on_polynomials() -> None:
    coefficients: list[torch.Tensor] = []
    last = None
    for step in (0, 2, 4):
        coefficients = taylor_update(coefficients, last, torch.tensor(float(3 * step + 1)), step, order=2)
        last = step
    assert torch.isclose(taylor_predict(coefficients, 4, 5), torch.tensor(16.0))


def test_taylor_series_over_falling_unevenly_spaced_timesteps_is_exact_on_lines() -> None:
    # Timesteps usually fall, at uneven spacing: the divided differences must not require rising positions.
    coefficients: list[torch.Tensor] = []
    last = None
    for t in (1.0, 0.8, 0.5):
        coefficients = taylor_update(coefficients, last, torch.tensor(3 * t + 1), t, order=2)
        last = t
    assert len(coefficients) == 3 and abs(coefficients[2].item()) < 1e-5
    assert torch.isclose(taylor_predict(coefficients, 0.5, 0.3), torch.tensor(1.9), atol=1e-5)


def test_taylor_position_follows_the_variable() -> None:
    assert taylor_position(TaylorSeer(order=2), 7, 0.25) == 7.0
    assert taylor_position(TaylorSeer(order=2, variable="timestep"), 7, 0.25) == 0.25
    assert taylor_position(TaylorSeer(order=2, variable="timestep"), 7, None) == 7.0  # the model takes none


def test_tracker_branches_and_runs() -> None:
    tracker = RunTracker()
    for t in (1.0, 1.0, 0.5, 0.5):
        tracker.begin_call("default", t, ((2, 3),))
    assert {k: v.step for k, v in tracker.branches().items()} == {"default": 1, "default/1": 1}
    tracker.begin_call("default", 1.0, ((2, 3),))  # timestep rises: new run
    assert tracker.runs == 2 and tracker.branches()["default"].step == 0
    tracker.begin_call("default", 0.5, ((2, 4),))  # shape changes: new run
    assert tracker.runs == 3
    tracker.reset()
    assert tracker.branches() == {} and "default" in tracker.report()


def test_tracker_follows_rising_schedules() -> None:
    tracker = RunTracker()
    for t in (0.0, 0.0, 0.3, 0.3, 0.7, 0.7):  # counts up, two branches per step
        tracker.begin_call("default", t, ((1,),))
    assert tracker.runs == 1
    assert {k: v.step for k, v in tracker.branches().items()} == {"default": 2, "default/1": 2}
    tracker.begin_call("default", 0.0, ((1,),))  # back to the start: new run
    assert tracker.runs == 2


def test_tracker_branch_with_other_shapes_is_not_a_new_run() -> None:
    tracker = RunTracker()
    for t in (1.0, 0.5, 0.2):  # a batched CFG forward, then a batch-1 guidance forward at the same timestep
        tracker.begin_call("default", t, ((2, 4),))
        tracker.begin_call("default", t, ((1, 4),))
    assert tracker.runs == 1
    assert {k: v.step for k, v in tracker.branches().items()} == {"default": 2, "default/1": 2}
    tracker.begin_call("default", 0.1, ((2, 8),))  # the first call of a step changes shape: a new run
    assert tracker.runs == 2


def test_forecast_decision_follows_linear_drift() -> None:
    residuals = [1.0 + 0.1 * i for i in range(8)]  # 10% drift per step, perfectly linear
    plain = _run(DBCache(fn=1, threshold=0.05, warmup_steps=2, taylorseer=TaylorSeer(order=1)), residuals)
    assert plain.cached_steps == []  # every step is >5% away from the last computed one
    config = DBCache(fn=1, threshold=0.05, warmup_steps=2, taylorseer=TaylorSeer(order=1, forecast_decision=True))
    forecast = _run(config, residuals)
    assert forecast.cached_steps == list(range(2, 8))  # the forecast from steps 0-1 predicts every later step
