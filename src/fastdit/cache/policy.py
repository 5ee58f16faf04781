"""When to skip the middle blocks: the DBCache decision as a pure function of host values.

Everything here runs outside compiled code and takes only Python numbers, so under context or tensor parallelism
every rank reaches the same decision once the residual difference has been reduced across ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fastdit.cache.forecast import forecast_predict, forecast_update
from fastdit.cache.state import BranchState
from fastdit.cache.taylorseer import taylor_position
from fastdit.config import DBCache, StepMask
from fastdit.errors import FieldError

__all__ = ["Reducer", "check_run_length", "decide", "forced_decision", "relative_l1"]

# Sums a small tensor across the ranks that share one sample (identity on one process).
Reducer = Callable[[torch.Tensor], torch.Tensor]


def relative_l1(current: torch.Tensor, previous: torch.Tensor, reduce: Reducer | None = None) -> float:
    """``mean|current − previous| / mean|previous|`` over every element (and every rank, with ``reduce``)."""
    a = current.float()
    b = previous.float()
    sums = torch.stack([(a - b).abs().sum(), b.abs().sum()])
    if reduce is not None:
        sums = reduce(sums)
    num, den = sums.tolist()
    return num / den if den > 0 else float("inf")


def check_run_length(mask: StepMask | None, steps: int, *, reached: bool = False) -> None:
    """Refuse a run longer than the one ``mask`` was laid out for (:attr:`StepMask.num_steps`).

    Called with the run's length when it is known up front, and with each step's count as the run goes (the step
    counter is global state, equal on every rank, so every rank raises at the same step).

    Args:
        mask: The cache's step mask (``None`` or one without ``num_steps``: nothing to check).
        steps: The run's number of steps, or with ``reached`` the number of steps it has reached so far.
        reached: ``steps`` counts the steps reached so far (the run may have more) instead of the whole run.

    Raises:
        FieldError: Owner ``StepMask``, field ``num_steps``: the run has more steps than the mask.
    """
    if mask is None or mask.num_steps is None or steps <= mask.num_steps:
        return
    run = f"more than {steps - 1} steps" if reached else f"{steps} steps"
    fix = f"StepMask.preset(name, {steps})" if not reached else "StepMask.preset(name, num_steps)"
    raise FieldError(
        "StepMask",
        "num_steps",
        mask.num_steps,
        f"the mask was laid out for a run of {mask.num_steps} steps, this run has {run}; lay it out for this run "
        f"({fix}) or leave num_steps unset to let the steps past the mask follow its policy",
    )


def forced_decision(config: DBCache, state: BranchState, has_cache: bool) -> bool | None:
    """Decide from the schedule alone: ``True`` compute, ``False`` cache, ``None`` let the residual test decide."""
    step = state.step
    if not has_cache:
        return True
    mask = config.step_mask
    if mask is not None:
        if step in mask.compute_steps:
            return True
        if mask.policy == "static":
            return False
    if step < config.warmup_steps and step % config.warmup_interval == 0:
        return True
    if config.max_cached_steps is not None and len(state.cached_steps) >= config.max_cached_steps:
        return True
    if config.max_continuous_cached_steps is not None and state.continuous_cached >= config.max_continuous_cached_steps:
        return True
    return None


def _reference(config: DBCache, state: BranchState) -> torch.Tensor:
    """What the current front residual is compared with: the last computed one, or its Taylor forecast."""
    taylor = config.taylorseer
    if taylor is not None and taylor.forecast_decision and state.front_forecast.ready:
        position = taylor_position(taylor, state.step, state.timestep)
        return forecast_predict(taylor, state.front_forecast, position)
    return state.front_residual


def decide(config: DBCache, state: BranchState, residual: torch.Tensor, reduce: Reducer | None) -> bool:
    """Return whether this step computes the middle blocks, and record the step in ``state``.

    The residual of the front blocks is compared with the one of the last *computed* step, so slow drift over several
    cached steps accumulates until it crosses the threshold.
    """
    has_cache = state.front_residual is not None and state.has_cache
    forced = forced_decision(config, state, has_cache)
    diff: float | None = None
    if has_cache and state.front_residual.shape == residual.shape:
        diff = relative_l1(residual, _reference(config, state), reduce)
    elif has_cache:
        forced = True  # shape changed inside a run (should not happen): never reuse a mismatched residual
    compute = forced if forced is not None else not (diff is not None and diff < config.threshold)
    state.diffs.append(diff)
    if compute:
        state.continuous_cached = 0
        state.front_residual = residual
        taylor = config.taylorseer
        if taylor is not None and taylor.forecast_decision:
            position = taylor_position(taylor, state.step, state.timestep)
            forecast_update(taylor, state.front_forecast, residual, position, state.step)
    else:
        state.continuous_cached += 1
        state.cached_steps.append(state.step)
    state.computing = compute
    return compute
