# ruff: noqa: N803, N806 - shape suffixes (q_BSHD) name tensor layouts in communication code
"""All-to-all exchanges behind Ulysses attention.

Ulysses turns a sequence-sharded tensor ``(B, S_local, H, D)`` into a head-sharded one ``(B, S_global, H_local, D)``
before attention, and back afterwards. The helpers here do that for several tensors in **one** collective (q, k and
v travel together even when their lengths or head counts differ), with

* **uneven sequence shards**: every rank's length is passed in (``seq_lens``), or exchanged once with
  :func:`gather_lengths`;
* **uneven heads**: :func:`pad_heads` pads the head dim up to a multiple of the degree (zero heads attend to zero
  values and produce zeros, which are stripped afterwards);
* **async issue**: every exchange has an ``*_async`` form returning a :class:`PendingAllToAll`, so the caller can do
  other work while the bytes move and call :meth:`PendingAllToAll.wait` when it needs the result;
* **FP8 transport**: with ``fp8=True`` each tensor travels as ``float8_e4m3fn`` with one float32 scale per tensor,
  viewed as ``uint8`` (backends such as gloo have no float8 type), halving bf16 traffic at a small precision cost.

Post-all-to-all order: after :func:`seq_to_head` the global sequence is the concatenation of the ranks' shards in rank
order. That is the model's global order only when each rank holds one contiguous slice; see
:class:`fastdit.parallel.attention.ulysses.SeqLayout` for the other case.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "FP8_MAX",
    "PendingAllToAll",
    "gather_lengths",
    "head_to_seq",
    "head_to_seq_async",
    "pad_heads",
    "seq_to_head",
    "seq_to_head_async",
    "shard_sizes",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
_SCALE_BYTES = 4  # one float32 scale per tensor, appended to every chunk in FP8 mode


def shard_sizes(total: int, degree: int) -> list[int]:
    """How ``total`` items split over ``degree`` ranks: the first ``total % degree`` ranks get one more.

    Every rank computes the same answer from global sizes alone, so no collective is needed to agree on it.
    """
    base, extra = divmod(total, degree)
    return [base + (1 if r < extra else 0) for r in range(degree)]


def gather_lengths(values: Sequence[int], group: dist.ProcessGroup | None, device: torch.device) -> list[list[int]]:
    """All-gather a few integers from every rank of ``group`` (one small collective).

    Args:
        values: This rank's integers (the same count on every rank).
        group: The process group.
        device: Device the collective runs on (CUDA for NCCL, CPU for gloo).

    Returns:
        ``out[r]`` is the list rank ``r`` sent.
    """
    local = torch.tensor(list(values), dtype=torch.int64, device=device)
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    return [p.tolist() for p in parts]


def pad_heads(x_BSHD: torch.Tensor, degree: int) -> torch.Tensor:
    """Zero-pad the head dim (dim 2) up to a multiple of ``degree`` (returns ``x_BSHD`` itself if it divides)."""
    pad = -x_BSHD.shape[2] % degree
    if pad == 0:
        return x_BSHD
    zeros = x_BSHD.new_zeros(*x_BSHD.shape[:2], pad, x_BSHD.shape[3])
    return torch.cat([x_BSHD, zeros], dim=2)


@dataclass
class PendingAllToAll:
    """An all-to-all in flight. :meth:`wait` blocks until it landed and returns the unpacked result.

    Attributes:
        work: The collective's work handle (``None`` if it already completed synchronously).
        finish: Unpacks the received buffer into the result.
    """

    work: Any
    finish: Callable[[], Any]
    _result: Any = None
    _done: bool = False

    def wait(self) -> Any:
        """Wait for the exchange (once) and return its result."""
        if not self._done:
            if self.work is not None:
                self.work.wait()
            self._result = self.finish()
            self._done = True
        return self._result


# --- packing: every chunk is one flat buffer, so tensors of different shapes share one collective ---


def _to_wire(parts: list[torch.Tensor], fp8: bool) -> torch.Tensor:
    """Pack per-tensor ``(P, ...)`` views into one contiguous ``(P, N)`` send buffer, row ``j`` for rank ``j``.

    Each part is copied once, straight into its columns (FP8: quantised with one scale per tensor, the scales
    appended as float32 bytes to every row).
    """
    degree = parts[0].shape[0]
    numels = [p[0].numel() for p in parts]
    dtype = torch.uint8 if fp8 else parts[0].dtype
    send = torch.empty(degree, _wire_numel(numels, fp8), dtype=dtype, device=parts[0].device)
    offset, scales = 0, []
    for part, numel in zip(parts, numels, strict=True):
        target = send[:, offset : offset + numel].unflatten(1, part.shape[1:])
        if fp8:
            # One scale per tensor maps its largest magnitude onto the largest finite float8 value.
            scale = part.detach().abs().amax().float().clamp(min=1e-12) / FP8_MAX
            target.copy_((part.float() / scale).to(FP8_DTYPE).view(torch.uint8))
            scales.append(scale)
        else:
            target.copy_(part)
        offset += numel
    if fp8:
        send[:, offset:] = torch.stack(scales).view(torch.uint8)
    return send


def _from_wire(chunk: torch.Tensor, numels: list[int], dtype: torch.dtype, fp8: bool) -> list[torch.Tensor]:
    """Split one received chunk back into per-tensor flat pieces (FP8: dequantised with the sender's scales)."""
    if not fp8:
        return list(chunk.split(numels))
    payload, scale_bytes = chunk.split([sum(numels), _SCALE_BYTES * len(numels)])
    scales = scale_bytes.contiguous().view(torch.float32)
    pieces = payload.split(numels)
    return [(p.view(FP8_DTYPE).float() * s).to(dtype) for p, s in zip(pieces, scales, strict=True)]


def _wire_numel(numels: list[int], fp8: bool) -> int:
    return sum(numels) + (_SCALE_BYTES * len(numels) if fp8 else 0)


def _exchange(send_PN: torch.Tensor, recv_numels: list[int], group: dist.ProcessGroup | None) -> tuple[Any, Any]:
    """Start one all-to-all: row ``j`` of ``send_PN`` goes to rank ``j``; rank ``i`` sends ``recv_numels[i]``."""
    send = send_PN.contiguous().view(-1)
    recv = send.new_empty(sum(recv_numels))
    even = len(set(recv_numels)) == 1
    work = dist.all_to_all_single(
        recv,
        send,
        output_split_sizes=None if even else list(recv_numels),
        input_split_sizes=None if even else [send_PN.shape[1]] * send_PN.shape[0],
        group=group,
        async_op=True,
    )
    return work, recv


def _check_heads(x_BSHD: torch.Tensor, degree: int) -> None:
    if x_BSHD.ndim != 4:
        raise ValueError(f"expected a (B, S, H, D) tensor, got shape {tuple(x_BSHD.shape)}")
    if x_BSHD.shape[2] % degree:
        raise ValueError(f"{x_BSHD.shape[2]} heads do not divide over {degree} ranks: pad them with pad_heads first")


def seq_to_head_async(
    xs_BSHD: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None,
    *,
    seq_lens: Sequence[Sequence[int]],
    fp8: bool = False,
) -> PendingAllToAll:
    """Start turning sequence-sharded tensors into head-sharded ones, all in one all-to-all.

    Args:
        xs_BSHD: Tensors ``(B, S_local_i, H_i, D_i)`` of one dtype; each ``H_i`` divisible by the group size.
        group: The Ulysses process group.
        seq_lens: ``seq_lens[i][r]`` is the length of tensor ``i``'s shard on rank ``r``.
        fp8: Send as float8 with per-tensor scales.

    Returns:
        A handle whose ``wait()`` gives ``(B, sum_r seq_lens[i][r], H_i / P, D_i)`` per tensor, shards concatenated in
        rank order.
    """
    degree = dist.get_world_size(group)
    rank = dist.get_rank(group)
    dtype = xs_BSHD[0].dtype
    parts = []
    for x, lens in zip(xs_BSHD, seq_lens, strict=True):
        _check_heads(x, degree)
        S, H = x.shape[1], x.shape[2]
        if lens[rank] != S:
            raise ValueError(f"local length {S} differs from the declared seq_lens[{rank}]={lens[rank]}")
        # (B, S, P, H/P, D) -> (P, B, S, H/P, D): row j holds the heads rank j will own (a view; packed once).
        parts.append(x.unflatten(2, (degree, H // degree)).permute(2, 0, 1, 3, 4))
    # numels_by_sender[r][i]: elements of tensor i that arrive from rank r.
    numels_by_sender = [
        [x.shape[0] * lens[r] * (x.shape[2] // degree) * x.shape[3] for x, lens in zip(xs_BSHD, seq_lens, strict=True)]
        for r in range(degree)
    ]
    recv_numels = [_wire_numel(n, fp8) for n in numels_by_sender]
    work, recv = _exchange(_to_wire(parts, fp8), recv_numels, group)

    def finish() -> list[torch.Tensor]:
        chunks = [_from_wire(c, numels_by_sender[r], dtype, fp8) for r, c in enumerate(recv.split(recv_numels))]
        out = []
        for i, x in enumerate(xs_BSHD):
            B, _, H, D = x.shape
            shards = [chunks[r][i].view(B, seq_lens[i][r], H // degree, D) for r in range(degree)]
            out.append(torch.cat(shards, dim=1) if degree > 1 else shards[0])
        return out

    return PendingAllToAll(work, finish)


def seq_to_head(
    xs_BSHD: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None,
    *,
    seq_lens: Sequence[Sequence[int]],
    fp8: bool = False,
) -> list[torch.Tensor]:
    """Blocking form of :func:`seq_to_head_async`."""
    return seq_to_head_async(xs_BSHD, group, seq_lens=seq_lens, fp8=fp8).wait()


def head_to_seq_async(
    x_BSHD: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    seq_lens: Sequence[int],
    fp8: bool = False,
) -> PendingAllToAll:
    """Start the inverse exchange: ``(B, S_global, H_local, D)`` back to ``(B, S_local, H, D)``.

    Args:
        x_BSHD: Head-sharded tensor whose sequence is the ranks' shards concatenated in rank order.
        group: The Ulysses process group.
        seq_lens: ``seq_lens[r]`` is rank ``r``'s shard length.
        fp8: Send as float8 with a per-tensor scale.

    Returns:
        A handle whose ``wait()`` gives this rank's shard with all heads, ``(B, seq_lens[rank], H_local * P, D)``.
    """
    degree = dist.get_world_size(group)
    rank = dist.get_rank(group)
    B, S, Hl, D = x_BSHD.shape
    if sum(seq_lens) != S:
        raise ValueError(f"sequence length {S} differs from sum(seq_lens)={sum(seq_lens)}")
    # Slice r of the sequence goes back to rank r, which owned it before attention.
    if len(set(seq_lens)) == 1:
        send = _to_wire([x_BSHD.unflatten(1, (degree, seq_lens[0])).transpose(0, 1)], fp8)  # (P, B, S, h, D)
        work, recv = _exchange(send, [send.shape[1]] * degree, group)
    else:
        work, recv = _exchange_uneven(x_BSHD.split(list(seq_lens), dim=1), group, fp8)
    local_numel = B * seq_lens[rank] * Hl * D
    recv_numel = _wire_numel([local_numel], fp8)

    def finish() -> torch.Tensor:
        if fp8:
            pieces = [_from_wire(c, [local_numel], x_BSHD.dtype, fp8)[0] for c in recv.split(recv_numel)]
            received = torch.stack(pieces)
        else:
            received = recv  # already (P, B, S_local, h, D) in memory order
        heads = received.view(degree, B, seq_lens[rank], Hl, D)
        return heads.permute(1, 2, 0, 3, 4).reshape(B, seq_lens[rank], degree * Hl, D)

    return PendingAllToAll(work, finish)


def _exchange_uneven(slices: Sequence[torch.Tensor], group: dist.ProcessGroup | None, fp8: bool) -> tuple[Any, Any]:
    """Send ``slices[j]`` to rank ``j`` when slices differ in size (receivers all get equal-size pieces)."""
    degree = len(slices)
    rank = dist.get_rank(group)
    wires = [_to_wire([s.unsqueeze(0)], fp8).view(-1) for s in slices]
    send = torch.cat(wires)
    recv_numel = wires[rank].numel()
    recv = send.new_empty(recv_numel * degree)
    work = dist.all_to_all_single(
        recv,
        send,
        output_split_sizes=[recv_numel] * degree,
        input_split_sizes=[w.numel() for w in wires],
        group=group,
        async_op=True,
    )
    return work, recv


def head_to_seq(
    x_BSHD: torch.Tensor, group: dist.ProcessGroup | None, *, seq_lens: Sequence[int], fp8: bool = False
) -> torch.Tensor:
    """Blocking form of :func:`head_to_seq_async`."""
    return head_to_seq_async(x_BSHD, group, seq_lens=seq_lens, fp8=fp8).wait()
