"""Wall time of loading and calling a :class:`~fastdit.session.Session`, and the cache statistics of the calls.

Every timed stretch is bracketed by :func:`fastdit.process.synchronize`, so the time of asynchronous CUDA work is
counted where it is queued. Errors about a run's own numbers raise :class:`fastdit.errors.FieldError` with owner
:data:`OWNER` and field ``"cases"``, ``"warmup"``, ``"repeat"`` or ``"batch"``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch

import fastdit
from fastdit.bench.memory import MemoryTracker
from fastdit.config import Loading
from fastdit.errors import FieldError
from fastdit.process import synchronize
from fastdit.session import Case, ModelSource, Session

__all__ = ["OWNER", "CacheStats", "RunResult", "run", "run_variants", "time_calls", "timed_load"]

OWNER = "run"
"""The :attr:`~fastdit.errors.FieldError.owner` of errors about a run's numbers."""

T = TypeVar("T")


@dataclass
class CacheStats:
    """Cache statistics summed over the calls of one pass (see :func:`fastdit.summary`)."""

    cached_steps: int = 0
    blocks_computed: int = 0
    blocks_total: int = 0

    @property
    def blocks_computed_fraction(self) -> float:
        """Blocks computed / blocks a run without cache computes (1.0 when nothing was counted)."""
        return self.blocks_computed / self.blocks_total if self.blocks_total else 1.0

    def add(self, summary: fastdit.Summary) -> None:
        """Add the statistics of one pipeline call."""
        for info in summary.transformers.values():
            stats = info.get("cache")
            if stats:
                self.cached_steps += stats["num_cached_steps"]
                self.blocks_computed += stats["blocks_computed"]
                self.blocks_total += stats["blocks_total"]


@dataclass
class RunResult:
    """What :func:`run` measured.

    Attributes:
        outputs: One float32 array in [0, 1] per case, from the last timed pass.
        seconds: Wall time of each timed pass over all cases.
        call_seconds: Wall time of each pipeline call of the timed passes.
        warmup_seconds: Total wall time of the warm-up calls.
        cache: Cache statistics of the last pass (``None`` when the pipeline is not accelerated).
        summary: :func:`fastdit.summary` of the last call (``None`` when the pipeline is not accelerated).
        peak_memory: Peak bytes over the timed passes (``None`` unless tracked).
        memory_kind: What :attr:`peak_memory` measures.
        output_kind: What the outputs are (:attr:`Session.output_kind`): ``"image"``, ``"video"`` or ``"audio"``
            (waveforms, full scale [-1, 1], compared by :func:`fastdit.metrics.compare_audio`).
    """

    outputs: list[np.ndarray] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    call_seconds: list[float] = field(default_factory=list)
    warmup_seconds: float = 0.0
    cache: CacheStats | None = None
    summary: fastdit.Summary | None = None
    peak_memory: int | None = None
    memory_kind: str = ""
    output_kind: str = "image"

    def extend(self, later: RunResult) -> None:
        """Add the passes of a later run of the same variant (outputs and statistics are the later ones)."""
        self.outputs, self.output_kind = later.outputs, later.output_kind
        self.seconds += later.seconds
        self.call_seconds += later.call_seconds
        self.warmup_seconds += later.warmup_seconds
        self.cache, self.summary = later.cache, later.summary
        if later.peak_memory is not None:
            self.peak_memory = max(self.peak_memory or 0, later.peak_memory)
            self.memory_kind = later.memory_kind

    @property
    def median_seconds(self) -> float:
        """Median wall time of one pass over all cases."""
        return statistics.median(self.seconds)

    @property
    def median_call_seconds(self) -> float:
        """Median wall time of one pipeline call (one output, or one batch of them)."""
        return statistics.median(self.call_seconds)


def _timed(fn: Callable[[], T], device: torch.device, barrier: bool) -> tuple[T, float]:
    synchronize(device, barrier=barrier)
    start = time.perf_counter()
    value = fn()
    synchronize(device, barrier=barrier)
    return value, time.perf_counter() - start


def time_calls(
    fn: Callable[[], T], device: torch.device | str, *, warmup: int = 0, repeat: int = 1, across_processes: bool = False
) -> tuple[T, list[float]]:
    """Call ``fn`` ``warmup`` times untimed, then ``repeat`` times timed.

    Args:
        fn: The work, e.g. one pipeline call.
        device: Where it runs (its queue is drained at both ends of each timed call).
        warmup: Untimed calls first (compilation, allocator and kernel caches).
        repeat: Timed calls.
        across_processes: Also wait for every process of the group at both ends, so each time covers the slowest
            rank (every process must then make the same calls).

    Returns:
        The last call's value and each timed call's seconds.
    """
    _check_counts(warmup=warmup, repeat=repeat)
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    value, seconds = None, []
    for _ in range(repeat):
        value, elapsed = _timed(fn, device, across_processes)
        seconds.append(elapsed)
    return value, seconds  # type: ignore[return-value]  # repeat >= 1: value is set


