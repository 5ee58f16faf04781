# ruff: noqa: N803, N806 - shape suffixes (q_BSHD) name tensor layouts in attention code
"""Ulysses attention: all-to-all from sequence shards to head shards, local attention, and back.

Each rank holds ``S_local`` tokens of every head. One all-to-all (q, k and v together) gives each rank every token
of ``H / P`` heads; attention runs locally on those heads; the inverse all-to-all returns each rank its own tokens
with all heads. Heads that do not divide the degree are zero-padded; shards may differ in length.

**Masks are reordered, not split.** After the exchange a rank holds the ranks' shards concatenated in rank order.
When the model's sequence is one contiguous split that *is* the global order; when it concatenates several
separately split pieces (text then image, each split over ranks) the post-exchange order is
``[text_0, image_0, text_1, image_1, ...]`` while a mask built by the model indexes ``[text, image]``. A
:class:`SeqLayout` describes the pieces; the mask is indexed with the permutation it yields. A mask that is not
reordered lines up with the wrong tokens: attention looks fine away from the masked region and is corrupted where
the text tokens sit (the "top-left" of the attention matrix).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fastdit.parallel.attention.comm import (
    gather_lengths,
    head_to_seq_async,
    pad_heads,
    seq_to_head_async,
    shard_sizes,
)

__all__ = ["LocalAttention", "SeqLayout", "mask_in_shard_order", "sdpa_bshd", "ulysses_attention"]

# local(q_BSHD, k_BSHD, v_BSHD, attn_mask, scale) -> out_BSHD: attention on whole sequences of a subset of heads.
LocalAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, float | None], torch.Tensor]


def sdpa_bshd(
    q_BSHD: torch.Tensor,
    k_BSHD: torch.Tensor,
    v_BSHD: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` on ``(B, S, H, D)`` tensors (grouped K/V heads via ``enable_gqa``)."""
    gqa = k_BSHD.shape[2] != q_BSHD.shape[2]
    out_BHSD = F.scaled_dot_product_attention(
        q_BSHD.transpose(1, 2),
        k_BSHD.transpose(1, 2),
        v_BSHD.transpose(1, 2),
        attn_mask=attn_mask,
        scale=scale,
        enable_gqa=gqa,
    )
    return out_BHSD.transpose(1, 2)


@dataclass(frozen=True)
class SeqLayout:
    """Which tokens of a sequence each rank holds.

    The sequence is a concatenation of *segments* (e.g. text then image), each split over the ranks on its own.
    ``lens[r][s]`` is the number of tokens of segment ``s`` on rank ``r``; rank ``r``'s local sequence is its pieces
    of every segment in segment order, and the global order is segment by segment, ranks in order within each.

    Attributes:
        lens: Per rank, per segment token counts.
    """

    lens: tuple[tuple[int, ...], ...]

    @classmethod
    def split(cls, segment_lengths: Sequence[int], degree: int) -> SeqLayout:
        """The layout of segments of the given global lengths, each split with :func:`shard_sizes`."""
        per_segment = [shard_sizes(n, degree) for n in segment_lengths]
        return cls(tuple(tuple(sizes[r] for sizes in per_segment) for r in range(degree)))

    @property
    def rank_lens(self) -> list[int]:
        """Local sequence length of every rank."""
        return [sum(row) for row in self.lens]

    @property
    def is_contiguous(self) -> bool:
        """Whether the post-exchange order is already the global order (one segment, or all but one empty)."""
        return sum(1 for s in range(len(self.lens[0])) if any(row[s] for row in self.lens)) <= 1

    def global_index(self, device: torch.device) -> torch.Tensor:
        """For each post-exchange position (rank shards concatenated), the token's position in the global order."""
        return _global_index(self, str(device))


@functools.lru_cache(maxsize=64)
def _global_index(layout: SeqLayout, device: str) -> torch.Tensor:
    num_segments = len(layout.lens[0])
    totals = [sum(row[s] for row in layout.lens) for s in range(num_segments)]
    index = []
    for r, row in enumerate(layout.lens):
        for s, count in enumerate(row):
            start = sum(totals[:s]) + sum(layout.lens[q][s] for q in range(r))
            index.extend(range(start, start + count))
    return torch.tensor(index, dtype=torch.long, device=device)


