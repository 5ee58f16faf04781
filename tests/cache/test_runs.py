"""Run boundaries from the scheduler: its ``set_timesteps`` ends the last run, also in the scheduler's copies."""

from __future__ import annotations

import copy
import inspect

import fastdit
from fastdit.testing.pipelines import build_tiny


def test_a_deep_copied_scheduler_sets_its_own_timesteps() -> None:
    """LTX-2 deep-copies the pipeline's scheduler for its audio latents: the copy must not drive the original."""
    pipe, _ = build_tiny("flux")
    fastdit.accelerate(pipe, cache=fastdit.DBCache(fn=1, bn=0))
    try:
        original = pipe.scheduler
        wrapped = original.set_timesteps
        assert "sigmas" in inspect.signature(wrapped).parameters  # pipelines look for the arguments it takes
        original.set_timesteps(4)
        duplicate = copy.deepcopy(original)
        duplicate.set_timesteps(7)
        assert (len(duplicate.timesteps), len(original.timesteps)) == (7, 4)
        assert original.set_timesteps is wrapped
    finally:
        fastdit.disable(pipe)
    assert "set_timesteps" not in vars(pipe.scheduler)
