# ruff: noqa: N803, N806 - shape suffixes (q_BSHD) name tensor layouts in attention code
"""USP: Ulysses inside, ring outside — context-parallel attention on a 2-D grid of ranks.

Ranks form a ``ring_degree × ulysses_degree`` grid. Before attention an all-to-all inside each ulysses group turns
sequence shards into head shards (every rank gets the whole sequence of its group for ``heads / ulysses_degree``
heads); ring attention over the ring group then covers the other groups' tokens; an inverse all-to-all hands every
rank its own tokens back with all heads.

**Token order.** The global sequence is split into ``ring_degree · ulysses_degree`` contiguous shards, and the rank
at ring rank ``i`` and ulysses rank ``j`` (ranks within the two groups) holds shard ``i · ulysses_degree + j``
(:func:`usp_shard_index`). After the all-to-all a rank holds the shards of its ulysses group concatenated in ulysses
rank order — shards ``i · u … i · u + u - 1``, one contiguous block of the global sequence — and the ring walks these
blocks in ring-rank order, which is the global order. Keys therefore appear in global order everywhere, which is
what lets a mask written in global key order (padding masks, per-row masks) be sliced by plain offsets. This holds
whatever the order of the mesh dims: the shard index depends only on the ranks *within* the two groups. (Without a
mask any assignment of shards would give the same result, since attention does not depend on the order of keys.)

The all-to-alls here are private and minimal: heads must divide by the ulysses degree and shards inside a ulysses
group must have equal lengths (shards of different ulysses groups may differ: the ring handles uneven blocks).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from fastdit.parallel.attention.comm import gather_lengths
from fastdit.parallel.attention.local import attention_with_lse, repeat_kv_heads
from fastdit.parallel.attention.ring import ring_attention

__all__ = ["usp_attention", "usp_shard_index"]


def usp_shard_index(ulysses_group: dist.ProcessGroup | None, ring_group: dist.ProcessGroup | None) -> int:
    """Which contiguous shard of the global sequence this rank holds: ``ring_rank · ulysses_degree + ulysses_rank``.

    ``None`` stands for a group of one rank.
    """
    return _rank(ring_group) * _degree(ulysses_group) + _rank(ulysses_group)


def usp_attention(
    q_BSHD: torch.Tensor,
    k_BSHD: torch.Tensor,
    v_BSHD: torch.Tensor,
    *,
    ulysses_group: dist.ProcessGroup | None,
    ring_group: dist.ProcessGroup | None,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    seq_lens: Sequence[int] | None = None,
) -> torch.Tensor:
    """Attention of this rank's sequence shard over the whole sequence, split over a ulysses and a ring group.

    Every rank of both groups must call this with the same batch, heads, head dims, dtype and the same kind of mask.

    Args:
        q_BSHD: This rank's queries, shard :func:`usp_shard_index` of the sequence, (batch, seq_local, heads, dim).
        k_BSHD: Keys of the same shard, (batch, kv_local, heads_kv, dim); ``heads_kv`` divides ``heads``. If it is
            not divisible by the ulysses degree, K/V are repeated to ``heads`` before the all-to-all.
        v_BSHD: Values of the same shard, (batch, kv_local, heads_kv, dim_v).
        ulysses_group: Ranks exchanging heads for sequence (``None``: a group of one).
        ring_group: Ranks passing K/V around (``None``: a group of one).
        attn_mask: Optional mask broadcastable to (batch, heads, seq_local, kv_global): this rank's query rows over
            all keys in global order. Boolean (True = attend) or additive. A mask with one row (a key padding mask)
            needs no communication; one with a row per query travels with the queries.
        scale: Score scale; ``None`` means ``1 / sqrt(dim)``.
        seq_lens: Length of every shard in shard order (Q and K/V alike), if known; ``None`` exchanges them with
            two small all-gathers.

    Returns:
        The attention output for this rank's queries, (batch, seq_local, heads, dim_v), dtype of ``q_BSHD``.

    Raises:
        ValueError: heads not divisible by the ulysses degree, unequal shard lengths inside a ulysses group,
            ``seq_lens`` not matching the grid or this rank's tensors, or a mask whose head dim is neither 1 nor
            ``heads``. Each is raised on every rank alike, before any rank enters the attention's collectives.
    """
    ulysses_degree, ring_degree = _degree(ulysses_group), _degree(ring_group)
    num_heads = q_BSHD.size(2)
    if num_heads % ulysses_degree:
        raise ValueError(
            f"USP needs heads divisible by ulysses_degree: heads={num_heads}, ulysses_degree={ulysses_degree}"
        )
    _check_mask_heads(attn_mask, num_heads)
    if ulysses_degree == 1:
        return _ring_or_local(q_BSHD, k_BSHD, v_BSHD, ring_group, attn_mask, scale, seq_lens)
    lens = _shard_lens(q_BSHD, k_BSHD, ulysses_group, ring_group, seq_lens)
    _check_even_in_ulysses_groups(lens, ulysses_degree, ring_degree)
    if k_BSHD.size(2) % ulysses_degree:
        k_BSHD, v_BSHD = repeat_kv_heads(k_BSHD, num_heads), repeat_kv_heads(v_BSHD, num_heads)
    q_heads, k_heads, v_heads = _seq_to_heads([q_BSHD, k_BSHD, v_BSHD], ulysses_group, ulysses_degree)
    mask_heads = _mask_to_heads(attn_mask, num_heads, ulysses_group, ulysses_degree)
    block_kv_lens = [ulysses_degree * lens[block * ulysses_degree][1] for block in range(ring_degree)]
    out_heads = _ring_or_local(q_heads, k_heads, v_heads, ring_group, mask_heads, scale, block_kv_lens)
    return _heads_to_seq(out_heads, ulysses_group, ulysses_degree)


def _degree(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def _ring_or_local(
    q_BSHD: torch.Tensor,
    k_BSHD: torch.Tensor,
    v_BSHD: torch.Tensor,
    ring_group: dist.ProcessGroup | None,
    attn_mask: torch.Tensor | None,
    scale: float | None,
    kv_lens: Sequence[int] | None,
) -> torch.Tensor:
    if ring_group is None:  # ring_attention would read None as the default group
        return attention_with_lse(q_BSHD, k_BSHD, v_BSHD, attn_mask=attn_mask, scale=scale)[0]
    return ring_attention(q_BSHD, k_BSHD, v_BSHD, group=ring_group, attn_mask=attn_mask, scale=scale, kv_lens=kv_lens)


def _shard_lens(
    q_BSHD: torch.Tensor,
    k_BSHD: torch.Tensor,
    ulysses_group: dist.ProcessGroup | None,
    ring_group: dist.ProcessGroup | None,
    seq_lens: Sequence[int] | None,
) -> list[tuple[int, int]]:
    """(query, key) length of every shard in shard order, known alike on every rank of the grid."""
    ulysses_degree, ring_degree = _degree(ulysses_group), _degree(ring_group)
    if seq_lens is not None:
        if len(seq_lens) != ulysses_degree * ring_degree:
            raise ValueError(
                f"seq_lens has {len(seq_lens)} entries for {ring_degree} × {ulysses_degree} ranks: {list(seq_lens)}"
            )
        index = usp_shard_index(ulysses_group, ring_group)
        if q_BSHD.size(1) != seq_lens[index] or k_BSHD.size(1) != seq_lens[index]:
            raise ValueError(
                f"shard {index}: queries ({q_BSHD.size(1)}) and keys ({k_BSHD.size(1)}) must hold "
                f"seq_lens[{index}] = {seq_lens[index]} tokens"
            )
        return [(n, n) for n in seq_lens]
    # Gather inside the ulysses group, then exchange the groups' lists around the ring, so every rank of the grid
    # sees every shard and takes the same decision below.
    in_group = gather_lengths([q_BSHD.size(1), k_BSHD.size(1)], ulysses_group, q_BSHD.device)
    flat = [n for pair in in_group for n in pair]
    per_block = gather_lengths(flat, ring_group, q_BSHD.device) if ring_degree > 1 else [flat]
    return [(block[2 * i], block[2 * i + 1]) for block in per_block for i in range(ulysses_degree)]


def _check_even_in_ulysses_groups(lens: list[tuple[int, int]], ulysses_degree: int, ring_degree: int) -> None:
    for block in range(ring_degree):
        group_lens = lens[block * ulysses_degree : (block + 1) * ulysses_degree]
        if len(set(group_lens)) > 1:
            raise ValueError(
                f"USP needs equal shards inside each ulysses group: (query, key) lengths {group_lens} in ulysses "
                f"group {block} (shards {block * ulysses_degree}..{(block + 1) * ulysses_degree - 1}, "
                f"ulysses_degree={ulysses_degree})"
            )


def _check_mask_heads(attn_mask: torch.Tensor | None, num_heads: int) -> None:
    if attn_mask is not None and attn_mask.dim() >= 3 and attn_mask.size(-3) not in (1, num_heads):
        raise ValueError(f"attn_mask head dim is {attn_mask.size(-3)}: must be 1 or heads={num_heads}")


def _seq_to_heads(xs_BSHD: list[torch.Tensor], group: dist.ProcessGroup | None, degree: int) -> list[torch.Tensor]:
    """One all-to-all: every (B, s, H, D) sequence shard becomes (B, degree·s, H/degree, D), peers' shards in order.

    The tensors share a dtype but may differ in length, heads and head dim: each peer's part of every tensor is
    packed side by side into one row of the send buffer, so there is a single collective and one copy each way.
    """
    # (degree, B, s, H/degree, D) views: the part of each tensor that goes to each peer.
    parts = [x.unflatten(2, (degree, x.size(2) // degree)).permute(2, 0, 1, 3, 4) for x in xs_BSHD]
    sizes = [part[0].numel() for part in parts]
    send = torch.empty(degree, sum(sizes), dtype=xs_BSHD[0].dtype, device=xs_BSHD[0].device)
    offset = 0
    for part, size in zip(parts, sizes, strict=True):
        send[:, offset : offset + size].unflatten(1, part.shape[1:]).copy_(part)
        offset += size
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    outs, offset = [], 0
    for part, size in zip(parts, sizes, strict=True):
        batch, seq, heads, dim = part.shape[1:]
        received = recv[:, offset : offset + size].unflatten(1, (batch, seq, heads, dim))  # (peer, B, s, h, D)
        outs.append(received.permute(1, 0, 2, 3, 4).reshape(batch, degree * seq, heads, dim))
        offset += size
    return outs


def _heads_to_seq(x_BSHD: torch.Tensor, group: dist.ProcessGroup | None, degree: int) -> torch.Tensor:
    """The inverse all-to-all: (B, degree·s, h, D) for this rank's heads becomes (B, s, degree·h, D) for its tokens."""
    batch, seq_all, heads, dim = x_BSHD.shape
    send = x_BSHD.unflatten(1, (degree, seq_all // degree)).transpose(0, 1).contiguous()  # (peer, B, s, h, D)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[j] holds head group j of this rank's tokens.
    return recv.permute(1, 2, 0, 3, 4).reshape(batch, seq_all // degree, degree * heads, dim)


def _mask_to_heads(
    attn_mask: torch.Tensor | None, num_heads: int, group: dist.ProcessGroup | None, degree: int
) -> torch.Tensor | None:
    """This rank's view of the mask after the all-to-all: its heads, the query rows of its whole ulysses group."""
    if attn_mask is None:
        return None
    mask = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))  # (B', H', S_q', S_k')
    heads_per_rank = num_heads // degree
    if mask.size(2) == 1:  # one row for every query (a key padding mask): nothing to exchange
        if mask.size(1) == 1:
            return mask
        start = _rank(group) * heads_per_rank
        return mask[:, start : start + heads_per_rank]
    rows_BSHK = mask.transpose(1, 2)
    if rows_BSHK.size(2) == 1:  # the same rows serve every head: each peer receives them once
        rows_BSHK = rows_BSHK.expand(-1, -1, degree, -1)
    is_bool = rows_BSHK.dtype == torch.bool
    # Collectives move bytes; bool support differs between backends, uint8 is supported everywhere.
    transport = rows_BSHK.view(torch.uint8) if is_bool else rows_BSHK
    (gathered_BSHK,) = _seq_to_heads([transport], group, degree)
    gathered_BSHK = gathered_BSHK.view(torch.bool) if is_bool else gathered_BSHK
    return gathered_BSHK.transpose(1, 2)
