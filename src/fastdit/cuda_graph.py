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
a step cache — deciding on the host between blocks — is refused together with graphs. Code inside a call can ask
:func:`current_call_signature` and remember host values per signature instead: context parallelism over uneven shards
exchanges shard lengths in the first call of a signature (a warm-up) and recalls them in the capture.
"""

from __future__ import annotations

import contextvars
import functools
import logging
from collections.abc import Callable, Hashable
from typing import Any, Protocol

import torch
from diffusers.hooks import HookRegistry, ModelHook
from torch.utils import _pytree as pytree

from fastdit.cache.hooks import BLOCK_HOOK
from fastdit.config import Compile
from fastdit.errors import FieldError
from fastdit.models.base import ModelAdapter
from fastdit.models.validate import block_lists

__all__ = [
    "GRAPH_HOOK",
    "GRAPH_SCOPES",
    "CapturedGraph",
    "GraphedCalls",
    "apply_cuda_graph",
    "current_call_signature",
    "graph_stats",
]

logger = logging.getLogger(__name__)

GRAPH_HOOK = "fastdit.cuda_graph"
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
                f"Compile.cuda_graph: argument leaf {i} of type {type(leaf).__name__} is neither a tensor nor "
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
                f"Compile.cuda_graph: capturing a call of the {what} failed — something in it reads tensor values on "
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
        config: ``Compile`` with ``cuda_graph=True`` (warm-up count and graph limit).
        new_graph: Makes an empty graph.
        what: Names the function in messages (``"transformer"``, ``"block transformer_blocks.3"``).
        context_key: Adds to every signature (see :func:`apply_cuda_graph`).
    """

    def __init__(
        self,
        config: Compile,
        new_graph: Callable[[], CapturedGraph],
        what: str,
        context_key: Callable[[], Hashable] | None = None,
    ) -> None:
        self.context_key = context_key
        self.warmup = config.graph_warmup
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
                    "Compile.cuda_graph: %d input signatures of the %s are captured (max_graphs); new ones run "
                    "without a graph",
                    self.max_graphs,
                    self.what,
                )
                self._warned_full = True
            return None
        entry = _Entry.capture(fn, leaves, spec, self.new_graph(), self.what)
        self.entries[key] = entry
        self.calls_seen.pop(key, None)
        return entry


class CudaGraphHook(ModelHook):
    """Serves a module's calls (its whole forward, hooks inside it included) from :class:`GraphedCalls`."""

    def __init__(self, graphs: GraphedCalls) -> None:
        super().__init__()
        self.graphs = graphs

    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        return self.graphs(self.fn_ref.original_forward, *args, **kwargs)


GRAPH_SCOPES = ("auto", "call", "blocks")


def apply_cuda_graph(
    transformer: torch.nn.Module,
    config: Compile,
    *,
    adapter: ModelAdapter | None = None,
    cached: bool = False,
    context_key: Callable[[], Hashable] | None = None,
    new_graph: Callable[[], CapturedGraph] | None = None,
) -> Callable[[], None]:
    """Serve ``transformer``'s calls, or each of its blocks' calls, from CUDA graphs; return the undo.

    Installed after every other technique. Scope ``"call"``: one hook outermost on the transformer records the whole
    call. Scope ``"blocks"``: each block's own computation is graphed *inside* the cache's block hook (so cache
    decisions stay on the host between blocks), or, for blocks without one, around the block's (compiled) call.
    ``"auto"`` picks ``"blocks"`` when a cache is installed (``cached``), else ``"call"``.

    Args:
        transformer: A transformer whose parameters live on a CUDA device.
        adapter: Its adapter (the block lists; needed for scope ``"blocks"``).
        config: ``Compile`` with ``cuda_graph=True``.
        cached: Whether a step cache is installed on ``transformer``.
        context_key: For block graphs, a function giving state that is equal on every rank and determines the
            blocks' local shapes (the context-parallel split layout): added to each block call's signature, so all
            ranks warm up, capture and replay at the same calls even when uneven shards collide on one rank.
        new_graph: Graph factory (tests substitute a recorder that replays on CPU).

    Raises:
        ValueError: the parameters are not on a CUDA device, scope ``"call"`` with a cache, or scope ``"blocks"``
            without an adapter (the device and adapter cases as a :class:`~fastdit.errors.FieldError` on the Compile
            field).
    """
    scope = config.graph_scope if config.graph_scope != "auto" else ("blocks" if cached else "call")
    if scope == "call" and cached:
        raise ValueError(
            "Compile.graph_scope='call' with a cache: the cache decides on the host between blocks; use 'blocks'"
        )
    if scope == "blocks" and adapter is None:
        raise FieldError("Compile", "graph_scope", "blocks", "the transformer's adapter (its block lists) is needed")
    new_graph = new_graph or _cuda_graph_factory(transformer)
    if scope == "call":
        graphs = [GraphedCalls(config, new_graph, "transformer")]
        undo = [_hook(transformer, CudaGraphHook(graphs[0]))]
    else:
        graphs, undo = _graph_blocks(transformer, adapter, config, new_graph, context_key)
    transformer._fastdit_graphs = graphs

    def remove() -> None:
        for fn in reversed(undo):
            fn()
        del transformer._fastdit_graphs

    return remove


