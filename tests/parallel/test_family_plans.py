"""Every family with a context-parallel plan: its tiny pipelines on gloo ranks equal the single-process output.

The plan is discovered from the registry, so a family file that gains ``cp_plan`` is covered here without touching
this file. Ulysses and ring run on 2 ranks; Ulysses on 3 ranks exercises uneven sequence shards and padded heads.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest

import fastdit
from fastdit.models.registry import all_adapters
from fastdit.testing.distributed import DistributedTestError, WorkerPool
from fastdit.testing.pipelines import build_tiny, run_tiny

pytestmark = pytest.mark.distributed

# Float32 on CPU: context parallelism reorders sums only; 1e-4 on [0, 1] outputs is > 80 dB PSNR.
TOLERANCE = 1e-4

# Tiny pipelines whose sequence is shorter than 3 tokens: 3 ranks must be refused with a clear error instead.
TOO_SHORT_FOR_3 = {("wan", "wan2.2-ti2v")}

CASES = [
    (adapter.family, tiny.name)
    for adapter in all_adapters()
    if adapter.cp_plan is not None
    for tiny in adapter.tiny_pipelines
]


@functools.lru_cache(maxsize=4)
def _built(family: str, variant: str) -> tuple[Any, Any]:
    return build_tiny(family, variant)


def _run(rank: int, world_size: int, family: str, variant: str, parallel: dict[str, int] | None) -> np.ndarray:
    pipe, tiny = _built(family, variant)
    if parallel is None:
        return run_tiny(pipe, tiny)
    fastdit.accelerate(pipe, parallel=fastdit.Parallel(**parallel))
    try:
        return run_tiny(pipe, tiny)
    finally:
        fastdit.disable(pipe)


@pytest.mark.parametrize(
    "parallel", [{"ulysses": 2}, {"ring": 2}, {"ulysses": 3}], ids=["ulysses2", "ring2", "ulysses3-uneven"]
)
@pytest.mark.parametrize(("family", "variant"), CASES, ids=[f"{f}-{v}" for f, v in CASES])
def test_family_matches_single_process(
    dist2: WorkerPool, dist3: WorkerPool, family: str, variant: str, parallel: dict[str, int]
) -> None:
    pool = dist3 if fastdit.Parallel(**parallel).world_size == 3 else dist2
    if pool is dist3 and (family, variant) in TOO_SHORT_FOR_3:
        with pytest.raises(DistributedTestError) as info:
            pool.run(_run, family, variant, parallel, timeout=180)
        assert set(info.value.exc_types.values()) == {"ValueError"}
        return
    expected = _run(0, 1, family, variant, None)
    for out in pool.run(_run, family, variant, parallel, timeout=180):
        assert out.shape == expected.shape
        assert np.isfinite(out).all()
        assert np.abs(out - expected).max() < TOLERANCE, f"max abs error {np.abs(out - expected).max():.2e}"
