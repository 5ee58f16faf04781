"""TeaCache(decide_ahead=True): each step decided from the change measured one step earlier, corrected a step later."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
import torch

import fastdit
from fastdit.cache import teacache
from fastdit.cache.policy import relative_l1
from fastdit.cache.teacache import TeaAccumulator, TeaCacheEngine, tea_decide, tea_decide_ahead
from fastdit.calibration import calibration_of
from fastdit.errors import FieldError
from fastdit.testing.distributed import WorkerPool, get_pool
from fastdit.testing.pipelines import build_tiny, run_tiny

# The input change taken as the residual change: the threshold reads in input units.
IDENTITY = fastdit.TeaCalibration(coefficients=(1.0, 0.0), num_steps=8)

CALL = {
    "prompt": "a cat holding a sign",
    "num_inference_steps": 8,
    "max_sequence_length": 16,
    "height": 32,
    "width": 32,
}


def _config(**fields: Any) -> fastdit.TeaCache:
    settings = {"threshold": 0.25, "max_skip_steps": 5, "retention_ratio": 0.0, "final_steps": 0}
    return fastdit.TeaCache(**{**settings, "calibration": IDENTITY, "decide_ahead": True, **fields})


def _ahead(config: fastdit.TeaCache, changes: list[float], num_steps: int | None = None) -> tuple[list[int], list]:
    """Cached steps and per-step ``(estimate, accumulated)`` when step ``k``'s own change is ``changes[k]``.

    Step ``k`` only knows ``changes[k - 1]`` (nothing at steps 0 and 1: step 0 has no change, step 1 no earlier one).
    """
    acc = TeaAccumulator(num_steps=num_steps)
    cached, trace = [], []
    for step in range(len(changes)):
        lagged = changes[step - 1] if step >= 2 else None
        if not tea_decide_ahead(config, acc, step, lagged, step > 0):
            cached.append(step)
        trace.append((acc.estimate, acc.accumulated))
    return cached, trace


def _own(config: fastdit.TeaCache, changes: list[float]) -> list[int]:
    acc = TeaAccumulator(num_steps=None)
    return [s for s in range(len(changes)) if not tea_decide(config, acc, s, changes[s] if s else None, s > 0)]


# --- the decision ---


def test_a_constant_change_gives_the_pattern_of_the_own_test_one_step_later() -> None:
    changes = [0.0] + [0.1] * 9
    # Without deciding ahead: 0.1, 0.2 skip, 0.3 computes and restarts.
    assert _own(_config(), changes) == [1, 2, 4, 5, 7, 8]
    cached, trace = _ahead(_config(), changes)
    # Step 1 has no earlier change and computes; then the same period of three, one step later. The accumulator
    # keeps the exact sum through the previous step (0, then 0.1 once step 2's own change arrived at step 3), so
    # the estimates grow by one change per skipped step: the known sum never loses a step, nor counts one twice.
    # Without the correction the estimate would stay at 0.1 and every step up to the cap would skip.
    assert cached == [2, 3, 5, 6, 8, 9]
    estimates = [e for e, _ in trace]
    assert estimates[:2] == [None, None]
    np.testing.assert_allclose(estimates[2:5], [0.1, 0.2, 0.3])
    np.testing.assert_allclose([a for _, a in trace[2:4]], [0.0, 0.1])  # after steps 2 and 3 (both skipped)


def test_a_change_that_jumps_is_counted_once_it_arrives() -> None:
    changes = [0.0, 0.05, 0.05, 0.05, 0.3, 0.05, 0.05, 0.05, 0.05]
    # Step 4's own change is large: the own test computes step 4, deciding ahead cannot know it before step 5,
    # where the correction adds it to the sum (0.05 + 0.05 + 0.3, plus the 0.3 that stands in for step 5's change).
    assert _own(_config(), changes) == [1, 2, 3, 5, 6, 7, 8]
    cached, trace = _ahead(_config(), changes)
    assert cached == [2, 3, 4, 6, 7, 8]
    estimate, accumulated = trace[5]
    assert estimate == pytest.approx(0.7) and accumulated == 0.0  # step 5 computed: the sum restarted
    np.testing.assert_allclose([trace[k][0] for k in (6, 7, 8)], [0.05, 0.10, 0.15])


def test_cap_retention_final_steps_and_a_rescaled_change_apply_as_without_it() -> None:
    # A huge threshold: only the cap of 2 binds.
    assert _ahead(_config(threshold=1e6, max_skip_steps=2), [0.0] + [0.1] * 7)[0] == [2, 3, 5, 6]
    # Two retained steps (20 % of 10) hide the lag of step 1; step 9 is final: the schedule of the own test.
    config = _config(retention_ratio=0.2, final_steps=1)
    assert _ahead(config, [0.0] + [0.1] * 9, 10)[0] == [2, 3, 5, 6, 8]
    # p(x) = 4x: 0.02 counts 0.08, so 0.08, 0.16, 0.24 skip, the fourth would pass the cap of 3 (and the threshold).
    steep = fastdit.TeaCalibration(coefficients=(4.0, 0.0))
    assert _ahead(_config(max_skip_steps=3, calibration=steep), [0.0] + [0.02] * 8)[0] == [2, 3, 4, 6, 7, 8]
    # A previous input of zeros gives an infinite change: the step it reaches computes.
    assert _ahead(_config(), [0.0, 0.01, float("inf"), 0.01, 0.01])[0] == [2, 4]


def test_config_validation() -> None:
    assert fastdit.TeaCache(threshold=0.0).decide_ahead is False
    with pytest.raises(FieldError) as caught:
        fastdit.TeaCache(threshold=0.0, decide_ahead=1)
    assert (caught.value.owner, caught.value.field, caught.value.value) == ("TeaCache", "decide_ahead", 1)
    with pytest.raises(FieldError, match="decide_ahead"):
        fastdit.TeaCache(threshold=0.0, decide_ahead="yes")
    # The checks of the other fields still apply with it.
    with pytest.raises(FieldError) as caught:
        fastdit.TeaCache(threshold=0.1, decide_ahead=True)
    assert caught.value.field == "calibration"


def test_cache_files_and_presets_carry_it(tmp_path) -> None:
    from fastdit.cache.files import CacheFile, load_cache_file, save_cache_file
    from fastdit.cache.presets import cache_config

    config = _config(signal="spectral", calibration=None)
    save_cache_file(tmp_path / "cache.json", CacheFile(config, "toy", 8))
    assert load_cache_file(tmp_path / "cache.json", num_steps=8).config == config
    video = cache_config("video", decide_ahead=True)
    assert isinstance(video, fastdit.TeaCache) and video.decide_ahead and video.signal == "spectral"


# --- runs ---


@pytest.fixture(scope="module")
def flux():
    return build_tiny("flux")


class _Spy:
    """Records, per branch accumulator, each step's own change when measured and the change each decision read."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.measured: dict[int, dict[int, float]] = {}
        self.read: dict[int, dict[int, float | None]] = {}
        measure, decide = TeaCacheEngine._measure, teacache.tea_decide_ahead

        def spy_measure(engine: TeaCacheEngine, state: Any, current: torch.Tensor, previous: torch.Tensor) -> None:
            self.measured.setdefault(id(state.policy), {})[state.step] = relative_l1(current, previous)
            measure(engine, state, current, previous)

        def spy_decide(config: Any, acc: TeaAccumulator, step: int, lagged: float | None, has_cache: bool) -> bool:
            self.read.setdefault(id(acc), {})[step] = lagged
            return decide(config, acc, step, lagged, has_cache)

        monkeypatch.setattr(TeaCacheEngine, "_measure", spy_measure)
        monkeypatch.setattr(teacache, "tea_decide_ahead", spy_decide)

    def check(self, branches: int) -> None:
        """Each decision read the change its own branch measured one step earlier (none at steps 0 and 1)."""
        assert len(self.read) == branches and set(self.measured) == set(self.read)
        for key, read in self.read.items():
            measured = self.measured[key]
            assert read[0] is None and read[1] is None
            for step in range(2, len(read)):
                assert read[step] == pytest.approx(measured[step - 1], rel=1e-6), (key, step)


