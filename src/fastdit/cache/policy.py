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

__all__ = ["PendingDrift", "Reducer", "check_run_length", "decide", "forced_decision", "l1_sums", "relative_l1"]

# Sums a small tensor across the ranks that share one sample (identity on one process).
Reducer = Callable[[torch.Tensor], torch.Tensor]


def l1_sums(current: torch.Tensor, previous: torch.Tensor, reduce: Reducer | None) -> torch.Tensor:
    """``[sum|current − previous|, sum|previous|]`` over every element (and every rank, with ``reduce``), summed in
    float32.

    The difference is taken in the tensors' own dtype and only the sums accumulate in float32: three passes over the
    hidden state instead of the nine a float32 copy of both operands takes (on a 1024² FLUX step's 25 MB bfloat16
    residual, ≈ 950 MB of traffic down to ≈ 125 MB). Rounding the difference to bfloat16 moves the relative drift by
    at most ≈ 0.4 %, far inside any threshold's resolution; float32 inputs (the CPU) lose nothing.

    Args:
        current: This step's tensor (a rank's slice of it under context parallelism).
        previous: What it is compared with, of the same shape.
        reduce: Sums the two values over the ranks that share a sample (``None``: one process).

    Returns:
        A two-element float32 tensor on the tensors' device; nothing is read on the host.
    """
    if current.dtype != previous.dtype:  # a forecast reference may carry another dtype: compare in float32
        current, previous = current.float(), previous.float()
    diff = torch.linalg.vector_norm(current - previous, ord=1, dtype=torch.float32)
    base = torch.linalg.vector_norm(previous, ord=1, dtype=torch.float32)
    sums = torch.stack([diff, base])
    return reduce(sums) if reduce is not None else sums


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else float("inf")


def relative_l1(current: torch.Tensor, previous: torch.Tensor, reduce: Reducer | None = None) -> float:
    """``mean|current − previous| / mean|previous|`` over every element (and every rank, with ``reduce``)."""
    return _ratio(*l1_sums(current, previous, reduce).tolist())


class PendingDrift:
    """A relative-L1 change on its way to the host, read one step after it was measured.

    DBCache's decision ahead sends the front residual's drift this way, TeaCache's the change of its signal. On a
    CUDA device the two sums are copied into pinned host memory behind the kernels that make them; by the next
    step's decision those kernels are long done, so the read waits for nothing. Elsewhere the value is read at once
    (a host tensor costs nothing to read).

    Args:
        sums: ``[sum|r − ref|, sum|ref|]`` (reduced across the ranks that share a sample).
        step: The step it was measured at.
        reference_step: The step of the tensor it was measured against.
        buffer: A pinned two-element float32 host tensor to copy into (CUDA only; reused step after step).
    """

    def __init__(self, sums: torch.Tensor, step: int, reference_step: int, buffer: torch.Tensor | None) -> None:
        self.step = step
        self.reference_step = reference_step
        self.buffer: torch.Tensor | None = None
        self._event = None
        if sums.device.type == "cuda" and buffer is not None:
            buffer.copy_(sums, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            self.buffer = buffer
        else:
            self._values = sums.tolist()

    @classmethod
    def launch(cls, sums: torch.Tensor, step: int, reference_step: int, previous: PendingDrift | None) -> PendingDrift:
        """Send ``sums`` on their way, into ``previous``'s pinned buffer (read already) or a new one on CUDA.

        Args:
            sums: As for the constructor.
            step: As for the constructor.
            reference_step: As for the constructor.
            previous: The last change sent by the same branch, whose value the host has read (``None``: none yet).
        """
        buffer = previous.buffer if previous is not None else None
        if buffer is None and sums.device.type == "cuda":
            buffer = torch.empty(2, dtype=torch.float32, pin_memory=True)
        return cls(sums, step, reference_step, buffer)

    def drift(self) -> float:
        """The relative-L1 drift (waits for the copy only if its kernels have not run yet)."""
        if self._event is not None:
            self._event.synchronize()
            self._values = self.buffer.tolist()
            self._event = None
        return _ratio(*self._values)


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
    cached steps accumulates until it crosses the threshold. With :attr:`DBCache.decide_ahead` the comparison is the
    previous step's, carried to this one (:func:`_drift_ahead`).
    """
    has_cache = state.front_residual is not None and state.has_cache
    forced = forced_decision(config, state, has_cache)
    diff: float | None = None
    if has_cache and state.front_residual.shape == residual.shape:
        if config.decide_ahead:
            diff = _drift_ahead(config, state, residual, reduce)
            if diff is None and forced is None:
                forced = True  # no drift measured yet since the reference: nothing to carry forward
        else:
            diff = relative_l1(residual, _reference(config, state), reduce)
    elif has_cache:
        forced = True  # shape changed inside a run (should not happen): never reuse a mismatched residual
    compute = forced if forced is not None else not (diff is not None and diff < config.threshold)
    state.diffs.append(diff)
    if compute:
        state.continuous_cached = 0
        state.front_residual = residual
        state.reference_step = state.step
        taylor = config.taylorseer
        if taylor is not None and taylor.forecast_decision:
            position = taylor_position(taylor, state.step, state.timestep)
            forecast_update(taylor, state.front_forecast, residual, position, state.step)
    else:
        state.continuous_cached += 1
        state.cached_steps.append(state.step)
    state.computing = compute
    return compute


def _drift_ahead(config: DBCache, state: BranchState, residual: torch.Tensor, reduce: Reducer | None) -> float | None:
    """This step's drift from the reference, predicted from the last one measured; then measure this step's.

    The last measurement (step ``j``, against the reference of step ``c``) gives a drift rate per step,
    ``drift / (j − c)``; the prediction is that rate times this step's distance from the current reference. A
    measurement taken before the reference moved still gives a rate (the drift that made the step compute). This
    step's own drift is launched now and read at the next decision, so no decision waits for the device; every rank
    launches the same reduction at the same step, and reads the same reduced value.
    """
    pending = state.pending_drift
    predicted = None
    if pending is not None and pending.step > pending.reference_step:
        rate = pending.drift() / (pending.step - pending.reference_step)
        predicted = rate * (state.step - state.reference_step)
    sums = l1_sums(residual, _reference(config, state), reduce)
    state.pending_drift = PendingDrift.launch(sums, state.step, state.reference_step, pending)
    return predicted
