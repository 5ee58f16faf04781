"""Outputs that repeat at every step: modules outside the blocks whose inputs do not change during a run.

A transformer recomputes some of its outer modules at every step from inputs the pipeline passes unchanged: FLUX's
rotary table from the same ``txt_ids`` / ``img_ids``, its text projection from the same prompt embeddings. A family
declares them (:class:`~fastdit.models.base.StepInvariant`); while a cache is installed each such module keeps its
last outputs and serves a call whose inputs are the *same tensor objects*, not modified in place since (their version
counters unchanged), with equal non-tensor values. Nothing is compared on the device, so a lookup never waits for it.
The output is then the very tensor computed before, bit for bit the one the module would compute again; if a consumer
modified a kept output in place, the entry is dropped and the module computes. Outputs are reused between the steps of
one run only: the end of a run (the cache's run tracker) drops them, since the weights may have changed in between
(a LoRA loaded, fused or rescaled between pipeline calls) while the caller passes the same tensors.

A module whose output depends on the transformer's arguments rather than its own (FLUX's rotary table is computed
from ``cat(txt_ids, img_ids)``, a new tensor every call) declares those arguments: they are read at the transformer's
call, outside the parallel splits, and the module's own arguments must match by shape, dtype and value besides, as
must the call's place among the module's calls in that transformer call (a module called twice, on two arguments
built from the same inputs, keeps an entry per call).

Not served: calls inside a CUDA graph capture (the graph must record the computation), tensors made under
``torch.inference_mode`` (they have no version counter to tell an in-place change), and modules holding tensor-parallel
(DTensor) weights, whose computation has collectives every rank must run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten

from fastdit.attrs import expand_path, is_pattern
from fastdit.hooks import layers
from fastdit.hooks.args import ForwardArgs
from fastdit.models.base import StepInvariant

__all__ = ["REUSE_HOOK", "REUSE_INPUTS_HOOK", "ReuseStats", "install_reuse"]

REUSE_HOOK = "fastdit.cache.reuse"
REUSE_INPUTS_HOOK = "fastdit.cache.reuse_inputs"

# Entries kept per module: one per CFG branch of a true-CFG pipeline (cond / uncond calls alternate), with room for
# pipelines that alternate more inputs (an extra control or reference pass).
_ENTRIES = 4


@dataclass
class ReuseStats:
    """Per declared module (its path): ``[served, calls]`` since the cache was installed, and why modules were left
    out (path → reason)."""

    counts: dict[str, list[int]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """JSON-ready form."""
        served = {name: {"served": s, "calls": c} for name, (s, c) in self.counts.items()}
        return {"modules": served, "skipped": dict(self.skipped)}


class _Key:
    """A call's inputs as the lookup compares them: tensors by identity and version, other leaves by value."""

    __slots__ = ("leaves", "spec")

    def __init__(self, leaves: list[Any], spec: Any) -> None:
        self.leaves = leaves
        self.spec = spec

    @classmethod
    def of(cls, value: Any, tensors_by_shape: bool = False) -> _Key | None:
        """The key of ``value`` (``None``: it holds a tensor without a version counter, which is never served).
        ``tensors_by_shape`` keys tensors by shape, dtype and device instead (arguments derived from declared
        transformer inputs)."""
        leaves, spec = tree_flatten(value)
        keyed: list[Any] = []
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor):
                keyed.append(leaf)
            elif tensors_by_shape:
                keyed.append((tuple(leaf.shape), leaf.dtype, leaf.device))
            elif leaf.is_inference():
                return None
            else:
                keyed.append(_TensorLeaf(leaf))
        return cls(keyed, spec)

    def matches(self, other: _Key) -> bool:
        if self.spec != other.spec:  # equal specs hold equally many leaves
            return False
        return all(_same(a, b) for a, b in zip(self.leaves, other.leaves, strict=True))


class _TensorLeaf:
    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.version = tensor._version

    def unchanged(self) -> bool:
        return self.tensor._version == self.version


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, _TensorLeaf) or isinstance(b, _TensorLeaf):
        return (
            isinstance(a, _TensorLeaf)
            and isinstance(b, _TensorLeaf)
            and a.tensor is b.tensor
            and a.version == b.version
        )
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:  # a value without a plain truth value compares as different: the module computes
        return False


@dataclass
class _Entry:
    key: _Key
    output: Any
    kept: list[_TensorLeaf]  # the output's tensors, to tell a consumer's in-place change


