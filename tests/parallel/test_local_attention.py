"""Attention modules a plan keeps local: unmarked processors run ordinary attention on what they receive.

SkyReels-V2's cross-attention (``blocks.*.attn2``) routes through ``dispatch_attention_fn`` with its parallel config.
Its plan lists it as local, so it attends from the rank's image tokens to the rank's whole copy of the text; without
``local`` it runs context-parallel over the replicated text (every copy exchanged). Both must equal the
single-process output, and only the processors outside ``local`` may be marked.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np
import pytest
import torch

from fastdit.testing.distributed import WorkerPool

pytestmark = pytest.mark.distributed

VARIANT = "t2v"


@functools.lru_cache(maxsize=1)
def _pipeline() -> Any:
    from fastdit.models.skyreels_v2 import ADAPTER

    pipe = ADAPTER.tiny(VARIANT).build()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _adapter(local: tuple[str, ...]) -> Any:
    from fastdit.models.skyreels_v2 import ADAPTER

    routing = dataclasses.replace(ADAPTER.cp_plan.attention, local=local)
    return dataclasses.replace(ADAPTER, cp_plan=dataclasses.replace(ADAPTER.cp_plan, attention=routing))


def _run(
    rank: int, world_size: int, parallel: dict[str, int] | None, local: tuple[str, ...] = ()
) -> tuple[np.ndarray, dict[str, bool]]:
    from fastdit.config import Parallel
    from fastdit.models.skyreels_v2 import ADAPTER
    from fastdit.parallel.attention.dispatch import attention_processors
    from fastdit.parallel.context_parallel import apply_context_parallel
    from fastdit.parallel.runtime import ParallelRuntime

    pipe = _pipeline()
    kwargs = {**ADAPTER.tiny(VARIANT).call_kwargs, "generator": torch.Generator().manual_seed(0), "output_type": "np"}
    if parallel is None:
        return np.asarray(pipe(**kwargs).frames), {}
    config = Parallel(**parallel)
    runtime = ParallelRuntime.from_config(config)
    undo = apply_context_parallel(pipe.transformer, _adapter(local).cp_plan, config, runtime)
    try:
        marked = {n: "_parallel_config" in vars(p) for n, p in attention_processors(pipe.transformer).items()}
        return np.asarray(pipe(**kwargs).frames), marked
    finally:
        undo()


@pytest.mark.parametrize("local", [("blocks.*.attn2",), ()], ids=["local", "context-parallel"])
@pytest.mark.parametrize("parallel", [{"ulysses": 2}, {"ring": 2}], ids=["ulysses2", "ring2"])
def test_cross_attention_local_or_not_matches_single_process(
    dist2: WorkerPool, parallel: dict[str, int], local: tuple[str, ...]
) -> None:
    from fastdit.models.skyreels_v2 import CP_PLAN

    assert CP_PLAN.attention.local == ("blocks.*.attn2",)
    expected, _ = _run(0, 1, None)
    for frames, marked in dist2.run(_run, parallel, local, timeout=180):
        assert marked and all(marked[n] == (n.endswith(".attn1") or not local) for n in marked), marked
        assert np.abs(frames - expected).max() < 1e-4