def test_threshold_zero_and_calibration_runs_are_bit_identical(flux) -> None:
    pipe, tiny = flux
    kwargs = {"num_inference_steps": 4}
    baseline = run_tiny(pipe, tiny, **kwargs)
    calibrations = []
    for config in (
        fastdit.TeaCache(threshold=0.0, decide_ahead=True),
        fastdit.TeaCache(calibrate=True),
        fastdit.TeaCache(calibrate=True, decide_ahead=True),
    ):
        fastdit.accelerate(pipe, cache=config)
        try:
            out = run_tiny(pipe, tiny, **kwargs)
            assert fastdit.summary(pipe).num_cached_steps == 0
            if config.calibrate:
                calibrations.append((calibration_of(pipe, degree=1), dict(_engine(pipe).pairs())))
        finally:
            fastdit.disable(pipe)
        np.testing.assert_array_equal(out, baseline)
    # A calibration run records every step's own change, deciding ahead or not.
    assert calibrations[0] == calibrations[1]
    (pairs,) = calibrations[0][1].values()
    assert len(pairs) == 3


def _engine(pipe: Any) -> TeaCacheEngine:
    return fastdit.api.context_of(pipe).state("cache", "transformer")


@pytest.mark.parametrize("true_cfg", [False, True], ids=["one-call", "true-cfg"])
def test_each_branch_decides_from_its_own_previous_change(flux, true_cfg: bool, monkeypatch) -> None:
    pipe, tiny = flux
    kwargs = {"num_inference_steps": 8, **({"negative_prompt": "a dog", "true_cfg_scale": 2.0} if true_cfg else {})}
    baseline = run_tiny(pipe, tiny, **kwargs)
    spy = _Spy(monkeypatch)
    fastdit.accelerate(pipe, cache=_config(threshold=0.1, max_skip_steps=3))
    try:
        out = run_tiny(pipe, tiny, **kwargs)
        branches = fastdit.summary(pipe).transformers["transformer"]["cache"]["branches"]
    finally:
        fastdit.disable(pipe)
    spy.check(2 if true_cfg else 1)
    assert len(branches) == (2 if true_cfg else 1)
    for branch in branches.values():
        # Each branch counts its own 8 steps (one shared state would count 16 calls); its changes grow over the
        # run, so the threshold lets some steps skip and makes others compute.
        assert branch["steps"] == 8
        assert branch["cached_steps"] and 0 not in branch["cached_steps"] and 1 not in branch["cached_steps"]
        assert len(branch["cached_steps"]) < 6, branch
    assert np.isfinite(out).all() and np.abs(out - baseline).max() < 0.5


