"""MagCache under context parallelism: the calibration and the skipped steps are those of one process."""

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


def _call(pipe: Any) -> np.ndarray:
    return pipe(**CALL, generator=torch.Generator().manual_seed(0), output_type="np").images


def _calibrate(rank: int, world_size: int, ulysses: int) -> fastdit.MagCalibration:
    pipe = _pipeline()
    parallel = fastdit.Parallel(ulysses=ulysses) if ulysses > 1 else None
    fastdit.accelerate(pipe, cache=fastdit.MagCache(calibrate=True), parallel=parallel)
    try:
        _call(pipe)
        from fastdit.calibration import calibration_of

        return calibration_of(pipe)
    finally:
        fastdit.disable(pipe)


def _skip(rank: int, world_size: int, ulysses: int, config: fastdit.MagCache) -> tuple[np.ndarray, list[int]]:
    pipe = _pipeline()
    parallel = fastdit.Parallel(ulysses=ulysses) if ulysses > 1 else None
    fastdit.accelerate(pipe, cache=config, parallel=parallel)
    try:
        images = _call(pipe)
        branches = fastdit.summary(pipe).transformers["transformer"]["cache"]["branches"]
        return images, [step for b in branches.values() for step in b["cached_steps"]]
    finally:
        fastdit.disable(pipe)


@pytest.fixture(scope="module")
def dist2() -> WorkerPool:
    return get_pool(2)


@pytest.mark.slow
@pytest.mark.distributed
def test_calibration_and_decisions_under_ulysses_match_one_process(dist2: WorkerPool) -> None:
    expected = _calibrate(0, 1, 1)
    for calibration in dist2.run(_calibrate, 2, timeout=120):
        # The magnitudes are sums reduced over the ranks: every rank records the ratios of the whole sequence.
        np.testing.assert_allclose(calibration.ratios, expected.ratios, rtol=1e-4)
    config = fastdit.MagCache(threshold=0.5, max_skip_steps=2, retention_ratio=0.2, calibration=expected)
    images, steps = _skip(0, 1, 1, config)
    assert steps, "the schedule must skip some steps"
    for rank_images, rank_steps in dist2.run(_skip, 2, config, timeout=120):
        assert rank_steps == steps
        np.testing.assert_allclose(rank_images, images, atol=1e-4)
