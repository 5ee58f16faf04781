"""DBCache(decide_ahead=True): each step decided from the drift measured one step earlier, carried to this step."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
import torch

import fastdit
from fastdit.cache.policy import decide
from fastdit.cache.state import BranchState, SegmentMemory
from fastdit.errors import FieldError
from fastdit.testing.distributed import WorkerPool, get_pool
from fastdit.testing.pipelines import build_tiny, run_tiny

CALL = {
    "prompt": "a cat holding a sign",
    "num_inference_steps": 8,
    "max_sequence_length": 16,
    "height": 32,
    "width": 32,
}


def _state() -> BranchState:
    state = BranchState()
    state.segments[0] = SegmentMemory(hidden_residual=torch.ones(1))  # a middle segment holds a residual
    return state


def _run_policy(config: fastdit.DBCache, drifts: list[float]) -> tuple[list[bool], list[float | None]]:
    """Decisions over front residuals whose relative-L1 drift from step 0's is ``drifts[k]`` at step ``k``."""
    base = torch.ones(4)
    state = _state()
    decisions = []
    for step, drift in enumerate(drifts):
        state.step = step
        # The residual moves away from the last computed one by ``drift`` (relative) per step.
        reference = base if state.front_residual is None else state.front_residual
        residual = reference * (1 + drift * (step - max(state.reference_step, 0)))
        decisions.append(decide(config, state, residual, None))
    return decisions, state.diffs


def test_prediction_carries_the_last_measured_rate() -> None:
    config = fastdit.DBCache(fn=1, bn=0, threshold=0.25, warmup_steps=1, decide_ahead=True)
    # Every step adds 0.1 of drift per step away from the reference.
    decisions, diffs = _run_policy(config, [0.1] * 7)
    # Step 0 warms up; step 1 has no drift measured since the reference yet (computes); from step 2 on the rate
    # 0.1 per step predicts 0.1, 0.2 (cached), 0.3 (computes), then again.
    assert decisions == [True, True, False, False, True, False, False]
    assert diffs[:2] == [None, None]
    np.testing.assert_allclose(diffs[2:], [0.1, 0.2, 0.3, 0.1, 0.2], rtol=1e-6)


def test_the_step_own_residual_decides_without_it() -> None:
    config = fastdit.DBCache(fn=1, bn=0, threshold=0.25, warmup_steps=1)
    decisions, diffs = _run_policy(config, [0.1] * 7)
    assert decisions == [True, False, False, True, False, False, True]
    np.testing.assert_allclose(diffs[1:], [0.1, 0.2, 0.3, 0.1, 0.2, 0.3], rtol=1e-6)


def test_refuses_a_verified_forecast() -> None:
    with pytest.raises(FieldError) as caught:
        fastdit.DBCache(decide_ahead=True, taylorseer=fastdit.TaylorSeer(forecast_decision=True))
    assert caught.value.owner == "DBCache" and caught.value.field == "decide_ahead"
    with pytest.raises(FieldError, match="decide_ahead"):
        fastdit.DBCache(decide_ahead=1)


@pytest.fixture(scope="module")
def flux():
    return build_tiny("flux")


def test_threshold_zero_is_bit_identical(flux) -> None:
    pipe, tiny = flux
    baseline = run_tiny(pipe, tiny)
    fastdit.accelerate(pipe, cache=fastdit.DBCache(fn=1, bn=0, threshold=0.0, warmup_steps=0, decide_ahead=True))
    try:
        np.testing.assert_array_equal(run_tiny(pipe, tiny), baseline)
    finally:
        fastdit.disable(pipe)


@pytest.mark.parametrize("true_cfg", [False, True], ids=["one-call", "true-cfg"])
def test_caches_per_branch_on_a_pipeline(flux, true_cfg: bool) -> None:
    pipe, tiny = flux
    kwargs = {"true_cfg_scale": 2.0, "negative_prompt": "bad", "num_inference_steps": 8} if true_cfg else {}
    kwargs.setdefault("num_inference_steps", 8)
    baseline = run_tiny(pipe, tiny, **kwargs)
    config = fastdit.DBCache(fn=1, bn=0, threshold=0.5, warmup_steps=1, decide_ahead=True)
    fastdit.accelerate(pipe, cache=config)
    try:
        out = run_tiny(pipe, tiny, **kwargs)
        branches = fastdit.summary(pipe).transformers["transformer"]["cache"]["branches"]
    finally:
        fastdit.disable(pipe)
    assert len(branches) == (2 if true_cfg else 1)
    for branch in branches.values():
        assert branch["cached_steps"] and 0 not in branch["cached_steps"] and 1 not in branch["cached_steps"]
    assert np.isfinite(out).all() and np.abs(out - baseline).max() < 0.5


@functools.lru_cache(maxsize=1)
def _pipeline() -> Any:
    from fastdit.models.flux import tiny_flux

    pipe = tiny_flux(0)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _ahead(rank: int, world_size: int, layout: dict[str, int]) -> tuple[np.ndarray, list, list]:
    pipe = _pipeline()
    config = fastdit.DBCache(fn=1, bn=0, threshold=0.3, warmup_steps=1, decide_ahead=True)
    fastdit.accelerate(pipe, cache=config, parallel=fastdit.Parallel(**layout) if layout else None)
    try:
        images = pipe(**CALL, generator=torch.Generator().manual_seed(0), output_type="np").images
        (branch,) = fastdit.summary(pipe).transformers["transformer"]["cache"]["branches"].values()
        return images, branch["cached_steps"], branch["residual_diffs"]
    finally:
        fastdit.disable(pipe)


@pytest.fixture(scope="module")
def dist2() -> WorkerPool:
    return get_pool(2)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [{"ulysses": 2}, {"ring": 2}], ids=["ulysses2", "ring2"])
def test_decisions_under_context_parallelism_match_one_process(dist2: WorkerPool, layout: dict[str, int]) -> None:
    images, steps, diffs = _ahead(0, 1, {})
    assert steps and len(steps) < 6, f"some steps must cache and some compute, cached {steps}"
    for rank_images, rank_steps, rank_diffs in dist2.run(_ahead, layout, timeout=120):
        assert rank_steps == steps  # the drift is reduced over the ranks: one decision everywhere
        np.testing.assert_allclose(
            [d for d in rank_diffs if d is not None], [d for d in diffs if d is not None], rtol=1e-4
        )
        np.testing.assert_allclose(rank_images, images, atol=1e-4)
