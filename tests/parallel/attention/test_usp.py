"""USP (Ulysses × ring) on a 2 × 2 grid of gloo ranks equals single-process attention."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fastdit.parallel.attention.usp import usp_attention, usp_shard_index
from fastdit.testing.distributed import DistributedTestError, WorkerPool

pytestmark = pytest.mark.distributed

RING_OUTER = ("ring", "ulysses")
ULYSSES_OUTER = ("ulysses", "ring")


@dataclass(frozen=True)
class Case:
    """A global attention problem, rebuilt identically in the parent and in every worker from its seed."""

    seq_lens: tuple[int, ...]  # per shard, in shard order
    dims: tuple[str, str] = RING_OUTER
    mesh_shape: tuple[int, int] = (2, 2)
    batch: int = 2
    heads: int = 4
    kv_heads: int = 4
    head_dim: int = 8
    dtype: torch.dtype = torch.float32
    # None, "padding" (keys only), "rows" (per query row and head) or "rows-1" (boolean, shared by the heads)
    mask: str | None = None
    pass_seq_lens: bool = False
    shard_by_global_rank: bool = False  # a deliberately wrong assignment of shards to ranks
    seed: int = 0

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        gen = torch.Generator().manual_seed(self.seed)
        total = sum(self.seq_lens)
        q = torch.randn(self.batch, total, self.heads, self.head_dim, generator=gen).to(self.dtype)
        k = torch.randn(self.batch, total, self.kv_heads, self.head_dim, generator=gen).to(self.dtype)
        v = torch.randn(self.batch, total, self.kv_heads, self.head_dim, generator=gen).to(self.dtype)
        mask = None
        if self.mask == "padding":
            mask = torch.ones(self.batch, 1, 1, total, dtype=torch.bool)
            mask[0, ..., total - 3 :] = False
            mask[1, ..., : total // 2] = False
        elif self.mask in ("rows", "rows-1"):
            mask_heads = self.heads if self.mask == "rows" else 1
            keep = torch.rand(self.batch, mask_heads, total, total, generator=gen) > 0.6
            keep[..., -1] = True  # SDPA gives nan for rows without keys
            mask = torch.zeros(keep.shape).masked_fill(~keep, float("-inf")) + 0.25 * torch.randn(
                keep.shape, generator=gen
            )
            if self.mask == "rows-1":
                mask = keep  # boolean masks travel as bytes
        return q, k, v, mask

    def shard(self, index: int) -> slice:
        start = sum(self.seq_lens[:index])
        return slice(start, start + self.seq_lens[index])

    def expected(self) -> torch.Tensor:
        q, k, v, mask = self.tensors()
        full = F.scaled_dot_product_attention(
            q.float().transpose(1, 2),
            k.float().transpose(1, 2),
            v.float().transpose(1, 2),
            attn_mask=mask,
            enable_gqa=self.kv_heads != self.heads,
        )
        return full.transpose(1, 2)


# --- worker functions (module level: workers import them by module path) ---

_MESHES: dict[tuple[tuple[int, int], tuple[str, str]], DeviceMesh] = {}


def _mesh(shape: tuple[int, int], dims: tuple[str, str]) -> DeviceMesh:
    # Building a mesh creates process groups collectively; reuse it across calls in this worker.
    if (shape, dims) not in _MESHES:
        _MESHES[shape, dims] = init_device_mesh("cpu", shape, mesh_dim_names=dims)
    return _MESHES[shape, dims]


def _run_usp(rank: int, world_size: int, case: Case) -> tuple[int, torch.Tensor]:
    mesh = _mesh(case.mesh_shape, case.dims)
    ulysses_group, ring_group = mesh.get_group("ulysses"), mesh.get_group("ring")
    index = rank if case.shard_by_global_rank else usp_shard_index(ulysses_group, ring_group)
    q, k, v, mask = case.tensors()
    rows = case.shard(index)
    if mask is not None and mask.size(-2) > 1:
        mask = mask[..., rows, :]
    out = usp_attention(
        q[:, rows].contiguous(),
        k[:, rows].contiguous(),
        v[:, rows].contiguous(),
        ulysses_group=ulysses_group,
        ring_group=ring_group,
        attn_mask=mask,
        seq_lens=list(case.seq_lens) if case.pass_seq_lens else None,
    )
    return index, out


def _shard_indices(rank: int, world_size: int, dims: tuple[str, str]) -> tuple[int, int, int]:
    mesh = _mesh((2, 2), dims)
    ulysses_group, ring_group = mesh.get_group("ulysses"), mesh.get_group("ring")
    return usp_shard_index(ulysses_group, ring_group), dist.get_rank(ring_group), dist.get_rank(ulysses_group)


# --- tests ---


def _errors(pool: WorkerPool, case: Case) -> list[float]:
    expected = case.expected()
    results = pool.run(_run_usp, case)
    assert sorted(index for index, _ in results) == list(range(len(case.seq_lens)))  # every shard exactly once
    errors = []
    for index, out in results:
        reference = expected[:, case.shard(index)]
        assert out.shape == reference.shape and out.dtype == case.dtype
        errors.append((out.float() - reference).abs().max().item())
    return errors


def _assert_matches(pool: WorkerPool, case: Case, atol: float = 1e-5) -> None:
    errors = _errors(pool, case)
    assert max(errors) < atol, errors


@pytest.mark.parametrize("dims", [RING_OUTER, ULYSSES_OUTER], ids=["ring-outer", "ulysses-outer"])
def test_shard_index_is_ring_major_whatever_the_mesh_order(dist4: WorkerPool, dims: tuple[str, str]) -> None:
    for index, ring_rank, ulysses_rank in dist4.run(_shard_indices, dims):
        assert index == 2 * ring_rank + ulysses_rank


@pytest.mark.parametrize("dims", [RING_OUTER, ULYSSES_OUTER], ids=["ring-outer", "ulysses-outer"])
def test_equals_full_attention(dist4: WorkerPool, dims: tuple[str, str]) -> None:
    _assert_matches(dist4, Case(seq_lens=(5, 5, 5, 5), dims=dims, seed=1))


@pytest.mark.parametrize("dims", [RING_OUTER, ULYSSES_OUTER], ids=["ring-outer", "ulysses-outer"])
def test_ring_blocks_may_differ_in_length(dist4: WorkerPool, dims: tuple[str, str]) -> None:
    _assert_matches(dist4, Case(seq_lens=(6, 6, 3, 3), dims=dims, seed=2))


@pytest.mark.parametrize("dims", [RING_OUTER, ULYSSES_OUTER], ids=["ring-outer", "ulysses-outer"])
@pytest.mark.parametrize("mask", ["padding", "rows", "rows-1"])
def test_masks_in_global_key_order(dist4: WorkerPool, dims: tuple[str, str], mask: str) -> None:
    _assert_matches(dist4, Case(seq_lens=(4, 4, 6, 6), dims=dims, mask=mask, seed=3))


def test_wrong_shard_order_is_detected_by_the_mask(dist4: WorkerPool) -> None:
    # With ulysses outermost, global rank 1 is ring rank 1 / ulysses rank 0, i.e. shard 2, not shard 1. Feeding it
    # shard 1 puts keys out of global order, which only a mask can notice.
    case = Case(seq_lens=(5, 5, 5, 5), dims=ULYSSES_OUTER, mask="padding", shard_by_global_rank=True, seed=4)
    assert max(_errors(dist4, case)) > 1e-2


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["kv-heads-divisible", "kv-heads-repeated"])
def test_grouped_query_attention(dist4: WorkerPool, kv_heads: int) -> None:
    _assert_matches(dist4, Case(seq_lens=(5, 5, 3, 3), kv_heads=kv_heads, seed=5))


def test_known_seq_lens_skip_the_exchange(dist4: WorkerPool) -> None:
    _assert_matches(dist4, Case(seq_lens=(6, 6, 3, 3), dims=ULYSSES_OUTER, pass_seq_lens=True, mask="rows", seed=6))


def test_bfloat16(dist4: WorkerPool) -> None:
    _assert_matches(dist4, Case(seq_lens=(8, 8, 8, 8), dtype=torch.bfloat16, seed=7), atol=2e-2)


@pytest.mark.parametrize("shape", [(1, 4), (4, 1)], ids=["ulysses-only", "ring-only"])
def test_degenerate_grids(dist4: WorkerPool, shape: tuple[int, int]) -> None:
    _assert_matches(dist4, Case(seq_lens=(3, 3, 3, 3) if shape == (1, 4) else (5, 2, 4, 3), mesh_shape=shape, seed=8))


def test_heads_not_divisible_raise_on_every_rank(dist4: WorkerPool) -> None:
    with pytest.raises(DistributedTestError) as info:
        dist4.run(_run_usp, Case(seq_lens=(4, 4, 4, 4), heads=3, kv_heads=3))
    assert info.value.exc_types == dict.fromkeys(range(4), "ValueError")
    assert "heads=3, ulysses_degree=2" in info.value.failures[0].message


def test_uneven_shards_inside_a_ulysses_group_raise_on_every_rank(dist4: WorkerPool) -> None:
    with pytest.raises(DistributedTestError) as info:
        dist4.run(_run_usp, Case(seq_lens=(4, 4, 5, 4)))
    assert info.value.exc_types == dict.fromkeys(range(4), "ValueError")
    assert "[(5, 5), (4, 4)]" in info.value.failures[0].message
