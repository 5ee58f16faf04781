"""Per-run cache state, keyed by cache context and CFG branch.

A *run* is one pipeline call; a *step* is one transformer call of a branch. Pipelines announce the branch with
diffusers' ``cache_context("cond" | "uncond")``; when they don't, consecutive calls with the same timestep are taken
as the branches of one step (true CFG). A run ends when a diffusers pipeline resets its stateful hooks at the end of
its call; independently, a timestep that moves against the run's direction (most samplers count down, some count up),
or a change of input shape, starts a new run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fastdit.cache.forecast import Forecast

__all__ = ["PAIRED_BRANCHES", "BranchState", "RunTracker", "SegmentMemory", "branch_alias"]

PAIRED_BRANCHES: dict[str, str] = {"default": "cond", "default/1": "uncond"}
"""The two calls of a step that a pipeline does not announce, by the names one process gives them (paired by their
timestep, :meth:`RunTracker.branches`) → the names CFG parallelism announces the same calls by to the cache beneath
it (the step's first call is rank 0's ``cond``, see :mod:`fastdit.parallel.cfg_parallel`)."""


def branch_alias(name: str) -> str | None:
    """The name the same branch has under the other layout (one process ↔ CFG parallelism), or ``None``.

    A per-branch table recorded under one layout (a MagCache calibration) is read under the other by it.
    """
    if name in PAIRED_BRANCHES:
        return PAIRED_BRANCHES[name]
    return next((single for single, split in PAIRED_BRANCHES.items() if split == name), None)


@dataclass
class SegmentMemory:
    """What a middle segment (a contiguous run of middle blocks of one block list) remembers between steps."""

    hidden_in: torch.Tensor | None = None
    encoder_in: torch.Tensor | None = None
    # Step at which the segment's input was last recorded: the first *called* middle block of the segment records
    # it, since a model may leave blocks out of some calls (SD3.5 skip-layer guidance).
    entered_step: int = -1
    hidden_residual: torch.Tensor | None = None
    encoder_residual: torch.Tensor | None = None
    # Last computed encoder output: patterns 4/5 create the encoder stream inside the blocks.
    encoder_out: torch.Tensor | None = None
    # TaylorSeer: what the forecasts of the hidden and encoder residuals know of the computed steps.
    forecast: Forecast = field(default_factory=Forecast)
    forecast_encoder: Forecast = field(default_factory=Forecast)


@dataclass
class BranchState:
    """The cache state of one branch (``cond``, ``uncond``, ...) during one run."""

    step: int = -1
    # The current call's timestep (None when the model takes none): TaylorSeer's variable when it asks for it.
    timestep: float | None = None
    computing: bool = True
    # Step at which the first block of the stack was last called (a whole-step policy may decide on its input).
    stack_entered_step: int = -1
    front_hidden_in: torch.Tensor | None = None
    front_entered_step: int = -1
    front_residual: torch.Tensor | None = None
    # Step whose front residual :attr:`front_residual` is (DBCache.decide_ahead measures drift rates from it).
    reference_step: int = -1
    # DBCache.decide_ahead: the last front-residual drift on its way to the host (a ``PendingDrift``).
    pending_drift: Any = None
    # The forecast of the front residual (for forecast decisions).
    front_forecast: Forecast = field(default_factory=Forecast)
    continuous_cached: int = 0
    cached_steps: list[int] = field(default_factory=list)
    diffs: list[float | None] = field(default_factory=list)
    blocks_computed: int = 0
    blocks_total: int = 0
    segments: dict[int, SegmentMemory] = field(default_factory=dict)
    # Per-block memories: extras a block returned (DBCache) or its input/residual (DBPrune).
    block_memory: dict[int, Any] = field(default_factory=dict)
    # DBPrune: blocks pruned in each step.
    pruned: list[int] = field(default_factory=list)
    # What a whole-step policy accumulates across steps (MagCache: its ratio and error since the last computed step;
    # TeaCache: its rescaled input change and the previous step's input).
    policy: Any = None

    @property
    def has_cache(self) -> bool:
        """Whether every middle segment seen in this run holds a residual to replay."""
        return bool(self.segments) and all(m.hidden_residual is not None for m in self.segments.values())

    def segment(self, index: int) -> SegmentMemory:
        """The memory of middle segment ``index`` (created on first use)."""
        memory = self.segments.get(index)
        if memory is None:  # not ``setdefault``: that would build a discarded memory on every block call
            memory = self.segments[index] = SegmentMemory()
        return memory

    def summary(self) -> dict[str, Any]:
        """Plain-data statistics of this branch's run."""
        num_steps = self.step + 1
        return {
            "steps": num_steps,
            "cached_steps": list(self.cached_steps),
            "num_cached_steps": len(self.cached_steps),
            "residual_diffs": [None if d is None else round(d, 6) for d in self.diffs],
            "blocks_computed": self.blocks_computed,
            "blocks_total": self.blocks_total,
            **({"pruned_blocks_per_step": list(self.pruned)} if self.pruned else {}),
        }


