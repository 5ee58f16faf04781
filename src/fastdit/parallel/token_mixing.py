"""Context parallelism for token mixing other than softmax attention: linear attention and row-mixing convolutions.

* Linear attention (Sana) sums keys and values over the tokens before they meet the queries. Under a sequence split
  each rank's sum covers its own tokens only; :func:`install_token_sums` all-reduces the reductions a plan names
  (:class:`~fastdit.parallel.plan.TokenSum`) while the attention module runs, observed through a
  ``torch.overrides.TorchFunctionMode``, so the diffusers processor runs unmodified.
* A ``k x k`` convolution over a token grid split by rows needs the adjacent ranks' edge rows:
  :func:`install_halos` pads a module's input with them and crops its output
  (:class:`~fastdit.parallel.plan.Halo`).

Both are forward hooks that :func:`fastdit.parallel.context_parallel.apply_context_parallel` installs and removes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from fastdit.parallel.plan import Halo, TokenSum, match_modules

__all__ = ["install_halos", "install_token_sums"]


class _TokenSumMode(TorchFunctionMode):
    """Counts the calls of the token sums' functions during one forward and all-reduces the named ones."""

    def __init__(self, sums: tuple[TokenSum, ...], group: dist.ProcessGroup | None, where: str) -> None:
        super().__init__()
        self.wanted = {(s.op, s.occurrence) for s in sums}
        self.ops = {s.op for s in sums}
        self.group = group
        self.where = where
        self.calls: dict[Any, int] = {}
        self.reduced = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        # The mode is off inside this handler, so func and the all-reduce run as usual.
        out = func(*args, **(kwargs or {}))
        if func in self.ops:
            n = self.calls.get(func, 0)
            self.calls[func] = n + 1
            if (func, n) in self.wanted:
                if not isinstance(out, torch.Tensor):
                    raise RuntimeError(f"context parallel: token sum {func} in {self.where} did not return a tensor")
                out = out.contiguous()
                dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
                self.reduced += 1
        return out


def install_token_sums(
    transformer: torch.nn.Module,
    linear: Mapping[str, tuple[TokenSum, ...]],
    group: dist.ProcessGroup | None,
    *,
    when: Callable[[], bool] | None = None,
) -> Callable[[], None]:
    """While each linear attention module in ``linear`` (path -> its sums) runs, all-reduce its token sums.

    Every rank makes the same calls (the same code on shards of one sequence), so the all-reduces pair up. After the
    module's forward, fewer reductions than the plan names (a processor that changed) raise ``RuntimeError`` on
    every rank alike. ``when`` (if given) is asked at each call whether the tokens are split at all (a VAE is split
    only inside its wrapped decode). Returns the undo (removes the hooks).
    """
    state = threading.local()
    handles = []
    for path, sums in linear.items():
        module = transformer.get_submodule(path)

        def enter(mod: torch.nn.Module, args: tuple, *, sums: tuple[TokenSum, ...] = sums, path: str = path) -> None:
            mode = _TokenSumMode(sums, group, path) if when is None or when() else None
            if mode is not None:
                mode.__enter__()
            state.__dict__.setdefault("stack", []).append(mode)

        def leave(mod: torch.nn.Module, args: tuple, output: Any) -> None:
            mode = state.stack.pop()
            if mode is None:
                return
            mode.__exit__(None, None, None)
            if mode.reduced != len(mode.wanted):
                raise RuntimeError(
                    f"context parallel: linear attention {mode.where!r} made {mode.reduced} of the "
                    f"{len(mode.wanted)} token sums its plan names (calls seen: {mode.calls}); the processor no "
                    "longer matches AttentionRouting.linear"
                )

        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave, always_call=True))

    def undo() -> None:
        for handle in handles:
            handle.remove()

    return undo


def _halo_hooks(spec: Halo, group: dist.ProcessGroup | None, path: str) -> tuple[Callable, Callable]:
    degree = dist.get_world_size(group)
    rank = dist.get_rank(group)
    # Ranks hold contiguous rows in rank order: the first rank has no rows above, the last none below.
    top, bottom = rank > 0, rank < degree - 1

    def pad(module: torch.nn.Module, args: tuple) -> tuple:
        x = args[0]
        dim = spec.dim % x.ndim
        rows = x.shape[dim]
        if rows < spec.size:
            raise ValueError(
                f"context parallel: {path!r} holds {rows} rows along dim {dim} on rank {rank}, fewer than its halo "
                f"of {spec.size}"
            )
        edges = torch.cat([x.narrow(dim, 0, spec.size), x.narrow(dim, rows - spec.size, spec.size)], dim=dim)
        edges = edges.contiguous()
        # Edges have one shape on every rank even when the shards differ, so one all-gather serves every rank.
        parts = [torch.empty_like(edges) for _ in range(degree)]
        dist.all_gather(parts, edges, group=group)
        pieces = [parts[rank - 1].narrow(dim, spec.size, spec.size)] if top else []
        pieces.append(x)
        if bottom:
            pieces.append(parts[rank + 1].narrow(dim, 0, spec.size))
        return (torch.cat(pieces, dim=dim), *args[1:])

    def crop(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        dim = spec.dim % output.ndim
        start = spec.size if top else 0
        length = output.shape[dim] - start - (spec.size if bottom else 0)
        return output.narrow(dim, start, length)

    return pad, crop


def install_halos(
    transformer: torch.nn.Module, halos: Mapping[str, Halo], group: dist.ProcessGroup | None
) -> Callable[[], None]:
    """Pad the input of the modules ``halos`` names with the neighbouring ranks' edge rows; crop their output.

    Returns the undo (removes the hooks).
    """
    handles = []
    for pattern, spec in halos.items():
        for path, module in match_modules(transformer, pattern):
            pad, crop = _halo_hooks(spec, group, path)
            handles.append(module.register_forward_pre_hook(pad))
            handles.append(module.register_forward_hook(crop))

    def undo() -> None:
        for handle in handles:
            handle.remove()

    return undo
