"""HunyuanVideo 1.0 under context parallelism: the family's plan (``CP_PLAN``) against single-process output.

The plan is not the adapter's ``cp_plan`` (the same transformer class serves token_replace I2V, which the plan
vocabulary cannot express, see the family file), so ``accelerate`` refuses the family and these tests pass the plan
through ``accelerate(adapter=...)``. A test also checks that the plan alone is wrong for token_replace, and that a
per-rank first-frame token count (what the engine would need to provide) makes it exact.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

import fastdit
from fastdit.models.hunyuan_video import ADAPTER, CP_PLAN
from fastdit.testing.distributed import WorkerPool
from fastdit.testing.pipelines import build_tiny, run_tiny

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-4  # float32 on CPU; outputs in [0, 1]
PLANNED = dataclasses.replace(ADAPTER, cp_plan=CP_PLAN)
PARALLEL = [{"ulysses": 2}, {"ring": 2}, {"ulysses": 3}]
PARALLEL_IDS = ["ulysses2", "ring2", "ulysses3-uneven"]


@functools.lru_cache(maxsize=2)
def _built(variant: str) -> tuple[Any, Any]:
    return build_tiny("hunyuan_video", variant)


def _local_first_frame_count(transformer: torch.nn.Module) -> list[Any]:
    """Pre-hooks giving each token_replace block this rank's share of the first frame's tokens.

    forward passes ``first_frame_num_tokens`` (global) as the blocks' 7th positional argument; rank r holds the
    contiguous video tokens [start, start + length), so its count is ``clamp(n - start, 0, length)``. Reads the split
    record of the current forward from the processors' context-parallel attention (test-only: a prototype of the
    per-rank count the plan vocabulary lacks).
    """
    blocks = [*transformer.transformer_blocks, *transformer.single_transformer_blocks]
    marker = blocks[0].attn.processor._parallel_config
    rank = dist.get_rank(marker.cp_group)

    def pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        lens = marker.forward.splits["hidden_states"]
        start = sum(lens[:rank])
        args = list(args)
        args[6] = min(max(args[6] - start, 0), lens[rank])
        return tuple(args), kwargs

    return [block.register_forward_pre_hook(pre_hook, with_kwargs=True) for block in blocks]


def _run(rank: int, world_size: int, variant: str, parallel: dict[str, int] | None, count_hooks: bool) -> np.ndarray:
    pipe, tiny = _built(variant)
    if parallel is None:
        return run_tiny(pipe, tiny)
    fastdit.accelerate(pipe, parallel=fastdit.Parallel(**parallel), adapter=PLANNED)
    handles = _local_first_frame_count(pipe.transformer) if count_hooks else []
    try:
        return run_tiny(pipe, tiny)
    finally:
        for handle in handles:
            handle.remove()
        fastdit.disable(pipe)


def _pool(dist2: WorkerPool, dist3: WorkerPool, parallel: dict[str, int]) -> WorkerPool:
    return dist3 if fastdit.Parallel(**parallel).world_size == 3 else dist2


@pytest.mark.parametrize("parallel", PARALLEL, ids=PARALLEL_IDS)
@pytest.mark.parametrize("variant", ["t2v", "i2v", "skyreels-v1-i2v"])
def test_plan_matches_single_process(
    dist2: WorkerPool, dist3: WorkerPool, variant: str, parallel: dict[str, int]
) -> None:
    expected = _run(0, 1, variant, None, False)
    for out in _pool(dist2, dist3, parallel).run(_run, variant, parallel, False, timeout=180):
        assert out.shape == expected.shape
        assert np.isfinite(out).all()
        assert np.abs(out - expected).max() < TOLERANCE, f"max abs error {np.abs(out - expected).max():.2e}"


@pytest.mark.parametrize("parallel", PARALLEL, ids=PARALLEL_IDS)
def test_token_replace_needs_a_per_rank_first_frame_count(
    dist2: WorkerPool, dist3: WorkerPool, parallel: dict[str, int]
) -> None:
    expected = _run(0, 1, "i2v-token-replace", None, False)
    pool = _pool(dist2, dist3, parallel)
    plain = pool.run(_run, "i2v-token-replace", parallel, False, timeout=180)
    assert max(np.abs(out - expected).max() for out in plain) > 1e-3  # why the plan is not attached
    for out in pool.run(_run, "i2v-token-replace", parallel, True, timeout=180):
        assert np.abs(out - expected).max() < TOLERANCE, f"max abs error {np.abs(out - expected).max():.2e}"


def test_accelerate_refuses_context_parallel() -> None:
    pipe, _ = _built("t2v")
    with pytest.raises(ValueError, match="no context-parallel plan"):
        fastdit.accelerate(pipe, parallel=fastdit.Parallel(ulysses=2))
    assert getattr(pipe, "_fastdit_state", None) is None  # nothing was applied
