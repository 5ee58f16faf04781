"""Ulysses attention equals full attention: uneven shards and heads, GQA, masks reordered to the shards' order."""

from __future__ import annotations

import pytest
import torch

from fastdit.parallel.attention.ulysses import SeqLayout, sdpa_bshd, ulysses_attention
from fastdit.testing.distributed import DistributedTestError, WorkerPool

pytestmark = pytest.mark.distributed


def _qkv(total: int, heads: int, kv_heads: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, total, heads, 8, generator=g)
    k = torch.randn(2, total, kv_heads, 8, generator=g)
    v = torch.randn(2, total, kv_heads, 8, generator=g)
    return q, k, v


def _local_index(layout: SeqLayout, rank: int) -> list[int]:
    """Global positions of the tokens rank ``rank`` holds, in its local order (segment by segment)."""
    index = layout.global_index(torch.device("cpu")).tolist()
    start = sum(layout.rank_lens[:rank])
    return index[start : start + layout.rank_lens[rank]]


def _text_padding_mask(txt: int, img: int, num_padding: int) -> torch.Tensor:
    """Key padding over the global [text, image] order: the last ``num_padding`` text tokens are padding."""
    mask = torch.ones(2, txt + img, dtype=torch.bool)
    mask[:, txt - num_padding : txt] = False
    return mask


# --- worker functions ---


