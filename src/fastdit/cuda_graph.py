"""CUDA graphs over whole transformer calls: capture once per input signature, then replay.

A denoising loop calls the transformer with the same shapes at every step, so the whole call — hooks, context-parallel
splits and collectives, compiled or eager kernels — can be captured once and replayed. Replay launches the recorded
kernels without running any Python, which removes the CPU launch overhead that dominates when each GPU's share of the
work is small (context parallelism, small images, compiled kernels).

How a call is served: its tensor arguments and every other argument form a *signature* (shapes, dtypes, devices,
values). The first ``graph_warmup`` calls with a signature run normally (this compiles, autotunes and initialises
communicators outside the capture); the next one captures the call into a graph whose inputs are static copies; every
later call copies its tensors into those inputs, replays, and returns copies of the outputs (so the pipeline may keep
one call's output while the next call replays).

What cannot be captured: host reads of tensor values inside the call (``.item()``, data-dependent shapes), which is why
a step cache — deciding on the host between blocks — takes graphs per block instead (scope ``"blocks"``: the graphs
are the ``graphs`` stage of each block's :class:`~fastdit.hooks.blocks.BlockRunner`, beneath the cache's hooks).
Code inside a call can ask
:func:`current_call_signature` and remember host values per signature instead: context parallelism over uneven shards
exchanges shard lengths in the first call of a signature (a warm-up) and recalls them in the capture.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol

import torch
from torch.utils import _pytree as pytree

from fastdit.config import GRAPH_SCOPES, CudaGraph
from fastdit.errors import FieldError
from fastdit.hooks import blocks as block_runner
from fastdit.hooks import layers
from fastdit.hooks.state import Applied

__all__ = [
    "GRAPH_HOOK",
    "GRAPH_SCOPES",
    "CapturedGraph",
    "GraphSet",
    "GraphedCalls",
    "apply_cuda_graph",
    "current_call_signature",
    "resolve_scope",
]

logger = logging.getLogger(__name__)

GRAPH_HOOK = "cuda_graph"
# Signatures counted towards their warm-up at once; bounds memory when some argument changes on every call.
_MAX_PENDING = 64

# The input signature of the graph-served transformer call now running (warm-up, capture or replay), else None.
_CALL_SIGNATURE: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("fastdit_call_signature", default=None)


def current_call_signature() -> tuple | None:
    """The input signature of the transformer call in progress when CUDA graphs serve it, else ``None``.

    Code inside the call may remember host values per (signature, point in the call) and skip recomputing them: the
    graph already assumes a signature fixes the call's control flow, and the signature is equal on every rank.
    """
    return _CALL_SIGNATURE.get()


class CapturedGraph(Protocol):
    """A recorded call: ``capture`` runs ``fn`` once under recording and returns its outputs; ``replay`` re-runs it
    on the same memory (inputs read from, outputs written to the tensors seen at capture)."""

    def capture(self, fn: Callable[[], Any]) -> Any: ...

    def replay(self) -> None: ...


class _CudaGraph:
    """:class:`CapturedGraph` backed by ``torch.cuda.CUDAGraph``; graphs of one transformer share a memory pool."""

    def __init__(self, pool: Any) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn: Callable[[], Any]) -> Any:
        with torch.cuda.graph(self.graph, pool=self.pool):
            return fn()

    def replay(self) -> None:
        self.graph.replay()


def _signature(leaves: list[Any], spec: pytree.TreeSpec) -> tuple:
    """What must match for a call to replay a graph: argument structure, tensor shapes/dtypes/devices, other values."""
    parts: list[Hashable] = [str(spec)]
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            # No strides: a call's tensors are copied into the graph's own inputs, whatever their layout.
            parts.append(("tensor", tuple(leaf.shape), leaf.dtype, leaf.device))
            continue
        try:
            hash(leaf)
        except TypeError:
            raise TypeError(
                f"CudaGraph: argument leaf {i} of type {type(leaf).__name__} is neither a tensor nor "
                "hashable, so calls cannot be matched to a captured graph"
            ) from None
        parts.append((type(leaf), leaf))
    return tuple(parts)


class _Entry:
    """One captured graph: static input tensors, the graph, and its output tensors."""

    def __init__(self, graph: CapturedGraph, static_leaves: list[Any], out_leaves: list[Any], out_spec: Any) -> None:
        self.graph = graph
        self.static_leaves = static_leaves
        self.out_leaves = out_leaves
        self.out_spec = out_spec

    @classmethod
    def capture(
        cls, fn: Callable[..., Any], leaves: list[Any], spec: pytree.TreeSpec, graph: CapturedGraph, what: str
    ) -> _Entry:
        # Tensors the graph reads are private copies: the caller's tensors may be freed or reused between calls.
        static = [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        args, kwargs = pytree.tree_unflatten(static, spec)
        try:
            output = graph.capture(lambda: fn(*args, **kwargs))
        except RuntimeError as error:
            raise RuntimeError(
                f"CudaGraph: capturing a call of the {what} failed — something in it reads tensor values on "
                f"the host or synchronises; run without cuda_graph. Cause: {error}"
            ) from error
        out_leaves, out_spec = pytree.tree_flatten(output)
        return cls(graph, static, out_leaves, out_spec)

    def replay(self, leaves: list[Any]) -> Any:
        for static, leaf in zip(self.static_leaves, leaves, strict=True):
            if isinstance(static, torch.Tensor):
                static.copy_(leaf)
        self.graph.replay()
        # Copies: the next replay overwrites the graph's outputs, and the pipeline may still hold this call's.
        fresh = [out.clone() if isinstance(out, torch.Tensor) else out for out in self.out_leaves]
        return pytree.tree_unflatten(fresh, self.out_spec)


class GraphedCalls:
    """Serves calls of one function from CUDA graphs, one per input signature (see the module docstring).

    Args:
        config: The warm-up count and graph limit.
        new_graph: Makes an empty graph.
        what: Names the function in messages (``"transformer"``, ``"block transformer_blocks.3"``).
        context_key: Adds to every signature (see :func:`apply_cuda_graph`).
    """

    def __init__(
        self,
        config: CudaGraph,
        new_graph: Callable[[], CapturedGraph],
        what: str,
        context_key: Callable[[], Hashable] | None = None,
    ) -> None:
        self.context_key = context_key
        self.warmup = config.warmup
        self.max_graphs = config.max_graphs
        self.new_graph = new_graph
        self.what = what
        self.entries: dict[tuple, _Entry] = {}
        self.calls_seen: dict[tuple, int] = {}
        self.replays = 0
        self.eager_calls = 0
        self._warned_full = False

    def __call__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, run normally, captured, or replayed."""
        if torch.is_grad_enabled():  # a graph records no autograd history: training-style calls run normally
            self.eager_calls += 1
            return fn(*args, **kwargs)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        key = _signature(leaves, spec)
        if self.context_key is not None:
            key = (self.context_key(), key)
        token = _CALL_SIGNATURE.set(key)
        try:
            entry = self.entries.get(key)
            if entry is None:
                entry = self._capture_when_due(key, fn, leaves, spec)
                if entry is None:
                    self.eager_calls += 1
                    return fn(*args, **kwargs)
            self.replays += 1
            return entry.replay(leaves)
        finally:
            _CALL_SIGNATURE.reset(token)

    def _capture_when_due(
        self, key: tuple, fn: Callable[..., Any], leaves: list[Any], spec: pytree.TreeSpec
    ) -> _Entry | None:
        seen = self.calls_seen.get(key, 0)
        if seen < self.warmup:
            if len(self.calls_seen) >= _MAX_PENDING:  # arguments that differ on every call never reach a capture
                self.calls_seen.clear()
            self.calls_seen[key] = seen + 1
            return None
        if len(self.entries) >= self.max_graphs:
            if not self._warned_full:
                logger.warning(
                    "CudaGraph: %d input signatures of the %s are captured (max_graphs); new ones run without a graph",
                    self.max_graphs,
                    self.what,
                )
                self._warned_full = True
            return None
        entry = _Entry.capture(fn, leaves, spec, self.new_graph(), self.what)
        self.entries[key] = entry
        self.calls_seen.pop(key, None)
        return entry


