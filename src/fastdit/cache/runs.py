"""An exact start for every run: a pipeline call begins by setting its scheduler's timesteps.

Pipelines reset their stateful hooks at the *end* of ``__call__``; a call that raises before its end (an interrupt
in a step callback, an out-of-memory error) never gets there, and the next call would continue the broken run —
its first timestep then looks like a second CFG branch of the interrupted step, and its later steps reuse the
interrupted run's residuals. Every diffusers pipeline sets the scheduler's timesteps before its first transformer
call, so that call is where a run starts, whatever happened to the last one.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Sequence
from typing import Any

from fastdit.cache.state import RunTracker

__all__ = ["reset_on_new_schedule"]


def reset_on_new_schedule(pipeline: Any, trackers: Sequence[RunTracker]) -> Callable[[], None] | None:
    """End the trackers' runs whenever ``pipeline``'s scheduler sets new timesteps; return the undo.

    Returns ``None`` (nothing installed) for a bare module or a pipeline without a scheduler; the trackers' own
    run detection (timestep direction, input shapes) then remains the only boundary.
    """
    scheduler = getattr(pipeline, "scheduler", None)
    if scheduler is None or not callable(getattr(scheduler, "set_timesteps", None)) or not trackers:
        return None
    previous = vars(scheduler).get("set_timesteps")  # an instance attribute someone set before us, if any
    unbound = type(scheduler).set_timesteps

    # Pipelines inspect set_timesteps' signature for the arguments it takes (sigmas, mu ...): keep it visible.
    @functools.wraps(unbound)
    def set_timesteps(self: Any, *args: Any, **kwargs: Any) -> Any:
        for tracker in trackers:
            tracker.reset()
        return previous(*args, **kwargs) if previous is not None else unbound(self, *args, **kwargs)

    # A bound method, not a closure over this scheduler: a deep copy of the scheduler (LTX-2 copies it for its audio
    # stream) rebinds it to the copy, which then sets its own timesteps.
    scheduler.set_timesteps = types.MethodType(set_timesteps, scheduler)

    def undo() -> None:
        if previous is not None:
            scheduler.set_timesteps = previous
        else:
            vars(scheduler).pop("set_timesteps", None)

    return undo
