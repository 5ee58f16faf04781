# ruff: noqa: N803, N806 - shape suffixes (q_BSHD) name tensor layouts in attention code
"""Ring attention: every rank keeps its queries and K/V chunks travel around the ring.

Each rank of the group holds one contiguous shard of the sequence (Q, K and V of the same tokens; shards may differ
in length). Ranks are ordered by their rank in the group, which is also the order of their shards in the global
sequence. In ``world`` hops every K/V shard visits every rank: at hop ``t`` rank ``r`` computes attention of its
queries against the shard of rank ``(r - t) mod world`` while already sending that shard on to ``r + 1`` and
receiving the next one from ``r - 1``. Partial results are merged by log-sum-exp into a float32 accumulator, so the
result equals attention over the whole sequence, sliced to this rank's queries.

K/V travel with their own number of heads (grouped-query K/V are repeated only locally, per chunk), so the traffic is
``2 · (world - 1)`` K/V shards per rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from fastdit.parallel.attention.comm import gather_lengths
from fastdit.parallel.attention.local import attention_with_lse, merge_partials, merge_partials_

__all__ = ["ring_attention"]


def ring_attention(
    q_BSHD: torch.Tensor,
    k_BSHD: torch.Tensor,
    v_BSHD: torch.Tensor,
    *,
    group: dist.ProcessGroup | None,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    kv_lens: Sequence[int] | None = None,
) -> torch.Tensor:
    """Attention of this rank's queries over the K/V shards of every rank of ``group``.

    Every rank of ``group`` must call this with the same batch, heads, head dims, dtype, and the same kind of mask
    (all ``None`` or all shaped alike), or ranks disagree on collectives and hang.

    Args:
        q_BSHD: This rank's queries, (batch, seq_local, heads, head_dim).
        k_BSHD: This rank's keys, (batch, kv_local, heads_kv, head_dim); ``heads_kv`` divides ``heads``. Pass them
            contiguous to avoid a copy.
        v_BSHD: This rank's values, (batch, kv_local, heads_kv, head_dim_v).
        group: The ring's process group; ``None`` means the default group if one exists, else a single process.
        attn_mask: Optional mask broadcastable to (batch, heads, seq_local, kv_global): this rank's query rows over
            all keys in global order (shards concatenated by group rank). Boolean (True = attend) or additive. A last
            dim of 1 broadcasts over all keys.
        scale: Score scale; ``None`` means ``1 / sqrt(head_dim)``.
        kv_lens: K/V shard length of every rank in group-rank order, if the caller knows them; ``None`` exchanges
            them with one small all-gather (on CUDA that waits for the device once).

    Returns:
        The attention output for this rank's queries, (batch, seq_local, heads, head_dim_v), dtype of ``q_BSHD``.

    Raises:
        ValueError: ``kv_lens`` does not fit the group or this rank's shard, or the mask's key dim is neither 1 nor
            the global K/V length.
    """
    world = 1 if group is None and not dist.is_initialized() else dist.get_world_size(group)
    if world == 1:
        return attention_with_lse(q_BSHD, k_BSHD, v_BSHD, attn_mask=attn_mask, scale=scale)[0]
    rank = dist.get_rank(group)
    if kv_lens is None:
        kv_lens = [lens[0] for lens in gather_lengths([k_BSHD.size(1)], group, k_BSHD.device)]
    _check_kv_lens(kv_lens, world, rank, k_BSHD, v_BSHD)
    _check_mask(attn_mask, sum(kv_lens))
    return _ring_loop(q_BSHD, k_BSHD, v_BSHD, group, rank, list(kv_lens), attn_mask, scale)


def _check_kv_lens(kv_lens: Sequence[int], world: int, rank: int, k_BSHD: torch.Tensor, v_BSHD: torch.Tensor) -> None:
    if len(kv_lens) != world:
        raise ValueError(f"kv_lens has {len(kv_lens)} entries for a ring of {world} ranks: {list(kv_lens)}")
    if k_BSHD.size(1) != kv_lens[rank] or v_BSHD.size(1) != kv_lens[rank]:
        raise ValueError(
            f"rank {rank}: keys ({k_BSHD.size(1)}) and values ({v_BSHD.size(1)}) must hold kv_lens[{rank}] = "
            f"{kv_lens[rank]} tokens"
        )


def _check_mask(attn_mask: torch.Tensor | None, kv_total: int) -> None:
    if attn_mask is not None and attn_mask.size(-1) not in (1, kv_total):
        raise ValueError(f"attn_mask key dim is {attn_mask.size(-1)}: must be 1 or the global K/V length {kv_total}")


def _chunk_mask(attn_mask: torch.Tensor | None, kv_lens: list[int], source: int) -> torch.Tensor | None:
    """The mask columns of the keys that ``source`` holds (a view; a broadcast key dim stays as it is)."""
    if attn_mask is None or attn_mask.size(-1) == 1:
        return attn_mask
    offset = sum(kv_lens[:source])
    return attn_mask[..., offset : offset + kv_lens[source]]


def _ring_loop(
    q_BSHD: torch.Tensor,
    k_BSHD: torch.Tensor,
    v_BSHD: torch.Tensor,
    group: dist.ProcessGroup | None,
    rank: int,
    kv_lens: list[int],
    attn_mask: torch.Tensor | None,
    scale: float | None,
) -> torch.Tensor:
    world = len(kv_lens)
    k_BSHD, v_BSHD = k_BSHD.contiguous(), v_BSHD.contiguous()  # P2P sends need contiguous tensors; a no-op usually
    buffers = _HopBuffers(k_BSHD, v_BSHD, max(kv_lens))
    send_to = dist.get_global_rank(group, (rank + 1) % world) if group is not None else (rank + 1) % world
    recv_from = dist.get_global_rank(group, (rank - 1) % world) if group is not None else (rank - 1) % world
    cur_k, cur_v = k_BSHD, v_BSHD
    acc_BSHD = acc_lse_BHS = None
    for hop in range(world):
        source = (rank - hop) % world
        works, next_k, next_v = [], None, None
        if hop < world - 1:
            # Issue the next hop's transfer before computing, so it runs while this chunk is attended to.
            next_source = (source - 1) % world
            next_k, next_v = buffers.views(hop + 1, kv_lens[next_source])
            ops = []
            if kv_lens[source]:  # both ends know the lengths, so both skip empty shards alike
                ops += [dist.P2POp(dist.isend, t, send_to, group) for t in (cur_k, cur_v)]
            if kv_lens[next_source]:
                ops += [dist.P2POp(dist.irecv, t, recv_from, group) for t in (next_k, next_v)]
            works = dist.batch_isend_irecv(ops) if ops else []
        out_BSHD, lse_BHS = attention_with_lse(
            q_BSHD, cur_k, cur_v, attn_mask=_chunk_mask(attn_mask, kv_lens, source), scale=scale
        )
        if hop == 0:
            acc_BSHD, acc_lse_BHS = out_BSHD, lse_BHS
        elif hop == 1:  # the first merge allocates the float32 accumulator (no separate up-cast pass)
            acc_BSHD, acc_lse_BHS = merge_partials(acc_BSHD, acc_lse_BHS, out_BSHD, lse_BHS)
        else:
            merge_partials_(acc_BSHD, acc_lse_BHS, out_BSHD, lse_BHS)
        # Waiting on the sends too keeps the buffer being received into at the next hop free of readers.
        for work in works:
            work.wait()
        if next_k is not None:
            cur_k, cur_v = next_k, next_v
    return acc_BSHD.to(q_BSHD.dtype)


class _HopBuffers:
    """Two receive buffers per K and V, used alternately, each sized for the longest shard.

    Shards of different lengths are received into a contiguous prefix of a flat buffer, so no buffer is allocated
    per hop and every received chunk is contiguous.
    """

    def __init__(self, k_BSHD: torch.Tensor, v_BSHD: torch.Tensor, max_len: int) -> None:
        self._k_shape, self._v_shape = k_BSHD.shape, v_BSHD.shape
        k_row = self._k_shape[0] * self._k_shape[2] * self._k_shape[3]
        v_row = self._v_shape[0] * self._v_shape[2] * self._v_shape[3]
        self._k = torch.empty(2, max_len * k_row, dtype=k_BSHD.dtype, device=k_BSHD.device)
        self._v = torch.empty(2, max_len * v_row, dtype=v_BSHD.dtype, device=v_BSHD.device)
        self._k_row, self._v_row = k_row, v_row

    def views(self, hop: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous (B, seq_len, H, D) views for the chunk received at ``hop``."""
        slot = hop % 2
        batch, _, k_heads, k_dim = self._k_shape
        _, _, v_heads, v_dim = self._v_shape
        k = self._k[slot, : seq_len * self._k_row].view(batch, seq_len, k_heads, k_dim)
        v = self._v[slot, : seq_len * self._v_row].view(batch, seq_len, v_heads, v_dim)
        return k, v