def timed_load(
    source: ModelSource,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    progress: bool = False,
    loading: Loading | None = None,
) -> tuple[Session, float]:
    """:meth:`Session.load` and its wall time (weights and the move to ``device``; under a broadcasting
    ``loading``, until this rank received every tensor)."""
    start = time.perf_counter()
    session = Session.load(source, device=device, dtype=dtype, progress=progress, loading=loading)
    return session, time.perf_counter() - start


def _check_counts(*, cases: int | None = None, warmup: int = 0, repeat: int = 1, batch: int = 1) -> None:
    if cases is not None and cases < 1:
        raise FieldError(OWNER, "cases", cases, "needs at least one case")
    for name, value, least in (("warmup", warmup, 0), ("repeat", repeat, 1), ("batch", batch, 1)):
        if not isinstance(value, int) or value < least:
            raise FieldError(OWNER, name, value, f"must be an integer >= {least}")


def _chunks(cases: Sequence[Case], batch: int) -> list[Sequence[Case]]:
    return [cases[i : i + batch] for i in range(0, len(cases), batch)]


def _call(session: Session, chunk: Sequence[Case], kwargs: Mapping[str, Any]) -> tuple[list[np.ndarray], float]:
    if len(chunk) == 1:
        output, elapsed = _timed(lambda: session.call(chunk[0], kwargs), session.device, False)
        return [output], elapsed
    return _timed(lambda: session.call_batch(chunk, kwargs), session.device, False)


def _warm_up(session: Session, cases: Sequence[Case], kwargs: Mapping[str, Any], warmup: int, batch: int) -> float:
    first = _chunks(cases, batch)[0]
    return sum(_call(session, first, kwargs)[1] for _ in range(warmup))


def run(
    session: Session,
    cases: Sequence[Case],
    kwargs: Mapping[str, Any],
    *,
    warmup: int = 0,
    repeat: int = 1,
    track_memory: bool = False,
    batch: int = 1,
) -> RunResult:
    """Generate every case ``repeat`` times, as the session is now, after ``warmup`` untimed calls of the first.

    Args:
        session: The loaded (and possibly accelerated) pipeline.
        cases: What to generate.
        kwargs: Call arguments from :func:`~fastdit.session.call_arguments` (no prompt or generator).
        warmup: Untimed calls of the first batch before timing (compilation, allocator and kernel caches).
        repeat: Timed passes over all cases; reports use the median.
        track_memory: Measure peak memory over the timed passes.
        batch: Cases per pipeline call (see :meth:`Session.call_batch`); 1 makes each output independent of the
            others.

    Raises:
        FieldError: Owner ``"run"``: no cases, or a count out of range.
    """
    _check_counts(cases=len(cases), warmup=warmup, repeat=repeat, batch=batch)
    result = RunResult(warmup_seconds=_warm_up(session, cases, kwargs, warmup, batch))
    memory = MemoryTracker(session.device) if track_memory else None
    if memory is not None:
        memory.reset()
    for _ in range(repeat):
        result.outputs, result.cache = [], CacheStats() if session.accelerated else None
        pass_seconds = 0.0
        for chunk in _chunks(cases, batch):
            outputs, elapsed = _call(session, chunk, kwargs)
            result.outputs.extend(outputs)
            result.call_seconds.append(elapsed)
            pass_seconds += elapsed
            if result.cache is not None:
                result.summary = session.summary()
                result.cache.add(result.summary)
        result.seconds.append(pass_seconds)
    result.output_kind = session.output_kind
    if memory is not None:
        result.peak_memory, result.memory_kind = memory.peak(), memory.kind
    return result


def run_variants(
    session: Session,
    variants: Sequence[Mapping[str, Any] | None],
    cases: Sequence[Case],
    kwargs: Mapping[str, Any],
    *,
    warmup: int = 0,
    repeat: int = 1,
    track_memory: bool = False,
    batch: int = 1,
) -> list[RunResult]:
    """Run several accelerations (``None`` or ``{}``: plain) on the same cases, interleaved pass by pass.

    Each variant is warmed up first; then every round runs one timed pass of each variant in turn. A change of
    machine load during the measurement (other processes, clocks, thermals) then slows every variant alike
    instead of whichever happened to run at the time, so ratios between variants stay meaningful.

    Args:
        session: The loaded, un-accelerated pipeline (left un-accelerated).
        variants: ``fastdit.accelerate`` keyword arguments per variant.
        cases: What to generate.
        kwargs: Call arguments from :func:`~fastdit.session.call_arguments`.
        warmup: Untimed calls per variant.
        repeat: Timed passes per variant.
        track_memory: Measure each variant's peak memory.
        batch: Cases per pipeline call.

    Returns:
        One result per variant, in order.

    Raises:
        FieldError: Owner ``"run"``: no cases, or a count out of range.
    """
    _check_counts(cases=len(cases), warmup=warmup, repeat=repeat, batch=batch)
    results = [RunResult() for _ in variants]
    for result, options in zip(results, variants, strict=True):
        with session.variant(options):
            result.warmup_seconds = _warm_up(session, cases, kwargs, warmup, batch)
    for _ in range(repeat):
        for result, options in zip(results, variants, strict=True):
            with session.variant(options):
                result.extend(run(session, cases, kwargs, track_memory=track_memory, batch=batch))
    return results