def test_spectral_signal_decides_ahead(monkeypatch) -> None:
    from fastdit.models.wan import ADAPTER, tiny_wan_t2v

    pipe = tiny_wan_t2v(0)
    pipe.set_progress_bar_config(disable=True)
    kwargs = {**ADAPTER.tiny("t2v").call_kwargs, "num_inference_steps": 6, "output_type": "np"}
    spy = _Spy(monkeypatch)
    # A huge threshold: every step the cap of 2 allows skips, so the cached steps are known in advance.
    config = fastdit.TeaCache(
        threshold=1e6, max_skip_steps=2, retention_ratio=0.0, signal="spectral", decide_ahead=True
    )
    fastdit.accelerate(pipe, cache=config)
    try:
        frames = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).frames
        branches = fastdit.summary(pipe).transformers["transformer"]["cache"]["branches"]
    finally:
        fastdit.disable(pipe)
    spy.check(len(branches))
    assert all(b["cached_steps"] == [2, 3, 5] for b in branches.values()), branches
    assert np.isfinite(np.asarray(frames)).all()


# --- context parallelism: one decision on every rank ---


@functools.lru_cache(maxsize=1)
def _pipeline() -> Any:
    from fastdit.models.flux import tiny_flux

    pipe = tiny_flux(0)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _run(rank: int, world_size: int, layout: dict[str, int]) -> tuple[np.ndarray, list, list]:
    pipe = _pipeline()
    fastdit.accelerate(
        pipe, cache=_config(threshold=0.1, max_skip_steps=3), parallel=fastdit.Parallel(**layout) if layout else None
    )
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
    images, steps, estimates = _run(0, 1, {})
    assert steps and len(steps) < 6, f"some steps must skip and some compute, skipped {steps}"
    for rank_images, rank_steps, rank_estimates in dist2.run(_run, layout, timeout=120):
        assert rank_steps == steps  # the changes are reduced over the ranks: one decision everywhere
        np.testing.assert_allclose(
            [e for e in rank_estimates if e is not None], [e for e in estimates if e is not None], rtol=1e-4
        )
        np.testing.assert_allclose(rank_images, images, atol=1e-4)
