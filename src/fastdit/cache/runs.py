"""An exact start for every run: a pipeline call begins by setting its scheduler's timesteps.

Pipelines reset their stateful hooks at the *end* of ``__call__``; a call that raises before its end (an interrupt
in a step callback, an out-of-memory error) never gets there, and the next call would continue the broken run —
its first timestep then looks like a second CFG branch of the interrupted step, and its later steps reuse the
interrupted run's residuals. Every diffusers pipeline sets the scheduler's timesteps before its first transformer
call, so that call is where a run starts, whatever happened to the last one.

The timesteps also tell how many steps the run will take, so a step mask laid out for fewer steps is refused at the
run's first step instead of part-way through (:func:`scheduled_steps`).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from fastdit.cache.spectral import scheduled_sigma
from fastdit.cache.state import RunTracker

__all__ = ["Resettable", "SchedulerClock", "reset_on_new_schedule", "scheduled_steps"]


def scheduled_steps(scheduler: Any) -> int | None:
    """At most how many denoiser calls per branch the scheduler's current schedule gives (``None``: it does not say).

    A lower bound of the run's real length, never above it, so a run it refuses is longer than the mask for sure
    (the step counter refuses the rest exactly): at most one call per timestep and per inference step — Sana
    Sprint's SCM schedule lists a final timestep its pipeline never calls, second-order samplers list their
    intermediate ones — from the begin index image-to-image pipelines set to skip the first steps (``strength``).
    """
    timesteps = getattr(scheduler, "timesteps", None)
    try:
        count = len(timesteps)
    except TypeError:  # not set yet, or not a sequence
        return None
    steps = getattr(scheduler, "num_inference_steps", None)
    if isinstance(steps, int) and steps > 0:
        count = min(count, steps)
    begin = getattr(scheduler, "begin_index", None)
    order = getattr(scheduler, "order", 1)
    if isinstance(begin, int) and begin > 0 and isinstance(order, int) and order > 0:
        count -= begin // order  # the begin index counts timesteps, ``order`` of them per step
    return max(count, 0)


class SchedulerClock:
    """Where the pipeline is in its schedule, read on the host from its scheduler: no device synchronisation.

    A transformer's timestep is usually a device tensor; turning it into a Python float waits for every kernel queued
    before it, so a cached step — whose own work is small — would cost the host's whole time to issue it. The
    scheduler knows the same thing on the host: its ``step_index`` (advanced by every ``step()``) names the step,
    and its ``timesteps``, copied to the host once per run, give the step's position for forecasts. A pipeline that
    calls the transformer at another timestep than the scheduler's, or several times between two scheduler steps at
    different timesteps, is caught when the run's real timesteps are checked against the clock at its end
    (:class:`fastdit.cache.hooks.TransformerCacheHook`).
    """

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self._timesteps: list[float] | None = None

    @staticmethod
    def supports(scheduler: Any) -> bool:
        """Whether ``scheduler`` keeps a host step index (most diffusers schedulers; DDIM-like ones do not)."""
        return isinstance(getattr(type(scheduler), "step_index", None), property)

    def index(self) -> int | None:
        """The schedule index of the current step (``None`` when the scheduler does not tell)."""
        index = getattr(self.scheduler, "step_index", None)
        if index is None:  # before the run's first step(): the schedule starts at the begin index
            begin = getattr(self.scheduler, "begin_index", None)
            index = begin if begin is not None else 0
        return index if isinstance(index, int) and not isinstance(index, bool) else None

    def timestep(self, index: int) -> float | None:
        """The scheduler's timestep at ``index`` (``None`` outside the schedule); the first call copies them."""
        if self._timesteps is None:
            timesteps = getattr(self.scheduler, "timesteps", None)
            try:
                self._timesteps = [float(t) for t in timesteps.tolist()]
            except (AttributeError, TypeError):
                self._timesteps = []
        return self._timesteps[index] if 0 <= index < len(self._timesteps) else None


class Resettable(Protocol):
    """Per-run state that a new run clears (a :class:`RunTracker`, a once-per-run check)."""

    def reset(self) -> None: ...


class _ResetOnNewSchedule:
    """A scheduler's ``set_timesteps`` (set on the instance) that first ends the trackers' runs.

    A deep copy of the scheduler (LTX-2 copies the pipeline's scheduler for its audio latents) gets its class's
    plain ``set_timesteps`` bound to the copy: a copied wrapper would still call the original scheduler's method,
    so the copy would never get timesteps of its own and the original would be set twice.
    """

    def __init__(
        self, scheduler: Any, original: Callable[..., Any], trackers: Sequence[Resettable], runs: list[RunTracker]
    ) -> None:
        functools.update_wrapper(self, original)  # pipelines inspect the signature (sigmas, mu ...): keep it visible
        self.scheduler = scheduler
        self.original = original
        self.trackers = list(trackers)
        self.runs = runs
        # With several denoisers (Wan 2.2's two experts) each one runs only part of the schedule: its length says
        # nothing about one denoiser's steps, and only their own step counters check the mask.
        self.schedule = functools.partial(scheduled_steps, scheduler) if len(runs) == 1 else None
        self.clock = SchedulerClock.supports(scheduler)
        # The noise level holds for every denoiser, each reading it at the steps it serves.
        self.sigma = functools.partial(scheduled_sigma, scheduler)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        for tracker in self.trackers:
            tracker.reset()
        result = self.original(*args, **kwargs)
        clock = SchedulerClock(self.scheduler) if self.clock else None  # one per run: its own timesteps
        for tracker in self.runs:
            tracker.schedule = self.schedule
            tracker.clock = clock
            tracker.sigma = self.sigma
        return result

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        copy = memo.get(id(self.scheduler))
        if copy is None:  # the wrapper copied on its own, not as part of its scheduler
            return self
        return types.MethodType(type(copy).set_timesteps, copy)


def reset_on_new_schedule(pipeline: Any, trackers: Sequence[Resettable]) -> Callable[[], None] | None:
    """End the trackers' runs whenever ``pipeline``'s scheduler sets new timesteps; return the undo.

    :class:`RunTracker` s also learn how many steps the new run has (:attr:`RunTracker.schedule`) and where to read
    each step's noise level (:attr:`RunTracker.sigma`).

    Returns ``None`` (nothing installed) for a bare module or a pipeline without a scheduler; the trackers' own
    run detection (timestep direction, input shapes) then remains the only boundary.
    """
    scheduler = getattr(pipeline, "scheduler", None)
    original = getattr(scheduler, "set_timesteps", None)
    if scheduler is None or not callable(original) or not trackers:
        return None
    own = "set_timesteps" in vars(scheduler)  # someone set an instance attribute before us: put it back on undo
    runs = [tracker for tracker in trackers if isinstance(tracker, RunTracker)]
    scheduler.set_timesteps = _ResetOnNewSchedule(scheduler, original, trackers, runs)

    def undo() -> None:
        if own:
            scheduler.set_timesteps = original
        else:
            vars(scheduler).pop("set_timesteps", None)

    return undo