def _compare(
    rank: int, world_size: int, txt: int, img: int, heads: int, kv_heads: int, mode: str, chunks: int = 1
) -> float:
    """Max |ulysses - full| for this rank's tokens; the sequence is [text, image], each split over the ranks."""
    q, k, v = _qkv(txt + img, heads, kv_heads)
    layout = SeqLayout.split([txt, img], world_size)
    mine = _local_index(layout, rank)
    mask, given, use_layout, fp8 = None, None, True, False
    if mode in ("global_mask", "misaligned_mask", "local_mask", "fp8_mask"):
        mask = _text_padding_mask(txt, img, num_padding=txt // 2)
        given = mask[:, mine] if mode == "local_mask" else mask
        use_layout = mode != "misaligned_mask"
        fp8 = mode == "fp8_mask"
    elif mode == "head_mask":  # per-head, per-query mask over the global sequence
        g = torch.Generator().manual_seed(1)
        mask = torch.rand(2, heads, txt + img, txt + img, generator=g) > 0.3
        mask[..., 0] = True
        given = mask
    expected = sdpa_bshd(q, k, v, None if mask is None else _as_4d(mask))[:, mine]
    out = ulysses_attention(
        q[:, mine].contiguous(),
        k[:, mine].contiguous(),
        v[:, mine].contiguous(),
        group=None,
        attn_mask=given,
        layout=layout if use_layout else None,
        q_lens=layout.rank_lens if mode != "exchange" else None,
        kv_lens=layout.rank_lens if mode != "exchange" else None,
        fp8=fp8,
        chunks=chunks,
    )
    assert out.shape == expected.shape
    return (out - expected).abs().max().item()


def _as_4d(mask: torch.Tensor) -> torch.Tensor:
    return mask[:, None, None, :] if mask.ndim == 2 else mask


def _bad_mask(rank: int, world_size: int) -> None:
    q, k, v = _qkv(8, 2, 2)
    shard = [t[:, rank * 4 : rank * 4 + 4].contiguous() for t in (q, k, v)]
    ulysses_attention(*shard, group=None, attn_mask=torch.ones(2, 1, 1, 5, dtype=torch.bool))


# --- tests ---


def test_seq_layout() -> None:
    layout = SeqLayout.split([3, 5], 2)  # text 3 -> [2, 1], image 5 -> [3, 2]
    assert layout.lens == ((2, 3), (1, 2))
    assert layout.rank_lens == [5, 3]
    assert not layout.is_contiguous
    # Post-exchange order: rank 0's text (0, 1), its image (3, 4, 5), rank 1's text (2), its image (6, 7).
    assert layout.global_index(torch.device("cpu")).tolist() == [0, 1, 3, 4, 5, 2, 6, 7]
    assert SeqLayout.split([7], 3).is_contiguous
    assert SeqLayout.split([0, 7], 3).is_contiguous


@pytest.mark.parametrize(
    ("world", "txt", "img", "heads", "kv_heads", "mode"),
    [
        (2, 8, 24, 4, 4, "plain"),  # even shards and heads
        (3, 5, 16, 5, 5, "plain"),  # uneven shards [2,2,1]+[6,5,5] and 5 heads padded to 6
        (3, 5, 16, 5, 5, "exchange"),  # lengths exchanged instead of passed in
        (2, 8, 24, 4, 2, "plain"),  # GQA: 4 query heads on 2 K/V heads, both divide the degree
        (3, 6, 15, 4, 2, "plain"),  # GQA that does not divide the degree: K/V repeated first
    ],
)
def test_matches_full_attention(
    dist2: WorkerPool, dist3: WorkerPool, world: int, txt: int, img: int, heads: int, kv_heads: int, mode: str
) -> None:
    pool = dist2 if world == 2 else dist3
    for err in pool.run(_compare, txt, img, heads, kv_heads, mode):
        assert err < 1e-5


@pytest.mark.parametrize("world", [2, 3])
def test_global_mask_is_reordered(dist2: WorkerPool, dist3: WorkerPool, world: int) -> None:
    pool = dist2 if world == 2 else dist3
    for err in pool.run(_compare, 8, 24, 4, 4, "global_mask"):
        assert err < 1e-5


@pytest.mark.parametrize("world", [2, 3])
def test_misaligned_mask_corrupts(dist2: WorkerPool, dist3: WorkerPool, world: int) -> None:
    """Without the layout the text-padding columns land on the wrong tokens: the output is visibly wrong."""
    pool = dist2 if world == 2 else dist3
    errors = pool.run(_compare, 8, 24, 4, 4, "misaligned_mask")
    assert max(errors) > 0.1


def test_local_key_padding_mask_is_gathered(dist3: WorkerPool) -> None:
    for err in dist3.run(_compare, 7, 17, 4, 4, "local_mask"):
        assert err < 1e-5


def test_per_head_mask_with_padded_heads(dist3: WorkerPool) -> None:
    for err in dist3.run(_compare, 4, 11, 5, 5, "head_mask"):
        assert err < 1e-5


def test_fp8_exchange_is_close(dist2: WorkerPool) -> None:
    for err in dist2.run(_compare, 8, 24, 4, 4, "fp8_mask"):
        assert 0 < err < 0.25


@pytest.mark.parametrize(
    ("world", "txt", "img", "heads", "kv_heads", "mode", "chunks"),
    [
        (2, 8, 24, 8, 8, "plain", 2),  # 8 heads: 2 chunks of 4, 2 heads per rank each
        (2, 8, 24, 8, 8, "global_mask", 4),  # 4 chunks; the reordered text-padding mask reaches every chunk
        (3, 4, 11, 5, 5, "head_mask", 2),  # 5 heads padded to 6: 2 chunks of 3, per-head mask rows per chunk
        (2, 8, 24, 8, 4, "plain", 2),  # GQA: 8 query heads on 4 K/V heads, chunked alike
        (2, 8, 24, 8, 2, "plain", 2),  # 2 K/V heads do not split into 2 x 2: one chunk
        (2, 8, 24, 4, 4, "fp8_mask", 2),
    ],
)
def test_head_chunks_pipeline_matches_full_attention(
    dist2: WorkerPool,
    dist3: WorkerPool,
    world: int,
    txt: int,
    img: int,
    heads: int,
    kv_heads: int,
    mode: str,
    chunks: int,
) -> None:
    pool = dist2 if world == 2 else dist3
    for err in pool.run(_compare, txt, img, heads, kv_heads, mode, chunks):
        assert err < (0.25 if mode == "fp8_mask" else 1e-5)


def test_mask_of_wrong_length_raises(dist2: WorkerPool) -> None:
    with pytest.raises(DistributedTestError) as info:
        dist2.run(_bad_mask)
    assert set(info.value.exc_types.values()) == {"ValueError"}
