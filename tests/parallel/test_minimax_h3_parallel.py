"""MiniMax-H3 (no tiny pipeline: diffusers ships it as a ModularPipeline only) split over gloo ranks, on the bare
transformer driven by the family's sampler loop: context parallelism (Ulysses, ring, uneven Ulysses over 3 ranks:
14 packed rows), context parallelism under a step cache that serves steps from the cache (with and without a back
block), and tensor parallelism, each against the single-process run."""

from __future__ import annotations

import pytest
import torch

import fastdit
from fastdit.testing.distributed import WorkerPool

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-4
STEPS = 3


def _run(rank: int, world_size: int, parallel: dict[str, int] | None, bn: int | None) -> torch.Tensor:
    from fastdit.models.minimax_h3 import tiny_denoise, tiny_transformer

    transformer = tiny_transformer()
    cache = None
    if bn is not None:  # step 0 computed, every later step from the cache, the same on every rank
        mask = fastdit.StepMask(compute_steps=(0,), policy="static")
        cache = fastdit.DBCache(fn=1, bn=bn, warmup_steps=0, step_mask=mask)
    fastdit.accelerate(transformer, cache=cache, parallel=None if parallel is None else fastdit.Parallel(**parallel))
    try:
        out = tiny_denoise(transformer, STEPS)
        if parallel is not None and parallel.get("tp", 1) > 1:
            (info,) = fastdit.summary(transformer).transformers.values()
            assert info["tensor_parallel"]["split_layers"] > 0
        if cache is not None:
            assert fastdit.summary(transformer).num_cached_steps == STEPS - 1
        return out
    finally:
        fastdit.disable(transformer)


LAYOUTS = {"ulysses2": {"ulysses": 2}, "ring2": {"ring": 2}, "ulysses3-uneven": {"ulysses": 3}, "tp2": {"tp": 2}}


@pytest.mark.parametrize("bn", [None, 0, 1], ids=["nocache", "cache-bn0", "cache-bn1"])
@pytest.mark.parametrize("parallel", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_matches_single_process(dist2: WorkerPool, dist3: WorkerPool, parallel: dict[str, int], bn: int | None) -> None:
    expected = _run(0, 1, None, bn)
    pool = dist3 if fastdit.Parallel(**parallel).world_size == 3 else dist2
    for out in pool.run(_run, parallel, bn, timeout=180):
        assert out.shape == expected.shape and torch.isfinite(out).all()
        assert (out - expected).abs().max() < TOLERANCE, f"max abs error {(out - expected).abs().max():.2e}"
