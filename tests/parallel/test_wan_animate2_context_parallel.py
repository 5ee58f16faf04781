"""Wan-Animate-2 (no tiny pipeline yet: diffusers ships it as a ModularPipeline only) under context parallelism, on
the bare transformer driven as the modular loop drives it (reference pass filling the KV cache, then both branches
per step), against the single-process run: the generation self-attention's frame buffer and flex BlockMask, and the
reference KV cache, on the whole sequence of each rank's heads (``AttentionRouting.head_parallel``).

The generic matrix of ``test_family_plans.py`` over the bare transformer: Ulysses 2, ring 2, uneven Ulysses 3 (48
tokens a pass over 3 ranks of 2 heads: padded heads), and a forced step cache with and without a back block against
the same cache on one process.
"""

from __future__ import annotations

import pytest
import torch

import fastdit
from fastdit.testing.distributed import WorkerPool

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-4
STEPS = 3
LAYOUTS = {"ulysses2": {"ulysses": 2}, "ring2": {"ring": 2}, "ulysses3": {"ulysses": 3}}


def _run(rank: int, world_size: int, parallel: dict | None, bn: int | None) -> torch.Tensor:
    from fastdit.models.wan_animate2 import tiny_animate, tiny_transformer

    transformer = tiny_transformer()
    cache = None
    if bn is not None:
        mask = fastdit.StepMask(compute_steps=(0,), policy="static")
        cache = fastdit.DBCache(fn=1, bn=bn, warmup_steps=0, step_mask=mask)
    fastdit.accelerate(transformer, cache=cache, parallel=fastdit.Parallel(**parallel) if parallel else None)
    try:
        out = tiny_animate(transformer, STEPS)
        if cache is not None:
            assert fastdit.summary(transformer).num_cached_steps == 2 * (STEPS - 1)
        return out
    finally:
        fastdit.disable(transformer)


# The default run takes the 3-rank cases: the tiny pipeline's reference pass is too short for 3 ranks, so this is the
# family's only uneven Ulysses-3 coverage. On 2 ranks the pipeline itself meets Ulysses 2 and ring 2, uncached and
# under the forced cache with both back-block counts (test_family_plans.py): these runs repeat that in the slow set.
CASES = [
    pytest.param("ulysses2", None, id="ulysses2", marks=pytest.mark.slow),
    pytest.param("ring2", None, id="ring2", marks=pytest.mark.slow),
    pytest.param("ulysses3", None, id="ulysses3-uneven"),
    pytest.param("ring2", 0, id="ring2-cache-bn0", marks=pytest.mark.slow),
    pytest.param("ulysses3", 1, id="ulysses3-cache-bn1"),
    pytest.param("ulysses2", 1, id="ulysses2-cache-bn1", marks=pytest.mark.slow),
    pytest.param("ulysses3", 0, id="ulysses3-cache-bn0", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("layout", "bn"), CASES)
def test_context_parallel_matches_single_process(
    dist2: WorkerPool, dist3: WorkerPool, layout: str, bn: int | None
) -> None:
    parallel = LAYOUTS[layout]
    expected = _run(0, 1, None, bn)
    pool = dist2 if fastdit.Parallel(**parallel).world_size == 2 else dist3
    for out in pool.run(_run, parallel, bn, timeout=400):
        assert out.shape == expected.shape and torch.isfinite(out).all()
        assert (out - expected).abs().max() < TOLERANCE, f"max abs error {(out - expected).abs().max():.2e}"
