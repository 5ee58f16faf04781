"""TeaCache under context parallelism: the recorded changes and the skipped steps are those of one process."""

from __future__ import annotations

import functools
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
