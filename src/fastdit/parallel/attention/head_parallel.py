# ruff: noqa: N803, N806 - shape suffixes (x_BSHD) name tensor layouts in attention code
"""Head-parallel attention modules: a processor run unchanged on the whole sequence of this rank's heads.

Context-parallel attention is normally routed where the processor calls attention: q/k/v arrive as token shards and
the exchange happens inside the call. Processors that work on the *global* sequence before that call — slicing q/k/v
by global positions (Qwen-Image 2.1's block-causal segments), scattering the tokens into a buffer laid out for the
whole video (Wan-Animate-2), building a flex ``BlockMask`` from statistics of the whole sequence (Kandinsky 6 SR) —
need the exchange earlier. For a :class:`~fastdit.parallel.plan.HeadParallel` module,
:func:`install_head_parallel` hooks

* the attention module: while it runs, the attributes the processor reshapes by (``heads``, ``inner_dim``) hold this
  rank's share of the heads, and the call's shard lengths are kept for its output;
* the sub-modules returning q/k/v (``to_q``, or ``norm_q`` where a QK-norm spans the whole width): their outputs go
  from token shards ``(B, S_local, H·D)`` to head shards ``(B, S_global, H_local·D)``. Under Ulysses (degree ``U``)
  one all-to-all per tensor gives every rank all tokens of ``ceil(H / U)`` heads (zero heads pad a count that ``U``
  does not divide: they attend to zeros and are dropped again); under ring (degree ``R``) the ring ranks' blocks are
  all-gathered, so every rank holds the whole sequence of its heads; USP does the all-to-all inside the Ulysses group,
  then the all-gather over the ring;
* the output projection: its input, the processor's result ``(B, S_global, H_local·D)``, goes back to this rank's
  tokens with every head (the inverse all-to-all; under ring, this ring rank's block of the sequence).

Between the two the processor sees the sequence as on one device, so positions, masks, ``BlockMask`` s and key/value
caches (each rank caching its heads) apply unchanged; its attention calls are not routed (they run locally, on the
rank's heads). Ring and USP compute the attention of all their Ulysses group's heads redundantly on each ring rank:
exact, not faster than Ulysses alone. Every exchange depends on global sizes only (shard lengths come from the split
record, or from one exchange when a split was uneven), so all ranks make the same collectives.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from fastdit.parallel.attention.comm import head_to_seq, pad_heads, seq_to_head
from fastdit.parallel.attention.dispatch import ContextParallelAttention
from fastdit.parallel.plan import HeadParallel

__all__ = ["install_head_parallel"]


@dataclass
class _Call:
    """One call of a head-parallel attention module."""

    heads: int
    local_heads: int
    saved: list[tuple[str, Any]] = field(default_factory=list)
    query_lens: list[int] | None = None


def _rank(group: dist.ProcessGroup | None, degree: int) -> int:
    return dist.get_rank(group) if degree > 1 else 0


class _Exchange:
    """The head-shard exchanges of one transformer's head-parallel modules (groups and lengths from its marker)."""

    def __init__(self, marker: ContextParallelAttention) -> None:
        self.marker = marker
        self.ulysses, self.ring = marker.ulysses_degree, marker.ring_degree
        self.u = _rank(marker.ulysses_group, self.ulysses)
        self.r = _rank(marker.ring_group, self.ring)

    def local_heads(self, heads: int) -> int:
        """Heads of one rank after the exchange (padded up to a multiple of the Ulysses degree)."""
        return -(-heads // self.ulysses)

    def lengths(self, x: torch.Tensor) -> list[int]:
        """Every rank's token count of ``x`` (cp-group order: ring-major)."""
        return [row[0] for row in self.marker.shard_lengths([x.shape[1]], x.device)]

    def _ulysses_lens(self, lens: list[int]) -> list[int]:
        return lens[self.r * self.ulysses : (self.r + 1) * self.ulysses]

    def _ring_lens(self, lens: list[int]) -> list[int]:
        return [sum(lens[j * self.ulysses : (j + 1) * self.ulysses]) for j in range(self.ring)]

    @torch.compiler.disable
    def to_heads(self, x: torch.Tensor, heads: int, lens: list[int], where: str) -> torch.Tensor:
        """``(B, S_local, H·D)`` or ``(B, S_local, H, D)`` token shard -> the whole sequence of this rank's heads."""
        flat = x.ndim == 3
        if flat and x.shape[-1] % heads:
            raise ValueError(f"context parallel: {where} returned width {x.shape[-1]}, not a multiple of {heads} heads")
        x_BSHD = x.unflatten(-1, (heads, -1)) if flat else x
        if x_BSHD.ndim != 4 or x_BSHD.shape[2] != heads:
            raise ValueError(
                f"context parallel: {where} returned shape {tuple(x.shape)}; HeadParallel expects (B, S, H·D) or "
                f"(B, S, H, D) with H = {heads}"
            )
        if self.ulysses > 1:
            x_BSHD = pad_heads(x_BSHD, self.ulysses)
            x_BSHD = seq_to_head(
                [x_BSHD], self.marker.ulysses_group, seq_lens=[self._ulysses_lens(lens)], fp8=self.marker.fp8
            )[0]
        if self.ring > 1:
            x_BSHD = _gather_tokens(x_BSHD, self.marker.ring_group, self._ring_lens(lens))
        return x_BSHD.flatten(2) if flat else x_BSHD

    @torch.compiler.disable
    def to_tokens(self, y: torch.Tensor, call: _Call, where: str) -> torch.Tensor:
        """The processor's ``(B, S_global, H_local·D)`` result -> this rank's tokens with every head."""
        lens = call.query_lens
        if lens is None:
            raise RuntimeError(f"context parallel: {where} ran before its query was exchanged (HeadParallel.inputs)")
        if y.ndim != 3 or y.shape[1] != sum(lens) or y.shape[-1] % call.local_heads:
            raise ValueError(
                f"context parallel: {where} received shape {tuple(y.shape)}; HeadParallel expects (B, {sum(lens)}, "
                f"{call.local_heads}·D): the whole query sequence of this rank's heads"
            )
        y_BSHD = y.unflatten(-1, (call.local_heads, -1))
        if self.ring > 1:
            ring_lens = self._ring_lens(lens)
            y_BSHD = y_BSHD.narrow(1, sum(ring_lens[: self.r]), ring_lens[self.r])
        if self.ulysses > 1:
            y_BSHD = head_to_seq(
                y_BSHD.contiguous(),
                self.marker.ulysses_group,
                seq_lens=self._ulysses_lens(lens),
                fp8=self.marker.fp8,
            )
        return y_BSHD[:, :, : call.heads].flatten(2)


def _gather_tokens(x_BSHD: torch.Tensor, group: dist.ProcessGroup | None, lens: list[int]) -> torch.Tensor:
    """All-gather token blocks of (possibly) different lengths along dim 1, in rank order."""
    longest = max(lens)
    padded = x_BSHD
    if x_BSHD.shape[1] < longest:
        pad = x_BSHD.new_zeros(x_BSHD.shape[0], longest - x_BSHD.shape[1], *x_BSHD.shape[2:])
        padded = torch.cat([x_BSHD, pad], dim=1)
    parts = [torch.empty_like(padded) for _ in lens]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([p[:, :n] for p, n in zip(parts, lens, strict=True)], dim=1)


def install_head_parallel(
    transformer: torch.nn.Module, paths: Mapping[str, HeadParallel], marker: ContextParallelAttention
) -> Callable[[], None]:
    """Make each attention module in ``paths`` (path -> spec) run its processor on the whole sequence of its heads.

    Returns the undo (removes every hook; attributes are restored after every call, also when the call raises).
    """
    exchange = _Exchange(marker)
    state = threading.local()
    handles = []

    def calls() -> list[_Call]:
        return state.__dict__.setdefault("calls", [])

    def current(where: str) -> _Call:
        stack = calls()
        if not stack:
            raise RuntimeError(f"context parallel: {where} was called outside its head-parallel attention module")
        return stack[-1]

    for path, spec in paths.items():
        module = transformer.get_submodule(path)

        def enter(mod: torch.nn.Module, args: tuple, *, spec: HeadParallel = spec) -> None:
            heads = getattr(mod, spec.heads)
            call = _Call(heads=heads, local_heads=exchange.local_heads(heads))
            for name in spec.divide:
                value = getattr(mod, name)
                call.saved.append((name, value))
                setattr(mod, name, value * call.local_heads // heads)
            calls().append(call)

        def leave(mod: torch.nn.Module, args: tuple, output: Any) -> None:
            call = calls().pop()
            for name, value in call.saved:
                setattr(mod, name, value)

        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave, always_call=True))
        for i, sub in enumerate(spec.inputs):
            where = f"{path}.{sub}"

            def to_heads(mod: torch.nn.Module, args: tuple, output: Any, *, first: bool = i == 0, where=where) -> Any:
                call = current(where)
                lens = exchange.lengths(output)
                if first:
                    call.query_lens = lens
                return exchange.to_heads(output, call.heads, lens, where)

            handles.append(module.get_submodule(sub).register_forward_hook(to_heads))

        def to_tokens(mod: torch.nn.Module, args: tuple, *, where: str = f"{path}.{spec.output}") -> tuple:
            return (exchange.to_tokens(args[0], current(where), where), *args[1:])

        # Before any other pre-hook of the output projection: tensor parallelism's turns its input into a DTensor
        # sharded over the heads, which must see this rank's tokens with all of its (TP-local) heads.
        handles.append(module.get_submodule(spec.output).register_forward_pre_hook(to_tokens, prepend=True))

    def undo() -> None:
        for handle in handles:
            handle.remove()

    return undo
