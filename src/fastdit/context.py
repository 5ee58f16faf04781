"""One record of what :func:`fastdit.accelerate` applied to a target: the request, the components, the parallel
runtime, and per technique and component the undo and the state it keeps.

This record replaces attributes on user modules: nothing fastdit applies is stored on the pipeline or the
transformer except the hooks themselves. :func:`fastdit.summary`, :func:`fastdit.reset` and inspection read it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from fastdit.config import (
    Attention,
    CacheConfig,
    Compile,
    CudaGraph,
    Fuse,
    Offload,
    Parallel,
    Quantize,
)

if TYPE_CHECKING:
    from fastdit.components import Components
    from fastdit.parallel.runtime import ParallelRuntime

__all__ = ["Context", "Record", "Request", "attach", "context_of", "detach"]


@dataclass(frozen=True, kw_only=True)
class Request:
    """What the user asked :func:`fastdit.accelerate` for, normalised (``compile=True`` → ``Compile()``,
    ``Compile(cuda_graph=True)`` → a :class:`CudaGraph`)."""

    cache: CacheConfig | None = None
    parallel: Parallel | None = None
    compile: Compile | None = None
    cuda_graph: CudaGraph | None = None
    attention: Attention | None = None
    offload: Offload | None = None
    quantize: Quantize | None = None
    fuse: Fuse | None = None

    @property
    def context_parallel(self) -> bool:
        """Whether the sequence is split (Ulysses and/or ring degree > 1)."""
        return self.parallel is not None and self.parallel.ulysses * self.parallel.ring > 1

    @property
    def shares_samples(self) -> bool:
        """Whether several ranks compute one sample together (context or tensor parallel degree > 1)."""
        return self.parallel is not None and self.parallel.ulysses * self.parallel.ring * self.parallel.tp > 1

    @property
    def distributed(self) -> bool:
        """Whether a process group is needed (any degree > 1)."""
        return self.parallel is not None and self.parallel.world_size > 1


@dataclass
class Record:
    """One technique applied to one component."""

    technique: str
    component: str
    undo: Callable[[], None]
    state: Any = None


@dataclass
class Context:
    """Everything applied to one target, in application order.

    Attributes:
        request: The normalised request.
        components: The target's components by kind.
        runtime: Process groups and mesh, created once before any technique (``None`` on one process).
        records: What each technique applied, in order (undone in reverse).
    """

    request: Request
    components: Components
    runtime: ParallelRuntime | None = None
    records: list[Record] = field(default_factory=list)

    def add(self, technique: str, component: str, undo: Callable[[], None], state: Any = None) -> None:
        """Record that ``technique`` was applied to ``component``."""
        self.records.append(Record(technique, component, undo, state))

    def state(self, technique: str, component: str) -> Any:
        """The state ``technique`` keeps for ``component`` (``None`` if it was not applied there)."""
        for record in self.records:
            if record.technique == technique and record.component == component:
                return record.state
        return None

    def applied(self, component: str | None = None) -> Iterator[Record]:
        """The records, optionally only those of ``component``."""
        return (r for r in self.records if component is None or r.component == component)

    def sample_reducer(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """Sums a small tensor over the ranks that hold the same sample (for decisions equal on all of them)."""
        if self.runtime is None or not self.runtime.is_distributed:
            return None
        return self.runtime.sample_reducer()

    def cache_reducer(self, component: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The cache's decision reducer for ``component``: over the ranks that hold the same sample, and during a
        batched CFG-parallel call also over the CFG ranks (they hold parts of one batch, decided on as a whole)."""
        narrow = self.sample_reducer()
        split = self.state("cfg_parallel", component)
        if split is None:
            return narrow
        from fastdit.parallel.runtime import MESH_DIMS, sum_reducer

        dims = tuple(d for d in MESH_DIMS if self.runtime.size(d) > 1)
        wide = sum_reducer(self.runtime.group("cfg") if len(dims) == 1 else self.runtime.flat_group(dims))

        def reduce(t: torch.Tensor) -> torch.Tensor:
            if split.batched:
                return wide(t)
            return t if narrow is None else narrow(t)

        return reduce

    def undo_all(self) -> None:
        """Undo every record, last first; every undo runs even if an earlier one fails (the first error is raised)."""
        error: BaseException | None = None
        while self.records:
            record = self.records.pop()
            try:
                record.undo()
            except BaseException as exc:  # keep undoing: a half-restored model is worse than an error
                error = error or exc
        if error is not None:
            raise error


# Keyed by id: pipelines need not be hashable; the weak reference drops the entry when the target dies.
_CONTEXTS: dict[int, tuple[weakref.ref, Context]] = {}


def attach(target: Any, context: Context) -> None:
    """Remember ``context`` as what was applied to ``target``."""
    key = id(target)
    # The callback holds the dict itself: at interpreter shutdown the module global may already be gone.
    _CONTEXTS[key] = (weakref.ref(target, lambda _, table=_CONTEXTS: table.pop(key, None)), context)


def detach(target: Any) -> Context | None:
    """Forget and return the context of ``target``."""
    entry = _CONTEXTS.get(id(target))
    if entry is None or entry[0]() is not target:
        return None
    del _CONTEXTS[id(target)]
    return entry[1]


def context_of(target: Any) -> Context | None:
    """What was applied to ``target``, or ``None`` if it is not accelerated."""
    entry = _CONTEXTS.get(id(target))
    return entry[1] if entry is not None and entry[0]() is target else None
