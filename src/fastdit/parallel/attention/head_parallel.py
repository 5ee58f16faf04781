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
  tokens with every head (the inverse all-to-all; under ring, this ring rank's block of the sequence); a module with
  several pathways (Cosmos 3's prefix and generation streams) has one output per pathway, each returning to the
  shards of its own query's stream;
* the module's ``forward`` arguments laid out for every head (``HeadParallel.arguments``: a KV cache the pipeline
  allocates and the processor writes in place, a per-head RoPE table): each tensor becomes this rank's heads, a
  view (so writes land in the caller's buffer) or, where Ulysses pads the heads, a padded copy written back.

Grouped KV heads (``HeadParallel.input_heads``) exchange their own count, repeated per query head where the ranks'
shares would not line up; packed 2-D streams ``(S, H·D)`` exchange along dim 0.

Between the two the processor sees the sequence as on one device, so positions, masks, ``BlockMask`` s and key/value
caches (each rank caching its heads) apply unchanged; its attention calls are not routed (they run locally, on the
rank's heads). Ring and USP compute the attention of all their Ulysses group's heads redundantly on each ring rank:
exact, not faster than Ulysses alone. Every exchange depends on global sizes only (shard lengths come from the split
record, or from one exchange when a split was uneven), so all ranks make the same collectives.
"""

from __future__ import annotations

import inspect
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
    # Input sub-module -> every rank's token count of what it returned (the outputs' shards).
    lens: dict[str, list[int]] = field(default_factory=dict)
    # Input sub-module -> (its head count, the repeat of each head before the exchange) (HeadParallel.input_heads).
    input_heads: dict[str, tuple[int, int]] = field(default_factory=dict)
    # (the caller's real heads of a head argument, the zero-padded copy the processor received, the heads dim).
    write_back: list[tuple[torch.Tensor, torch.Tensor, int]] = field(default_factory=list)


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
        """Every rank's token count of ``x`` (cp-group order: ring-major); packed 2-D tensors have no batch dim."""
        return [row[0] for row in self.marker.shard_lengths([x.shape[0 if x.ndim == 2 else 1]], x.device)]

    def _ulysses_lens(self, lens: list[int]) -> list[int]:
        return lens[self.r * self.ulysses : (self.r + 1) * self.ulysses]

    def _ring_lens(self, lens: list[int]) -> list[int]:
        return [sum(lens[j * self.ulysses : (j + 1) * self.ulysses]) for j in range(self.ring)]

    def grouped(self, heads: int, count: int) -> tuple[int, int]:
        """How an input of ``count`` grouped heads (KV heads of ``heads`` query heads) is exchanged: (count, repeat).

        Each rank's query heads ``[u·L, (u+1)·L)`` must meet the KV heads of their groups. Where ``ceil(count / U)``
        KV heads per rank line up with the ``L = ceil(heads / U)`` query heads (``count · L == heads · ceil(count /
        U)``) they are exchanged as they are; otherwise (fewer KV heads than ranks, or groups cut by the padding)
        every KV head is repeated once per query head of its group, so the input exchanges like the queries.
        """
        if count * self.local_heads(heads) == heads * self.local_heads(count):
            return count, 1
        return count, heads // count

    def local_argument(self, value: Any, dim: int | Mapping[int, int], call: _Call, where: str) -> Any:
        """This rank's heads of every tensor in a ``forward`` argument laid out for every head (``arguments``)."""
        if isinstance(value, torch.Tensor):
            d = dim.get(value.ndim) if isinstance(dim, Mapping) else dim
            if d is None:
                raise ValueError(
                    f"context parallel: {where} got a {value.ndim}-D tensor; HeadParallel.arguments gives its heads "
                    f"dim for {sorted(dim)}-D tensors only"
                )
            d = d % value.ndim
            size = value.shape[d]
            if size % call.heads:
                raise ValueError(
                    f"context parallel: {where} has size {size} along its heads dim {d}, not a multiple of "
                    f"{call.heads} heads"
                )
            per_head = size // call.heads
            first = self.u * call.local_heads
            real = max(0, min(call.heads, first + call.local_heads) - first)
            if real == call.local_heads:
                return value.narrow(d, first * per_head, real * per_head)
            # Padded heads (Ulysses degree not dividing the heads): a copy with zero heads appended; whatever the
            # processor writes into the real ones goes back to the caller's tensor after the call.
            shape = list(value.shape)
            shape[d] = call.local_heads * per_head
            padded = value.new_zeros(shape)
            if real:
                target = value.narrow(d, first * per_head, real * per_head)
                padded.narrow(d, 0, real * per_head).copy_(target)
                call.write_back.append((target, padded, d))
            return padded
        if isinstance(value, dict):
            return type(value)((k, self.local_argument(v, dim, call, where)) for k, v in value.items())
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            return type(value)(self.local_argument(v, dim, call, where) for v in value)
        return value

    @torch.compiler.disable
    def to_heads(self, x: torch.Tensor, heads: int, lens: list[int], where: str) -> torch.Tensor:
        """``(B, S_local, H·D)`` or ``(B, S_local, H, D)`` token shard -> the whole sequence of this rank's heads."""
        if x.ndim == 2:  # packed (S, H·D): a batch of one
            return self.to_heads(x.unsqueeze(0), heads, lens, where).squeeze(0)
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
    def to_tokens(self, y: torch.Tensor, call: _Call, query: str, where: str) -> torch.Tensor:
        """The processor's ``(B, S_global, H_local·D)`` result -> this rank's tokens with every head."""
        lens = call.lens.get(query)
        if lens is None:
            raise RuntimeError(
                f"context parallel: {where} ran before its query {query!r} was exchanged (HeadParallel.inputs)"
            )
        if y.ndim == 2:  # packed (S, H·D): a batch of one
            return self.to_tokens(y.unsqueeze(0), call, query, where).squeeze(0)
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


def _find(module: torch.nn.Module, sub: str) -> torch.nn.Module | None:
    """The sub-module at ``sub``, or None where the configuration leaves it out (HeadParallel.optional)."""
    try:
        return module.get_submodule(sub)
    except AttributeError:
        return None


def _positions(module: torch.nn.Module, spec: HeadParallel) -> dict[str, int]:
    """Positional index (after ``self``) of each of ``spec.arguments`` in the module's ``forward``."""
    if not spec.arguments:
        return {}
    params = [
        p.name
        for p in inspect.signature(module.forward).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return {name: params.index(name) for name in spec.arguments if name in params}


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
        positions = _positions(module, spec)

        def enter(
            mod: torch.nn.Module,
            args: tuple,
            kwargs: dict,
            *,
            spec: HeadParallel = spec,
            where=path,
            positions=positions,
        ) -> Any:
            heads = getattr(mod, spec.heads)
            call = _Call(heads=heads, local_heads=exchange.local_heads(heads))
            grouped: dict[str, int] = {}
            for sub, attr in spec.input_heads.items():
                count, repeat = exchange.grouped(heads, getattr(mod, attr))
                call.input_heads[sub] = (count, repeat)
                grouped[attr] = exchange.local_heads(count * repeat)
            for name in spec.divide:
                value = getattr(mod, name)
                call.saved.append((name, value))
                # A grouped head count (KV heads) takes the share its exchange gives each rank.
                setattr(mod, name, grouped[name] if name in grouped else value * call.local_heads // heads)
            calls().append(call)
            if not spec.arguments:
                return None
            args, kwargs = list(args), dict(kwargs)
            for name, dim in spec.arguments.items():
                if name in kwargs:
                    kwargs[name] = exchange.local_argument(kwargs[name], dim, call, f"{where}({name}=)")
                elif positions.get(name, len(args)) < len(args):
                    i = positions[name]
                    args[i] = exchange.local_argument(args[i], dim, call, f"{where}({name}=)")
            return tuple(args), kwargs

        def leave(mod: torch.nn.Module, args: tuple, output: Any) -> None:
            call = calls().pop()
            for name, value in call.saved:
                setattr(mod, name, value)
            for target, padded, dim in call.write_back:
                part = padded.narrow(dim, 0, target.shape[dim])
                if not torch.equal(part, target):
                    target.copy_(part)

        handles.append(module.register_forward_pre_hook(enter, with_kwargs=True))
        handles.append(module.register_forward_hook(leave, always_call=True))
        for sub in spec.inputs:
            sub_module = _find(module, sub)
            if sub_module is None:
                continue  # optional, absent in this configuration (validated)
            where = f"{path}.{sub}"

            def to_heads(mod: torch.nn.Module, args: tuple, output: Any, *, sub=sub, where=where) -> Any:
                call = current(where)
                lens = exchange.lengths(output)
                call.lens[sub] = lens
                count, repeat = call.input_heads.get(sub, (call.heads, 1))
                if repeat > 1:  # KV heads too few to split with the query heads: each repeated per query head
                    output = output.unflatten(-1, (count, -1)).repeat_interleave(repeat, dim=-2).flatten(-2)
                return exchange.to_heads(output, count * repeat, lens, where)

            handles.append(sub_module.register_forward_hook(to_heads))

        for out, query in zip(spec.outputs, spec.queries, strict=True):
            out_module = _find(module, out)
            if out_module is None:
                continue

            def to_tokens(mod: torch.nn.Module, args: tuple, *, where: str = f"{path}.{out}", query=query) -> tuple:
                return (exchange.to_tokens(args[0], current(where), query, where), *args[1:])

            # Before any other pre-hook of the output projection: tensor parallelism's turns its input into a DTensor
            # sharded over the heads, which must see this rank's tokens with all of its (TP-local) heads.
            handles.append(out_module.register_forward_pre_hook(to_tokens, prepend=True))

    def undo() -> None:
        for handle in handles:
            handle.remove()

    return undo