@dataclass
class _ContextTrack:
    started: bool = False
    last_timestep: float | None = None
    # +1 if the run's timesteps rise (Lumina2 counts 0 → 1), -1 if they fall (most samplers), 0 until known.
    direction: int = 0
    signature: tuple | None = None
    # The scheduler clock's index at the last call (``None`` when the run's calls are told apart by timestep).
    last_key: int | None = None
    branch: int = 0
    branches: dict[int, BranchState] = field(default_factory=dict)


_EPS = 1e-9


class RunTracker:
    """Finds the branch state for each transformer call and starts new runs.

    Args:
        separate_branches: Keep one state per CFG branch (``False`` shares one state by all calls).

    Attributes:
        schedule: Counts the steps the current run will take, when a pipeline's scheduler tells
            (:func:`fastdit.cache.runs.reset_on_new_schedule` sets it for the run; ``None`` otherwise).
        clock: The run's :class:`~fastdit.cache.runs.SchedulerClock`, set with :attr:`schedule` when the scheduler
            keeps a host step index (``None`` otherwise).
        sigma: The noise level of the scheduler's current step and whether it is a flow-matching one, given the
            call's timestep (:func:`fastdit.cache.spectral.scheduled_sigma`), set like :attr:`schedule`.
        epoch: Counts the ends of runs (:meth:`reset`, or a context started over): what was kept for one run's steps
            is stale in the next. A context's first run (the uncond branch after the cond one) does not count.
    """

    def __init__(self, separate_branches: bool = True) -> None:
        self.separate_branches = separate_branches
        self._contexts: dict[str, _ContextTrack] = {}
        self.active: BranchState | None = None
        self.runs = 0
        self.epoch = 0
        self._finished: dict[str, BranchState] = {}
        self.schedule: Callable[[], int | None] | None = None
        self.clock: Any = None
        self.sigma: Callable[[float | None], tuple[float, bool] | None] | None = None

    def reset(self) -> None:
        """End the current run (the next call starts a new one); its statistics stay readable via :meth:`report`.

        diffusers pipelines call this at the end of every ``__call__`` (through their stateful-hook reset), which
        gives an exact run boundary; the timestep/shape heuristics cover everything else.
        """
        if self._contexts:
            self._finished = self.branches()
        self._contexts.clear()
        self.epoch += 1
        self.active = None
        self.schedule = None  # the next run's scheduler sets its own
        self.clock = None
        self.sigma = None

    def report(self) -> dict[str, BranchState]:
        """The branches of the current run, or of the last finished one if none is in progress."""
        return self.branches() or dict(self._finished)

    def begin_call(self, context: str, timestep: float | None, signature: tuple, key: int | None = None) -> BranchState:
        """Return the state for a transformer call and advance its step counter.

        Args:
            context: Cache-context name announced by the pipeline (``"default"`` if none).
            timestep: The call's timestep as a float, if the model takes one (with ``key``: the scheduler's).
            signature: Shapes of the call's tensors; a change starts a new run.
            key: The scheduler clock's step index (:attr:`clock`): calls at one index are the branches of one step,
                and the run's start is the scheduler's, so the timestep's value is not needed.
        """
        track = self._contexts.get(context)
        if track is None:  # not ``setdefault``: every call would build (and drop) a new track
            track = self._contexts[context] = _ContextTrack()
        if key is not None:
            backwards, same_step, delta = False, track.last_key == key, None
        else:
            delta = None if timestep is None or track.last_timestep is None else timestep - track.last_timestep
            # A timestep that moves against the run's direction starts a new run (the sampler started over).
            backwards = delta is not None and track.direction != 0 and delta * track.direction < -_EPS
            same_step = delta is not None and abs(delta) <= _EPS
        # Only a step's first call is checked against the run's shapes: later branches of a step may legitimately
        # differ (SD3.5 skip-layer guidance adds a batch-1 forward after the batched CFG one).
        reshaped = not same_step and track.signature != signature
        if not track.started or reshaped or backwards:
            if track.started:
                self.epoch += 1  # this context started over: a new run of the sampler
            if track.branches:
                self._finished = self.branches()
            track.branches.clear()
            track.branch = 0
            track.direction = 0
            self.runs += 1
        elif same_step:
            track.branch += 1  # same timestep again: the next CFG branch of the same step
        else:
            track.branch = 0
            if delta is not None and track.direction == 0:
                track.direction = 1 if delta > 0 else -1
        track.started = True
        track.last_timestep = timestep
        track.last_key = key
        if track.branch == 0:
            track.signature = signature
        key = track.branch if self.separate_branches else 0
        state = track.branches.get(key)
        if state is None:
            state = track.branches[key] = BranchState()
        state.step += 1
        state.timestep = timestep
        self.active = state
        return state

    def end_call(self) -> None:
        """Mark the end of a transformer call."""
        self.active = None

    def branches(self) -> dict[str, BranchState]:
        """Every live branch state, named ``context`` or ``context/branch``."""
        out = {}
        for name, track in self._contexts.items():
            for index, state in sorted(track.branches.items()):
                out[name if index == 0 else f"{name}/{index}"] = state
        return out
