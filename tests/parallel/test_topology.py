"""Which node each rank is on, which mesh dims cross nodes, and the layout suggested when a chatty one does."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from fastdit.config import Parallel
from fastdit.errors import FastditWarning
from fastdit.parallel.runtime import MESH_DIMS, ParallelRuntime
from fastdit.parallel.topology import _spanning, better_layout
from fastdit.testing.distributed import WorkerPool

pytestmark = pytest.mark.distributed


def _mesh(parallel: Parallel) -> torch.Tensor:
    return torch.arange(parallel.world_size).reshape([getattr(parallel, d) for d in MESH_DIMS])


@pytest.mark.parametrize(
    ("parallel", "nodes", "spanning"),
    [
        (Parallel(ulysses=2, ring=2), (0, 0, 1, 1), ("ring",)),
        (Parallel(ulysses=4), (0, 0, 1, 1), ("ulysses",)),
        (Parallel(cfg=2, tp=2), (0, 0, 1, 1), ("cfg",)),
        (Parallel(ulysses=2, tp=2), (0, 0, 1, 1), ("ulysses",)),
        (Parallel(ulysses=4), (0, 0, 0, 0), ()),
    ],
)
def test_dims_spanning_nodes(parallel: Parallel, nodes: tuple[int, ...], spanning: tuple[str, ...]) -> None:
    assert _spanning(_mesh(parallel), MESH_DIMS, nodes) == spanning


@pytest.mark.parametrize(
    ("parallel", "per_node", "better"),
    [
        (Parallel(ulysses=4), 2, Parallel(ulysses=2, ring=2)),
        (Parallel(ulysses=8), 4, Parallel(ulysses=4, ring=2)),
        (Parallel(ulysses=4, tp=2), 4, Parallel(ulysses=2, ring=2, tp=2)),
        (Parallel(ulysses=2, ring=2), 2, None),  # already inside a node
        (Parallel(tp=4), 2, None),  # TP alone is wider than a node: nothing on the same ranks fits
        (Parallel(ulysses=6), 4, Parallel(ulysses=3, ring=2)),  # the largest divisor of 6 that fits in a node
    ],
)
def test_better_layout(parallel: Parallel, per_node: int, better: Parallel | None) -> None:
    assert better_layout(parallel, per_node) == better


def _topology(rank: int, world_size: int, degrees: dict[str, int]) -> tuple[dict, list[str]]:
    os.environ["GROUP_RANK"] = str(rank // 2)  # two "nodes" of two ranks, as two torchrun launches would give
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runtime = ParallelRuntime.from_config(Parallel(**degrees), "cpu")
        return runtime.topology.to_dict(), [str(w.message) for w in caught if w.category is FastditWarning]
    finally:
        del os.environ["GROUP_RANK"]


def test_a_chatty_dim_across_nodes_warns_with_the_better_layout(dist4: WorkerPool) -> None:
    results = dist4.run(_topology, {"ulysses": 4}, timeout=60)
    for rank, (topology, messages) in enumerate(results):
        assert topology == {"nodes": 2, "ranks_per_node": 2, "dims_across_nodes": ("ulysses",)}
        if rank == 0:
            assert len(messages) == 1 and "Parallel(ring=2, ulysses=2) keeps them inside a node" in messages[0]
        else:
            assert messages == []  # rank 0 alone warns
    for topology, messages in dist4.run(_topology, {"ulysses": 2, "ring": 2}, timeout=60):
        assert topology["dims_across_nodes"] == ("ring",) and messages == []
