"""TeaCache under parallelism: the recorded changes and the skipped steps are those of one process.

Context parallelism splits the first block's input over the ranks (the sums of its change are reduced), tensor
parallelism keeps it whole on every rank, CFG parallelism runs each guidance branch on its own rank, which keeps
that branch's state. The thresholds fall between the accumulated changes, so the decisions depend on the measured
values: a rank that measured differently would skip other steps.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import pytest
import torch

import fastdit
from fastdit.testing.distributed import WorkerPool, get_pool

CALL = {
    "prompt": "a cat holding a sign",
    "num_inference_steps": 6,
    "max_sequence_length": 16,
    "height": 32,
    "width": 32,
}


@functools.lru_cache(maxsize=1)
def _pipeline() -> Any:
    from fastdit.models.flux import tiny_flux

    pipe = tiny_flux(0)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _parallel(ulysses: int) -> fastdit.Parallel | None:
    return fastdit.Parallel(ulysses=ulysses) if ulysses > 1 else None


def _calibrate(rank: int, world_size: int, ulysses: int) -> list[tuple[float, float]]:
    pipe = _pipeline()
    fastdit.accelerate(pipe, cache=fastdit.TeaCache(calibrate=True), parallel=_parallel(ulysses))
    try:
        pipe(**CALL, generator=torch.Generator().manual_seed(0), output_type="np")
        (pairs,) = fastdit.api.context_of(pipe).state("cache", "transformer").pairs().values()
        return pairs
    finally:
        fastdit.disable(pipe)


def _skip(rank: int, world_size: int, ulysses: int, config: fastdit.TeaCache) -> tuple[np.ndarray, list, list]:
    pipe = _pipeline()
    fastdit.accelerate(pipe, cache=config, parallel=_parallel(ulysses))
    try:
        images = pipe(**CALL, generator=torch.Generator().manual_seed(0), output_type="np").images
        (branch,) = fastdit.summary(pipe).transformers["transformer"]["cache"]["branches"].values()
        return images, branch["cached_steps"], branch["residual_diffs"]
    finally:
        fastdit.disable(pipe)


@pytest.fixture(scope="module")
def dist2() -> WorkerPool:
    return get_pool(2)


@pytest.fixture(scope="module")
def dist4() -> WorkerPool:
    return get_pool(4)


# Flux's true CFG: a cond and an uncond call per step, announced as such.
TRUE_CFG = {"negative_prompt": "a dog", "true_cfg_scale": 2.0}


def _branches(
    rank: int, world_size: int, layout: dict[str, int], config: fastdit.TeaCache, extra: dict[str, Any]
) -> tuple[np.ndarray, dict[str, dict[str, Any]]]:
    """The images and each cache branch's statistics under ``layout`` (empty: one process)."""
    pipe = _pipeline()
    fastdit.accelerate(pipe, cache=config, parallel=fastdit.Parallel(**layout) if layout else None)
    try:
        images = pipe(**CALL, **extra, generator=torch.Generator().manual_seed(0), output_type="np").images
        return images, fastdit.summary(pipe).transformers["transformer"]["cache"]["branches"]
    finally:
        fastdit.disable(pipe)


@functools.lru_cache(maxsize=2)
def _between(extra: tuple[tuple[str, Any], ...] = ()) -> fastdit.TeaCache:
    """A TeaCache calibrated on one process whose threshold lies between the accumulated changes of the call."""
    from fastdit.calibration import calibrate

    pipe = _pipeline()
    call = {**CALL, **dict(extra), "output_type": "np"}
    calibration = calibrate(pipe, lambda: pipe(**call, generator=torch.Generator().manual_seed(0)), policy="teacache")
    return fastdit.TeaCache(threshold=0.3, max_skip_steps=2, retention_ratio=0.0, calibration=calibration)


def _assert_same_decisions(one: dict[str, Any], other: dict[str, Any], name: str) -> None:
    assert other["cached_steps"] == one["cached_steps"], name
    # The accumulated change of every step: the reduced measurement itself, not only the decisions it led to.
    expected = [d for d in one["residual_diffs"] if d is not None]
    measured = [d for d in other["residual_diffs"] if d is not None]
    np.testing.assert_allclose(measured, expected, rtol=1e-4, atol=1e-6, err_msg=name)


@pytest.mark.distributed  # about 7 s on two ranks: in the default run, so the rank-equal decision stays covered
def test_changes_and_decisions_under_ulysses_match_one_process(dist2: WorkerPool) -> None:
    from fastdit.cache.teacache import fit_calibration

    expected = _calibrate(0, 1, 1)
    for pairs in dist2.run(_calibrate, 2, timeout=120):
        # Both changes are sums reduced over the ranks: every rank records those of the whole sequence.
        np.testing.assert_allclose(pairs, expected, rtol=1e-4)
    calibration = fit_calibration(expected, 2, num_steps=6)
    # A threshold between the accumulated changes, so that some steps skip and some compute.
    config = fastdit.TeaCache(threshold=0.3, max_skip_steps=2, retention_ratio=0.0, calibration=calibration)
    images, steps, diffs = _skip(0, 1, 1, config)
    assert steps and len(steps) < 4, f"the schedule must skip some steps and compute others, skipped {steps}"
    for rank_images, rank_steps, rank_diffs in dist2.run(_skip, 2, config, timeout=120):
        assert rank_steps == steps
        np.testing.assert_allclose(
            [d for d in rank_diffs if d is not None], [d for d in diffs if d is not None], rtol=1e-4
        )
        np.testing.assert_allclose(rank_images, images, atol=1e-4)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [{"tp": 2}, {"tp": 2, "ulysses": 2}], ids=["tp2", "tp2-ulysses2"])