def _align_kv_heads(q_BSHD: torch.Tensor, k_BSHD: torch.Tensor, v_BSHD: torch.Tensor, degree: int):
    """Repeat grouped K/V heads to the query head count when the grouping would not survive head sharding."""
    num_heads, num_kv = q_BSHD.shape[2], k_BSHD.shape[2]
    if num_kv == num_heads or (num_heads % degree == 0 and num_kv % degree == 0):
        return k_BSHD, v_BSHD
    if num_heads % num_kv:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv} key/value heads")
    group = num_heads // num_kv
    return k_BSHD.repeat_interleave(group, dim=2), v_BSHD.repeat_interleave(group, dim=2)


def ulysses_attention(
    q_BSHD: torch.Tensor,
    k_BSHD: torch.Tensor,
    v_BSHD: torch.Tensor,
    *,
    group: dist.ProcessGroup | None,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    local: LocalAttention = sdpa_bshd,
    q_lens: Sequence[int] | None = None,
    kv_lens: Sequence[int] | None = None,
    layout: SeqLayout | None = None,
    fp8: bool = False,
    chunks: int = 1,
) -> torch.Tensor:
    """Attention over a sequence sharded across ``group``, by head-sharding all-to-alls.

    Args:
        q_BSHD: This rank's query shard ``(B, S_q_local, H, D)``.
        k_BSHD: Key shard ``(B, S_kv_local, H_kv, D)`` (``H_kv`` divides ``H``).
        v_BSHD: Value shard, shaped like ``k_BSHD``.
        group: The Ulysses process group.
        attn_mask: Boolean or additive mask, broadcastable to ``(B, H, S_q, S_kv)`` over the *global* sequence (its
            key dim is the global length; a query dim of 1 broadcasts), or a key-padding mask over this rank's local
            keys (``(B, S_kv_local)`` or ``(B, 1, 1, S_kv_local)``), which is all-gathered.
        scale: Softmax scale (default ``1/sqrt(D)``).
        local: Attention on full sequences of the local heads.
        q_lens: Every rank's query shard length; ``None`` exchanges them (one small collective, with ``kv_lens``).
        kv_lens: Every rank's key/value shard length; ``None`` exchanges them.
        layout: How the global sequence is split into per-rank pieces (needed to reorder a global mask when the
            sequence concatenates separately split segments); ``None`` means one contiguous split.
        fp8: Send q/k/v and the output as float8 (lossy; halves bf16 traffic).
        chunks: Pipeline the heads in this many chunks: chunk ``i + 1``'s exchange is in flight while chunk ``i``'s
            attention runs, and chunk ``i``'s output travels back during chunk ``i + 1``'s attention. Used when the
            query and key/value heads split into ``chunks * degree`` equal groups; otherwise one chunk.

    Returns:
        This rank's output shard ``(B, S_q_local, H, D)``.
    """
    degree = dist.get_world_size(group)
    if degree == 1:
        return local(q_BSHD, k_BSHD, v_BSHD, attn_mask, scale)
    num_heads = q_BSHD.shape[2]
    k_BSHD, v_BSHD = _align_kv_heads(q_BSHD, k_BSHD, v_BSHD, degree)
    if q_lens is None or kv_lens is None:
        exchanged = gather_lengths([q_BSHD.shape[1], k_BSHD.shape[1]], group, q_BSHD.device)
        q_lens, kv_lens = [e[0] for e in exchanged], [e[1] for e in exchanged]
    qkv = [pad_heads(t, degree) for t in (q_BSHD, k_BSHD, v_BSHD)]
    chunks = chunks if all(t.shape[2] % (chunks * degree) == 0 for t in qkv) else 1
    pieces = [t.chunk(chunks, dim=2) for t in qkv]  # head chunks, each divisible by the degree
    pending = [
        seq_to_head_async(list(chunk), group, seq_lens=[q_lens, kv_lens, kv_lens], fp8=fp8)
        for chunk in zip(*pieces, strict=True)
    ]
    # Runs while q/k/v are in flight.
    mask = mask_in_shard_order(attn_mask, group, q_lens=q_lens, kv_lens=kv_lens, layout=layout)
    chunk_heads = qkv[0].shape[2] // chunks
    returning = []
    for c, exchange in enumerate(pending):
        q_g, k_g, v_g = exchange.wait()
        chunk_mask = _heads_of_rank(mask, group, num_heads=num_heads, first=c * chunk_heads, count=chunk_heads)
        out_g = local(q_g, k_g, v_g, chunk_mask, scale)
        # Packs from the strided view (no extra copy); travels while the next chunk's attention runs.
        returning.append(head_to_seq_async(out_g, group, seq_lens=q_lens, fp8=fp8))
    outs = [r.wait() for r in returning]
    out = outs[0] if chunks == 1 else torch.cat(outs, dim=2)
    return out[:, :, :num_heads]


