"""Ring attention on the gloo pool equals single-process attention over the whole sequence."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from fastdit.parallel.attention import ring
from fastdit.parallel.attention.ring import ring_attention
from fastdit.testing.distributed import DistributedTestError, WorkerPool

pytestmark = pytest.mark.distributed


@dataclass(frozen=True)
class Case:
    """A global attention problem, rebuilt identically in the parent and in every worker from its seed."""

    seq_lens: tuple[int, ...]
    batch: int = 2
    heads: int = 4
    kv_heads: int = 4
    head_dim: int = 8
    dtype: torch.dtype = torch.float32
    mask: str | None = None  # None, "padding" (keys only) or "rows" (per query row and head)
    pass_kv_lens: bool = False
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
            mask[0, ..., total - 3 :] = False  # the last tokens are padding in the first sample
            mask[1, ..., : total // 2] = False  # and the whole first half in the second: early chunks see nothing
        elif self.mask == "rows":
            keep = torch.rand(self.batch, self.heads, total, total, generator=gen) > 0.6
            keep[..., -1] = True  # SDPA gives nan for rows without keys
            mask = torch.zeros(keep.shape).masked_fill(~keep, float("-inf")) + 0.25 * torch.randn(
                keep.shape, generator=gen
            )
        return q, k, v, mask

    def shard(self, rank: int) -> slice:
        start = sum(self.seq_lens[:rank])
        return slice(start, start + self.seq_lens[rank])

    def expected(self) -> list[torch.Tensor]:
        q, k, v, mask = self.tensors()
        full = F.scaled_dot_product_attention(
            q.float().transpose(1, 2),
            k.float().transpose(1, 2),
            v.float().transpose(1, 2),
            attn_mask=mask,
            enable_gqa=self.kv_heads != self.heads,
        ).transpose(1, 2)
        return [full[:, self.shard(rank)] for rank in range(len(self.seq_lens))]


def _rank_inputs(case: Case, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    q, k, v, mask = case.tensors()
    rows = case.shard(rank)
    if mask is not None and mask.size(-2) > 1:
        mask = mask[..., rows, :]  # this rank's query rows over all keys
    return q[:, rows].contiguous(), k[:, rows].contiguous(), v[:, rows].contiguous(), mask


# --- worker functions (module level: workers import them by module path) ---


def _run_ring(rank: int, world_size: int, case: Case) -> torch.Tensor:
    assert world_size == len(case.seq_lens)
    q, k, v, mask = _rank_inputs(case, rank)
    kv_lens = list(case.seq_lens) if case.pass_kv_lens else None
    return ring_attention(q, k, v, group=dist.group.WORLD, attn_mask=mask, kv_lens=kv_lens)


def _naive_merge_(acc, acc_lse, out, lse) -> None:
    """A wrong merge: averages the partials, ignoring how much softmax mass (LSE) each one carries."""
    acc.add_(out).mul_(0.5)


def _naive_merge(out_a, lse_a, out_b, lse_b) -> tuple[torch.Tensor, torch.Tensor]:
    return (out_a.float() + out_b.float()) * 0.5, torch.maximum(lse_a, lse_b)


def _run_ring_with_broken_merge(rank: int, world_size: int, case: Case) -> torch.Tensor:
    originals = ring.merge_partials, ring.merge_partials_
    ring.merge_partials, ring.merge_partials_ = _naive_merge, _naive_merge_
    try:
        return _run_ring(rank, world_size, case)
    finally:
        ring.merge_partials, ring.merge_partials_ = originals


# --- tests ---


def _max_errors(outputs: list[torch.Tensor], case: Case) -> list[float]:
    errors = []
    for out, expected in zip(outputs, case.expected(), strict=True):
        assert out.shape == expected.shape and out.dtype == case.dtype
        errors.append((out.float() - expected).abs().max().item() if out.numel() else 0.0)
    return errors


def _assert_matches(pool: WorkerPool, case: Case, atol: float = 1e-5) -> None:
    errors = _max_errors(pool.run(_run_ring, case), case)
    assert max(errors) < atol, errors


def test_even_shards_two_ranks(dist2: WorkerPool) -> None:
    _assert_matches(dist2, Case(seq_lens=(6, 6)))


def test_uneven_shards_three_ranks(dist3: WorkerPool) -> None:
    _assert_matches(dist3, Case(seq_lens=(7, 5, 4), seed=1))


def test_uneven_shards_four_ranks(dist4: WorkerPool) -> None:
    _assert_matches(dist4, Case(seq_lens=(3, 8, 1, 5), seed=2))


def test_empty_shard(dist3: WorkerPool) -> None:
    _assert_matches(dist3, Case(seq_lens=(7, 0, 4), seed=3))


def test_known_kv_lens_skip_the_exchange(dist3: WorkerPool) -> None:
    _assert_matches(dist3, Case(seq_lens=(7, 5, 4), pass_kv_lens=True, seed=4))


def test_padding_mask(dist3: WorkerPool) -> None:
    _assert_matches(dist3, Case(seq_lens=(7, 5, 4), mask="padding", seed=5))


def test_per_row_additive_mask(dist4: WorkerPool) -> None:
    _assert_matches(dist4, Case(seq_lens=(4, 6, 3, 5), mask="rows", seed=6))


def test_grouped_query_attention(dist3: WorkerPool) -> None:
    _assert_matches(dist3, Case(seq_lens=(7, 5, 4), heads=6, kv_heads=2, seed=7))


def test_bfloat16(dist2: WorkerPool) -> None:
    _assert_matches(dist2, Case(seq_lens=(9, 7), dtype=torch.bfloat16, seed=8), atol=2e-2)


def test_a_broken_merge_is_caught(dist3: WorkerPool) -> None:
    case = Case(seq_lens=(7, 5, 4), seed=9)
    errors = _max_errors(dist3.run(_run_ring_with_broken_merge, case), case)
    assert max(errors) > 1e-2, errors
    _assert_matches(dist3, case)  # the real merge is back afterwards


def test_mask_with_wrong_key_length_raises_on_every_rank(dist2: WorkerPool) -> None:
    case = Case(seq_lens=(4, 4), seed=10)
    with pytest.raises(DistributedTestError) as info:
        dist2.run(_run_ring_bad_mask, case)
    assert info.value.exc_types == {0: "ValueError", 1: "ValueError"}
    assert "global K/V length 8" in info.value.failures[0].message


def _run_ring_bad_mask(rank: int, world_size: int, case: Case) -> torch.Tensor:
    q, k, v, _ = _rank_inputs(case, rank)
    mask = torch.ones(1, 1, 1, 5, dtype=torch.bool)  # 5 keys, but the sequence has 8
    return ring_attention(q, k, v, group=dist.group.WORLD, attn_mask=mask)


def test_single_process_is_local_attention() -> None:
    case = Case(seq_lens=(10,), mask="padding", seed=11)
    q, k, v, mask = case.tensors()
    out = ring_attention(q, k, v, group=None, attn_mask=mask)
    assert (out - case.expected()[0]).abs().max().item() < 1e-5