def test_decisions_under_tensor_parallelism_match_one_process(
    request: pytest.FixtureRequest, layout: dict[str, int]
) -> None:
    config = _between()
    images, branches = _branches(0, 1, {}, config, {})
    (one,) = branches.values()
    assert one["cached_steps"] and len(one["cached_steps"]) < 4, f"some steps must skip and others compute: {one}"
    pool = request.getfixturevalue(f"dist{math.prod(layout.values())}")  # the 2-D mesh takes 4 ranks
    for rank, (rank_images, rank_branches) in enumerate(pool.run(_branches, layout, config, {}, timeout=120)):
        (branch,) = rank_branches.values()
        _assert_same_decisions(one, branch, f"rank {rank}")
        np.testing.assert_allclose(rank_images, images, atol=1e-4)


@pytest.mark.distributed
def test_each_cfg_rank_keeps_its_branch_state_as_one_process(dist2: WorkerPool) -> None:
    config = _between(tuple(TRUE_CFG.items()))
    images, one = _branches(0, 1, {}, config, TRUE_CFG)
    assert set(one) == {"cond", "uncond"} and all(b["steps"] == 6 for b in one.values())
    assert all(b["cached_steps"] and len(b["cached_steps"]) < 4 for b in one.values()), one
    for rank, (rank_images, branches) in enumerate(dist2.run(_branches, {"cfg": 2}, config, TRUE_CFG, timeout=120)):
        mine, other = ("cond", "uncond") if rank == 0 else ("uncond", "cond")
        # A rank runs its own branch at every step, the other one only in the warm-up pair of step 0.
        assert {name: b["steps"] for name, b in branches.items()} == {mine: 6, other: 1}
        _assert_same_decisions(one[mine], branches[mine], f"rank {rank}")
        np.testing.assert_allclose(rank_images, images, atol=1e-4)


# --- the spectral signal on a tiny Wan (the latent read whole on every rank, its sums reduced) ---

WAN_STEPS = 6


@functools.lru_cache(maxsize=1)
def _wan() -> Any:
    from fastdit.models.wan import tiny_wan_t2v

    pipe = tiny_wan_t2v(0)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _wan_run(rank: int, world_size: int, ulysses: int, config: fastdit.TeaCache) -> tuple[np.ndarray, dict, list]:
    from fastdit.models.wan import ADAPTER

    pipe = _wan()
    fastdit.accelerate(pipe, cache=config, parallel=_parallel(ulysses))
    try:
        kwargs = {**ADAPTER.tiny("t2v").call_kwargs, "num_inference_steps": WAN_STEPS}
        frames = pipe(**kwargs, generator=torch.Generator().manual_seed(0), output_type="np").frames
        branches = fastdit.summary(pipe).transformers["transformer"]["cache"]["branches"]
        pairs = fastdit.api.context_of(pipe).state("cache", "transformer").pairs()
        steps = {name: (b["cached_steps"], b["residual_diffs"]) for name, b in branches.items()}
        return np.asarray(frames), steps, pairs.get("cond", [])
    finally:
        fastdit.disable(pipe)


@pytest.mark.distributed  # about 6 s on two ranks
def test_spectral_signal_under_ulysses_matches_one_process(dist2: WorkerPool) -> None:
    _, _, pairs = _wan_run(0, 1, 1, fastdit.TeaCache(calibrate=True, signal="spectral"))
    # Just over the largest change: some steps skip, the cap of 2 makes others compute.
    threshold = 1.01 * max(x for x, _ in pairs)
    config = fastdit.TeaCache(threshold=threshold, max_skip_steps=2, retention_ratio=0.0, signal="spectral")
    frames, steps, _ = _wan_run(0, 1, 1, config)
    assert 0 < len(steps["cond"][0]) < WAN_STEPS - 1, steps
    for rank_frames, rank_steps, _ in dist2.run(_wan_run, 2, config, timeout=180):
        assert {name: s for name, (s, _) in rank_steps.items()} == {name: s for name, (s, _) in steps.items()}
        for name, (_, diffs) in steps.items():
            measured = [d for d in rank_steps[name][1] if d is not None]
            np.testing.assert_allclose(measured, [d for d in diffs if d is not None], rtol=1e-5)
        np.testing.assert_allclose(rank_frames, frames, atol=1e-4)