def _heads_of_rank(
    mask: torch.Tensor | None, group: dist.ProcessGroup | None, *, num_heads: int, first: int, count: int
) -> torch.Tensor | None:
    """Rows of a shard-ordered mask for this rank's heads among padded heads ``[first, first + count)``."""
    if mask is None or mask.shape[1] == 1:
        return mask
    if mask.shape[1] != num_heads:
        raise ValueError(f"attn_mask {tuple(mask.shape)}: head dim must be 1 or {num_heads}")
    degree, rank = dist.get_world_size(group), dist.get_rank(group)
    padded = -num_heads % degree
    if padded:  # padded heads attend to zeros; any mask row works for them
        mask = torch.cat([mask, mask[:, :1].expand(-1, padded, -1, -1)], dim=1)
    per_rank = count // degree
    return mask[:, first + rank * per_rank : first + (rank + 1) * per_rank]


def mask_in_shard_order(
    mask: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    *,
    q_lens: Sequence[int],
    kv_lens: Sequence[int],
    layout: SeqLayout | None,
) -> torch.Tensor | None:
    """A mask whose key dim (and query dim, unless 1) follows the ranks' shards concatenated in rank order.

    Args:
        mask: ``(B, S_kv)`` key padding, or 4-D ``(B|1, H|1, S_q|1, S_kv)``, over the global sequence; or a key-padding
            mask over this rank's local keys (gathered from every rank).
        group: The group the sequence is split over.
        q_lens: Every rank's query shard length.
        kv_lens: Every rank's key/value shard length.
        layout: Segment layout of the sequence (``None``: one contiguous split, already in shard order).

    Returns:
        A 4-D mask, or ``None``.

    Raises:
        ValueError: the mask's dims fit neither the global nor the local lengths.
    """
    if mask is None:
        return None
    if mask.ndim == 2:  # (B, S_kv): key padding
        mask = mask[:, None, None, :]
    while mask.ndim < 4:
        mask = mask.unsqueeze(0)
    rank = dist.get_rank(group)
    total_q, total_kv = sum(q_lens), sum(kv_lens)
    if mask.shape[-1] == total_kv:
        mask = _reorder(mask, -1, kv_lens, layout)
    elif mask.shape[-1] == kv_lens[rank] and mask.shape[-2] == 1:
        mask = _gather_keys(mask, group, kv_lens)
    else:
        raise ValueError(
            f"attn_mask {tuple(mask.shape)}: key dim must be the global key length {total_kv}, or the local one "
            f"({kv_lens[rank]}) for a key-padding mask (query dim 1)"
        )
    if mask.shape[-2] == total_q and total_q != 1:
        mask = _reorder(mask, -2, q_lens, layout)
    elif mask.shape[-2] != 1:
        raise ValueError(f"attn_mask {tuple(mask.shape)}: query dim must be 1 or the global length {total_q}")
    return mask


def _reorder(mask: torch.Tensor, dim: int, lens: Sequence[int], layout: SeqLayout | None) -> torch.Tensor:
    if layout is None or layout.is_contiguous:
        return mask
    if layout.rank_lens != list(lens):
        raise ValueError(f"SeqLayout with rank lengths {layout.rank_lens} does not match the shards {list(lens)}")
    return mask.index_select(dim, layout.global_index(mask.device))


def _gather_keys(mask: torch.Tensor, group: dist.ProcessGroup | None, kv_lens: Sequence[int]) -> torch.Tensor:
    """All-gather a local key-padding mask into post-exchange order (shards may differ in length)."""
    longest = max(kv_lens)
    wire_dtype = torch.uint8 if mask.dtype == torch.bool else mask.dtype  # collectives may lack bool
    local = mask.to(wire_dtype)
    if local.shape[-1] < longest:
        local = F.pad(local, (0, longest - local.shape[-1]))
    parts = [torch.empty_like(local) for _ in kv_lens]
    dist.all_gather(parts, local.contiguous(), group=group)
    gathered = torch.cat([p[..., :n] for p, n in zip(parts, kv_lens, strict=True)], dim=-1)
    return gathered.to(mask.dtype)