class RootInputs(layers.LayerHook):
    """Reads the declared transformer arguments of each call (at ``TRACK``: the pipeline's own objects, outside the
    parallel splits) for the module hooks beneath."""

    def __init__(self, transformer: torch.nn.Module, names: Sequence[str]) -> None:
        self._names = tuple(names)
        self._reader = ForwardArgs(transformer, self._names)
        self.current: dict[str, Any] | None = None
        self._ordinals: dict[int, int] = {}

    def around(self, inner: Callable[..., Any], module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        previous = self.current, self._ordinals
        self.current = {name: self._reader.get(name, args, kwargs) for name in self._names}
        self._ordinals = {}
        try:
            return inner(*args, **kwargs)
        finally:
            self.current, self._ordinals = previous

    def ordinal(self, hook: object) -> int:
        """How many times ``hook``'s module was called before in this transformer call: a module called twice per call
        (on other arguments built from the same inputs) keeps one entry per call site."""
        n = self._ordinals.get(id(hook), 0)
        self._ordinals[id(hook)] = n + 1
        return n


class ReuseHook(layers.LayerHook):
    """Serves a declared module's call from its kept outputs when the inputs are the same (module docstring)."""

    may_skip = True

    def __init__(self, rule: StepInvariant, root: RootInputs | None, counts: list[int], run: Callable[[], int]) -> None:
        self._inputs = rule.inputs
        self._root = root
        self._counts = counts  # [served, calls], shared with the stats
        self._entries: list[_Entry] = []
        self._run = run
        self._entries_run: int | None = None

    def _key(self, args: tuple, kwargs: dict) -> _Key | None:
        if not self._inputs:
            return _Key.of((args, kwargs))
        current = self._root.current if self._root is not None else None
        if current is None:  # called outside a transformer call: nothing to compare with
            return None
        root = _Key.of(tuple(current[name] for name in self._inputs))
        own = _Key.of((args, kwargs), tensors_by_shape=True)
        if root is None or own is None:
            return None
        return _Key([self._root.ordinal(self), *root.leaves, *own.leaves], (root.spec, own.spec))

    def around(self, inner: Callable[..., Any], module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        self._counts[1] += 1
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return inner(*args, **kwargs)  # a graph records what it replays: the module must compute
        key = self._key(args, kwargs)
        if key is None:
            return inner(*args, **kwargs)
        run = self._run()
        if run != self._entries_run:
            # A new run may come with other weights (a LoRA loaded, fused or rescaled between pipeline calls) for the
            # same input tensors: outputs are only reused between the steps of one run.
            self._entries.clear()
            self._entries_run = run
        for i, entry in enumerate(self._entries):
            if entry.key.matches(key):
                if all(leaf.unchanged() for leaf in entry.kept):
                    self._counts[0] += 1
                    return entry.output
                del self._entries[i]  # a consumer changed the kept output in place: compute it again
                break
        output = inner(*args, **kwargs)
        leaves, _ = tree_flatten(output)
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        if any(t.is_inference() for t in tensors):
            return output
        self._entries.insert(0, _Entry(key, output, [_TensorLeaf(t) for t in tensors]))
        del self._entries[_ENTRIES:]
        return output

    def reset(self) -> None:
        # The end of a pipeline call: let the inputs and outputs go (the next call brings its own).
        self._entries.clear()


def _skip_reason(module: torch.nn.Module | None) -> str | None:
    # A served call skips the module's computation on this rank: nothing in it may be a collective the other ranks
    # wait for, whatever the lookup decides there.
    if module is None:
        return "no such module in this transformer"
    if any(isinstance(p, DTensor) for p in module.parameters()):
        return "its weights are split by tensor parallelism (its computation has collectives every rank runs)"
    if _parallel_inside(module):
        return "context parallelism runs inside it (split inputs or routed attention: collectives every rank runs)"
    return None


def _parallel_inside(module: torch.nn.Module) -> bool:
    """Whether ``module``'s own computation holds parallel work: its input split, a parallel layer on a submodule, or
    an attention processor routed to a parallel backend. (A split or gather of its *output* runs around the lookup.)"""
    parallel = (layers.Layer.PARALLEL_INPUT, layers.Layer.PARALLEL_OUTPUT)
    for sub in module.modules():
        if getattr(getattr(sub, "processor", None), "_parallel_config", None) is not None:
            return True
        stack = layers.stack_of(sub)
        if stack is None:
            continue
        for layer, _ in stack.names():
            if layer == layers.Layer.PARALLEL_INPUT or (layer in parallel and sub is not module):
                return True
    return False


def install_reuse(
    transformer: torch.nn.Module, rules: Sequence[StepInvariant], run: Callable[[], int] = lambda: 0
) -> tuple[ReuseStats, Callable[[], None]]:
    """Install the reuse hooks of ``rules`` on ``transformer``; return their statistics and the undo.

    Args:
        transformer: The denoiser.
        rules: Its family's declarations.
        run: The cache's run epoch (:attr:`~fastdit.cache.state.RunTracker.epoch`): kept outputs are dropped when it
            changes.
    """
    stats = ReuseStats()
    undo: list[Callable[[], None]] = []
    modules = dict(transformer.named_modules())
    chosen: list[tuple[str, StepInvariant]] = []
    for rule in rules:
        paths = expand_path(transformer, rule.module) if is_pattern(rule.module) else [rule.module]
        if not paths:
            stats.skipped[rule.module] = "matches no module in this transformer"
        for path in paths:
            reason = _skip_reason(modules.get(path))
            if reason is None:
                chosen.append((path, rule))
            else:
                stats.skipped[path] = reason
    names = sorted({name for _, rule in chosen for name in rule.inputs})
    root = RootInputs(transformer, names) if names else None
    if root is not None:
        undo.append(layers.install(transformer, layers.Layer.TRACK, REUSE_INPUTS_HOOK, root))
    for path, rule in chosen:
        counts = stats.counts.setdefault(path, [0, 0])
        hook = ReuseHook(rule, root if rule.inputs else None, counts, run)
        undo.append(layers.install(modules[path], layers.Layer.SKIP, REUSE_HOOK, hook))

    def remove() -> None:
        for fn in reversed(undo):
            fn()

    return stats, remove
