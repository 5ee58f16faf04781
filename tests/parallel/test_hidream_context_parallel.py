"""HiDream under context parallelism: where the plan splits, and step caching on top of it.

The plan splits inside every single-stream block (the inner block below the ``HiDreamBlock`` wrapper) and leaves the
double-stream blocks whole; the generic family test checks the outputs, these check the split really happens where
the plan says and that a cache hook on the wrappers (whole tensors on both sides) still matches one process.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest

import fastdit
from fastdit.testing.distributed import WorkerPool
from fastdit.testing.pipelines import build_tiny, run_tiny

pytestmark = pytest.mark.distributed


@functools.lru_cache(maxsize=1)
def _built() -> tuple[Any, Any]:
    return build_tiny("hidream", "hidream")


def _lengths(rank: int, world_size: int) -> dict[str, list[int]]:
    """Sequence lengths each block sees on this rank under Ulysses over all ranks (one denoising step)."""
    pipe, tiny = _built()
    transformer = pipe.transformer
    seen: dict[str, list[int]] = {"double": [], "single": [], "single_wrapper": [], "single_out": []}
    fastdit.accelerate(pipe, parallel=fastdit.Parallel(ulysses=world_size))
    # Registered after the plan's pre-hooks, so these see what the blocks compute on.
    handles = [
        transformer.double_stream_blocks[0].block.register_forward_pre_hook(
            lambda m, a, k: seen["double"].append(k["hidden_states"].shape[1]), with_kwargs=True
        ),
        transformer.single_stream_blocks[0].register_forward_pre_hook(
            lambda m, a, k: seen["single_wrapper"].append(k["hidden_states"].shape[1]), with_kwargs=True
        ),
        transformer.single_stream_blocks[0].block.register_forward_pre_hook(
            lambda m, a, k: seen["single"].append(k["hidden_states"].shape[1]), with_kwargs=True
        ),
        transformer.single_stream_blocks[0].register_forward_hook(
            lambda m, a, out: seen["single_out"].append(out.shape[1])
        ),
    ]
    try:
        run_tiny(pipe, tiny, num_inference_steps=1)
    finally:
        for handle in handles:
            handle.remove()
        fastdit.disable(pipe)
    return seen


def test_single_blocks_split_double_blocks_whole(dist2: WorkerPool) -> None:
    expected = _lengths(0, 1)
    joint = expected["single"][0]
    for rank, seen in enumerate(dist2.run(_lengths, timeout=180)):
        assert seen["double"] == expected["double"]  # image stream whole
        assert seen["single_wrapper"] == [joint]  # the wrapper (where a cache hooks) gets the whole stream...
        assert seen["single"] == [(joint + 1 - rank) // 2]  # ...its inner block a shard...
        assert seen["single_out"] == [joint]  # ...and the wrapper returns the gathered stream


def _cached(rank: int, world_size: int, parallel: dict[str, int] | None) -> np.ndarray:
    pipe, tiny = _built()
    # Step 0 computed, steps 1-2 replay the single-stream block in the middle.
    mask = fastdit.StepMask(compute_steps=(0,), policy="static")
    cache = fastdit.DBCache(fn=1, bn=1, warmup_steps=0, step_mask=mask)
    fastdit.accelerate(pipe, cache=cache, parallel=None if parallel is None else fastdit.Parallel(**parallel))
    try:
        out = run_tiny(pipe, tiny, num_inference_steps=3)
        assert fastdit.summary(pipe).num_cached_steps > 0
        return out
    finally:
        fastdit.disable(pipe)


@pytest.mark.parametrize("parallel", [{"ulysses": 2}, {"ring": 2}], ids=["ulysses2", "ring2"])
def test_cache_with_context_parallel_matches_single_process(dist2: WorkerPool, parallel: dict[str, int]) -> None:
    expected = _cached(0, 1, None)
    for out in dist2.run(_cached, parallel, timeout=180):
        assert np.abs(out - expected).max() < 1e-4, f"max abs error {np.abs(out - expected).max():.2e}"
