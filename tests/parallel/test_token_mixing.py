"""Token mixing other than softmax attention under a sequence split, on toy modules over gloo ranks.

A 3 x 3 convolution over a grid split by rows needs one halo row from each neighbour; linear attention needs its
sum over the tokens all-reduced. Each check also runs without the fix, which must be measurably wrong.
"""

from __future__ import annotations

import pytest
import torch

from fastdit.parallel.attention.comm import shard_sizes
from fastdit.parallel.plan import Halo, TokenSum
from fastdit.parallel.token_mixing import install_halos, install_token_sums
from fastdit.testing.distributed import WorkerPool

pytestmark = pytest.mark.distributed


def _rows(x: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    sizes = shard_sizes(x.shape[dim], world_size)
    return x.narrow(dim, sum(sizes[:rank]), sizes[rank])


def _halo_error(rank: int, world_size: int, with_halo: bool) -> float:
    torch.manual_seed(0)
    root = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1))
    x = torch.randn(2, 3, 7, 5)  # 7 rows: uneven over 2 and 3 ranks
    with torch.no_grad():
        expected = _rows(root(x), 2, rank, world_size)
        undo = install_halos(root, {"0": Halo(dim=2)}, None) if with_halo else (lambda: None)
        try:
            local = root(_rows(x, 2, rank, world_size))
        finally:
            undo()
    return float((local - expected).abs().max())


class _LinearAttention(torch.nn.Module):
    """Keys and values meet in one sum over the tokens (``v^T k``) before the local queries."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kv = torch.matmul(v.transpose(-1, -2), torch.relu(k))
        return torch.matmul(torch.relu(q), kv.transpose(-1, -2))


def _linear_error(rank: int, world_size: int, with_sums: bool) -> float:
    torch.manual_seed(1)
    root = torch.nn.ModuleDict({"attn": _LinearAttention()})
    attend = root["attn"]
    q, k, v = (torch.randn(2, 9, 4) for _ in range(3))
    expected = _rows(attend(q, k, v), 1, rank, world_size)
    sums = {"attn": (TokenSum(torch.matmul, 0),)}
    undo = install_token_sums(root, sums, None) if with_sums else (lambda: None)
    try:
        local = attend(*(_rows(t, 1, rank, world_size) for t in (q, k, v)))
    finally:
        undo()
    return float((local - expected).abs().max())


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("check", [_halo_error, _linear_error], ids=["halo", "token-sum"])
def test_split_matches_whole_and_fails_without_the_fix(dist2: WorkerPool, dist3: WorkerPool, size: int, check) -> None:
    pool = dist2 if size == 2 else dist3
    assert max(pool.run(check, True, timeout=60)) < 1e-5
    assert max(pool.run(check, False, timeout=60)) > 1e-3
