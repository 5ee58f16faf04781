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
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from fastdit.cache.state import RunTracker

__all__ = ["Resettable", "reset_on_new_schedule", "scheduled_steps"]


def scheduled_steps(scheduler: Any) -> int | None:
    """How many denoiser calls per branch the scheduler's current timesteps give (``None`` if it does not say).

    One call per timestep (second-order samplers list the intermediate ones too), from the begin index that
    image-to-image pipelines set to skip the first timesteps (``strength``).
    """
    timesteps = getattr(scheduler, "timesteps", None)
    try:
        count = len(timesteps)
    except TypeError:  # not set yet, or not a sequence
        return None
    begin = getattr(scheduler, "begin_index", None)
    return count - begin if isinstance(begin, int) and 0 <= begin <= count else count


class Resettable(Protocol):
    """Per-run state that a new run clears (a :class:`RunTracker`, a once-per-run check)."""

    def reset(self) -> None: ...


def reset_on_new_schedule(pipeline: Any, trackers: Sequence[Resettable]) -> Callable[[], None] | None:
    """End the trackers' runs whenever ``pipeline``'s scheduler sets new timesteps; return the undo.

    :class:`RunTracker` s also learn how many steps the new run has (:attr:`RunTracker.schedule`).

    Returns ``None`` (nothing installed) for a bare module or a pipeline without a scheduler; the trackers' own
    run detection (timestep direction, input shapes) then remains the only boundary.
    """
    scheduler = getattr(pipeline, "scheduler", None)
    original = getattr(scheduler, "set_timesteps", None)
    if scheduler is None or not callable(original) or not trackers:
        return None
    own = "set_timesteps" in vars(scheduler)  # someone set an instance attribute before us: put it back on undo

    # Pipelines inspect set_timesteps' signature for the arguments it takes (sigmas, mu ...): keep it visible.
    # With several denoisers (Wan 2.2's two experts) each one runs only part of the schedule: its length says
    # nothing about one denoiser's steps, and only their own step counters check the mask.
    runs = [tracker for tracker in trackers if isinstance(tracker, RunTracker)]
    schedule = functools.partial(scheduled_steps, scheduler) if len(runs) == 1 else None

    @functools.wraps(original)
    def set_timesteps(*args: Any, **kwargs: Any) -> Any:
        for tracker in trackers:
            tracker.reset()
        result = original(*args, **kwargs)
        for tracker in runs:
            tracker.schedule = schedule
        return result

    scheduler.set_timesteps = set_timesteps

    def undo() -> None:
        if own:
            scheduler.set_timesteps = original
        else:
            vars(scheduler).pop("set_timesteps", None)

    return undo
