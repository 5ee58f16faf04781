"""Wan-Animate-2 (no tiny pipeline: diffusers ships it as a ModularPipeline only) split over 2 gloo ranks by tensor
parallelism, on the bare transformer driven as the modular loop drives it (reference pass, then both branches per
step), with and without a step cache serving steps from the cache, against the single-process run."""

from __future__ import annotations

import pytest
import torch

import fastdit
from fastdit.testing.distributed import WorkerPool

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-4
STEPS = 3


def _run(rank: int, world_size: int, tp: int, bn: int | None) -> torch.Tensor:
    from fastdit.models.wan_animate2 import tiny_animate, tiny_transformer

    transformer = tiny_transformer()
    cache = None
    if bn is not None:
        mask = fastdit.StepMask(compute_steps=(0,), policy="static")
        cache = fastdit.DBCache(fn=1, bn=bn, warmup_steps=0, step_mask=mask)
    fastdit.accelerate(transformer, cache=cache, parallel=fastdit.Parallel(tp=tp) if tp > 1 else None)
    try:
        out = tiny_animate(transformer, STEPS)
        summary = fastdit.summary(transformer)
        if tp > 1:
            (info,) = summary.transformers.values()
            assert info["tensor_parallel"]["split_layers"] > 0 and info["tensor_parallel"]["split_norms"] > 0
        if cache is not None:
            assert summary.num_cached_steps == 2 * (STEPS - 1)  # both branches, the reference pass not counted
        return out
    finally:
        fastdit.disable(transformer)


@pytest.mark.parametrize("bn", [None, 1], ids=["nocache", "cache-bn1"])
def test_tp2_matches_single_process(dist2: WorkerPool, bn: int | None) -> None:
    expected = _run(0, 1, 1, bn)
    for out in dist2.run(_run, 2, bn, timeout=400):
        assert out.shape == expected.shape and torch.isfinite(out).all()
        assert (out - expected).abs().max() < TOLERANCE, f"max abs error {(out - expected).abs().max():.2e}"