class CudaGraphHook(layers.LayerHook):
    """Serves a module's calls (every layer beneath it included) from :class:`GraphedCalls` (at ``Layer.GRAPH``)."""

    def __init__(self, graphs: GraphedCalls) -> None:
        self.graphs = graphs

    def around(self, inner: Callable[..., Any], module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        return self.graphs(inner, *args, **kwargs)


class GraphSet(list):
    """The graphed calls of one transformer (one entry per call site: the transformer, or each block)."""

    def stats(self) -> dict[str, int]:
        """Graphs captured, replays and calls run without a graph (summed over call sites)."""
        return {
            "graphs": sum(len(g.entries) for g in self),
            "replays": sum(g.replays for g in self),
            "eager_calls": sum(g.eager_calls for g in self),
        }


def resolve_scope(config: CudaGraph, cached: bool) -> str:
    """The scope ``config`` means for a transformer with (``cached``) or without a step cache."""
    return config.scope if config.scope != "auto" else ("blocks" if cached else "call")


def apply_cuda_graph(
    transformer: torch.nn.Module,
    config: CudaGraph,
    *,
    blocks: Sequence[tuple[str, torch.nn.Module]] | None = None,
    cached: bool = False,
    context_key: Callable[[], Hashable] | None = None,
    new_graph: Callable[[], CapturedGraph] | None = None,
) -> Applied:
    """Serve ``transformer``'s calls, or each of its blocks' calls, from CUDA graphs; return the undo.

    Scope ``"call"``: one hook outermost on the transformer (``Layer.GRAPH``) records the whole call, every hook and
    collective inside it included. Scope ``"blocks"``: each block's own computation (compiled or not) is graphed as
    the ``graphs`` stage of its block runner, beneath every layer, so cache decisions stay on the host between
    blocks. ``"auto"`` picks ``"blocks"`` when a step cache is installed (``cached``), else ``"call"``.

    Args:
        transformer: A transformer whose parameters live on a CUDA device.
        config: Scope, warm-up count and graph limit.
        blocks: ``(name, block)`` of every block (needed for scope ``"blocks"``).
        cached: Whether a step cache is installed on ``transformer``.
        context_key: For block graphs, a function giving state that is equal on every rank and determines the
            blocks' local shapes (the context-parallel split layout): added to each block call's signature, so all
            ranks warm up, capture and replay at the same calls even when uneven shards collide on one rank.
        new_graph: Graph factory (tests substitute a recorder that replays on CPU).

    Returns:
        The undo; its ``state`` is the :class:`GraphSet` (``state.stats()`` counts captures and replays).

    Raises:
        ValueError: the parameters are not on a CUDA device, scope ``"call"`` with a cache, or scope ``"blocks"``
            without blocks.
    """
    scope = resolve_scope(config, cached)
    if scope == "call" and cached:
        raise ValueError(
            "CudaGraph.scope='call' with a cache: the cache decides on the host between blocks; use 'blocks'"
        )
    if scope == "blocks" and not blocks:
        raise ValueError("CudaGraph.scope='blocks': the transformer's blocks are needed")
    new_graph = new_graph or _cuda_graph_factory(transformer)
    graphs = GraphSet()
    undo: list[Callable[[], None]] = []
    if scope == "call":
        graphs.append(GraphedCalls(config, new_graph, "transformer"))
        undo.append(layers.install(transformer, layers.Layer.GRAPH, GRAPH_HOOK, CudaGraphHook(graphs[0])))
    else:
        for name, block in blocks:
            calls = GraphedCalls(config, new_graph, f"block {name}", context_key)
            graphs.append(calls)
            undo.append(block_runner.set_stage(block, "graphs", calls))

    def remove() -> None:
        for fn in reversed(undo):
            fn()

    return Applied(remove, graphs)


def _cuda_graph_factory(transformer: torch.nn.Module) -> Callable[[], CapturedGraph]:
    param = next(transformer.parameters(), None)
    device = None if param is None else param.device
    if device is None or device.type != "cuda":
        raise FieldError("CudaGraph", "device", str(device), "the transformer must be on a CUDA device")
    pool = torch.cuda.graph_pool_handle()  # one pool: graphs of a transformer never replay at the same time
    return lambda: _CudaGraph(pool)
