"""What the whole-step caches (MagCache, TeaCache) share: a step decided before its blocks run, and calibration runs
that record something about the residual each computed step produced.

The block hooks are DBCache's (:mod:`fastdit.cache.hooks`); an engine of this kind only differs in *when* it decides
(before the first block, from host values equal on every rank) and in what its calibration records (:meth:`_record`).
"""

from __future__ import annotations

import torch

from fastdit.cache.hooks import CacheEngine
from fastdit.cache.state import BranchState

__all__ = ["WholeStepEngine", "segment_residuals"]


def segment_residuals(state: BranchState) -> list[torch.Tensor]:
    """The hidden-stream residual each middle segment added in the step just computed, in segment order."""
    return [memory.hidden_residual for _, memory in sorted(state.segments.items())]


class WholeStepEngine(CacheEngine):
    """A step cache that decides whole steps ahead of their blocks; subclasses decide and record."""

    def settle(self, state: BranchState, compute: bool, measure: float | None) -> None:
        """Note the step's decision: computed, or served from the cache with ``measure`` (the policy's statistic)."""
        state.diffs.append(None if compute else measure)
        if not compute:
            state.cached_steps.append(state.step)
        state.computing = compute

    def decide(self, state: BranchState, residual: torch.Tensor) -> None:
        """Nothing to do: the step was decided before its first block (the front residual is not needed)."""

    def end_call(self) -> None:
        """End the call; a calibration run records what the step it computed tells (:meth:`_record`)."""
        state = self.tracker.active
        try:
            if state is not None and self.config.calibrate and state.computing and state.has_cache:
                self._record(state)
        finally:
            super().end_call()

    def _record(self, state: BranchState) -> None:
        raise NotImplementedError