def _cuda_graph_factory(transformer: torch.nn.Module) -> Callable[[], CapturedGraph]:
    param = next(transformer.parameters(), None)
    device = None if param is None else param.device
    if device is None or device.type != "cuda":
        raise FieldError("Compile", "cuda_graph", True, f"the transformer must be on a CUDA device, found {device}")
    pool = torch.cuda.graph_pool_handle()  # one pool: graphs of a transformer never replay at the same time
    return lambda: _CudaGraph(pool)


def _hook(module: torch.nn.Module, hook: ModelHook) -> Callable[[], None]:
    registry = HookRegistry.check_if_exists_or_initialize(module)
    registry.register_hook(hook, GRAPH_HOOK)
    return lambda: registry.remove_hook(GRAPH_HOOK, recurse=False)


def _graph_blocks(
    transformer: torch.nn.Module,
    adapter: ModelAdapter,
    config: Compile,
    new_graph: Callable[[], CapturedGraph],
    context_key: Callable[[], Hashable] | None,
) -> tuple[list[GraphedCalls], list[Callable[[], None]]]:
    graphs: list[GraphedCalls] = []
    undo: list[Callable[[], None]] = []
    for group, blocks in block_lists(transformer, adapter):
        for i, block in enumerate(blocks):
            calls = GraphedCalls(config, new_graph, f"block {group.path}.{i}", context_key)
            graphs.append(calls)
            registry = getattr(block, "_diffusers_hook", None)
            cache_hook = registry.get_hook(BLOCK_HOOK) if isinstance(registry, HookRegistry) else None
            if cache_hook is None:
                undo.append(_graph_module_call(block, calls))
                continue
            # Inside the cache hook: it decides, then its compute function (compiled or not) replays a graph.
            previous = cache_hook.compute_fn
            compute = previous or cache_hook.fn_ref.original_forward
            cache_hook.compute_fn = functools.partial(calls, compute)
            undo.append(lambda hook=cache_hook, previous=previous: setattr(hook, "compute_fn", previous))
    return graphs, undo


def _graph_module_call(block: torch.nn.Module, calls: GraphedCalls) -> Callable[[], None]:
    """Serve ``block``'s calls from ``calls`` around its compiled call (or its plain call), never inside it.

    A hook on the block would run inside ``block.compile()``'s compiled call, where dynamo would trace the graph
    bookkeeping; ``nn.Module.__call__`` goes through ``_compiled_call_impl`` when it is set, so the graphs wrap that.
    """
    previous = block._compiled_call_impl
    block._compiled_call_impl = functools.partial(calls, previous or block._call_impl)

    def undo() -> None:
        block._compiled_call_impl = previous

    return undo


def graph_stats(transformer: torch.nn.Module) -> dict[str, int] | None:
    """Graphs captured, replays and calls run without a graph (summed over blocks), or ``None`` without graphs."""
    graphs: list[GraphedCalls] | None = getattr(transformer, "_fastdit_graphs", None)
    if graphs is None:
        return None
    return {
        "graphs": sum(len(g.entries) for g in graphs),
        "replays": sum(g.replays for g in graphs),
        "eager_calls": sum(g.eager_calls for g in graphs),
    }
