"""Ulysses all-to-alls: sequence <-> head sharding for several tensors at once, uneven shards, async, FP8."""

from __future__ import annotations

import pytest
import torch

from fastdit.parallel.attention.comm import (
    FP8_MAX,
    gather_lengths,
    head_to_seq,
    head_to_seq_async,
    pad_heads,
    seq_to_head,
    seq_to_head_async,
    shard_sizes,
)
from fastdit.testing.distributed import WorkerPool

# (batch, heads, head dim) of the tensors exchanged together: q-like, grouped k-like, and one with its own head dim.
SHAPES = ((2, 12, 4), (2, 6, 4), (1, 6, 5))


def _full(index: int, total: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    batch, heads, dim = SHAPES[index]
    g = torch.Generator().manual_seed(index)
    return torch.randn(batch, total, heads, dim, generator=g).to(dtype)


def _shard(x: torch.Tensor, lens: list[int], rank: int) -> torch.Tensor:
    return x[:, sum(lens[:rank]) : sum(lens[: rank + 1])].contiguous()


# --- worker functions ---


def _round_trip(rank: int, world_size: int, totals: list[int], use_async: bool) -> list[tuple[float, float]]:
    lens = [shard_sizes(n, world_size) for n in totals]
    fulls = [_full(i, n) for i, n in enumerate(totals)]
    shards = [_shard(x, lens[i], rank) for i, x in enumerate(fulls)]
    if use_async:
        pending = seq_to_head_async(shards, None, seq_lens=lens)
        busy = torch.randn(32, 32) @ torch.randn(32, 32)  # work while the exchange is in flight
        heads = pending.wait()
        assert pending.wait() is heads and busy.isfinite().all()  # wait is idempotent
    else:
        heads = seq_to_head(shards, None, seq_lens=lens)
    errors = []
    for i, (x, h) in enumerate(zip(fulls, heads, strict=True)):
        per_rank = x.shape[2] // world_size
        expected = x[:, :, rank * per_rank : (rank + 1) * per_rank]
        forward_err = (h - expected).abs().max().item() if h.shape == expected.shape else float("inf")
        back = (head_to_seq_async if use_async else head_to_seq)(h, None, seq_lens=lens[i])
        back = back.wait() if use_async else back
        errors.append((forward_err, (back - shards[i]).abs().max().item()))
    return errors


def _fp8(rank: int, world_size: int, total: int, dtype: torch.dtype) -> tuple[float, float, float]:
    lens = shard_sizes(total, world_size)
    x = _full(0, total, dtype) * 10
    shard = _shard(x, lens, rank)
    (h,) = seq_to_head([shard], None, seq_lens=[lens], fp8=True)
    per_rank = x.shape[2] // world_size
    expected = x[:, :, rank * per_rank : (rank + 1) * per_rank]
    back = head_to_seq(h, None, seq_lens=lens, fp8=True)
    amax = x.abs().amax().float().item()
    return (h - expected).abs().max().float().item() / amax, (back - shard).abs().max().float().item() / amax, h.dtype


def _lengths(rank: int, world_size: int) -> list[list[int]]:
    return gather_lengths([rank, 10 * rank + 1], None, torch.device("cpu"))


def _wrong_lengths(rank: int, world_size: int) -> None:
    seq_to_head([torch.zeros(1, 3, 2, 2)], None, seq_lens=[[2] * world_size])


# --- tests ---


def test_shard_sizes() -> None:
    assert shard_sizes(8, 2) == [4, 4]
    assert shard_sizes(10, 3) == [4, 3, 3]
    assert shard_sizes(2, 3) == [1, 1, 0]
    assert sum(shard_sizes(4097, 7)) == 4097


def test_pad_heads() -> None:
    x = torch.randn(1, 3, 5, 2)
    assert pad_heads(x, 5) is x
    padded = pad_heads(x, 2)
    assert padded.shape == (1, 3, 6, 2)
    assert torch.equal(padded[:, :, :5], x) and not padded[:, :, 5:].any()


@pytest.mark.distributed
@pytest.mark.parametrize("use_async", [False, True])
def test_round_trip_even(dist2: WorkerPool, use_async: bool) -> None:
    totals = [8, 8, 8]  # q, k, v-like tensors of one length: one collective for the three
    for errors in dist2.run(_round_trip, totals, use_async):
        assert errors == [(0.0, 0.0)] * 3


@pytest.mark.distributed
@pytest.mark.parametrize("use_async", [False, True])
def test_round_trip_uneven_lengths_mixed_shapes(dist3: WorkerPool, use_async: bool) -> None:
    # Lengths 10 / 7 / 5 split [4,3,3] / [3,2,2] / [2,2,1]; heads 12 / 6 / 6; head dims 4 / 4 / 5.
    for errors in dist3.run(_round_trip, [10, 7, 5], use_async):
        assert errors == [(0.0, 0.0)] * 3


@pytest.mark.distributed
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_transport(dist2: WorkerPool, dtype: torch.dtype) -> None:
    for forward_err, back_err, out_dtype in dist2.run(_fp8, 9, dtype):
        assert out_dtype == dtype
        # e4m3 keeps 3 mantissa bits: relative rounding error <= 2^-4 of the tensor's scale; two trips for `back`.
        assert 0 < forward_err <= 2**-4
        assert back_err <= 2 * 2**-4
    assert FP8_MAX == 448.0


@pytest.mark.distributed
def test_gather_lengths(dist3: WorkerPool) -> None:
    assert dist3.run(_lengths) == [[[0, 1], [1, 11], [2, 21]]] * 3


@pytest.mark.distributed
def test_declared_lengths_are_checked(dist2: WorkerPool) -> None:
    from fastdit.testing.distributed import DistributedTestError

    with pytest.raises(DistributedTestError) as info:
        dist2.run(_wrong_lengths)
    assert set(info.value.exc_types.values()) == {"ValueError"}
