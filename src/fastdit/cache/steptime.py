"""A transformer call's place in the run — its step and timestep — read without waiting for the device.

The cache tells steps, CFG branches and runs apart by the timestep a transformer call receives. That is usually a
device tensor, and turning it into a Python float waits for every kernel queued before it: the host stops running
ahead, so every cached step — whose own device work is small — costs the host's whole time to issue it (measured on
one H200 with a FLUX.1-dev-sized model: a MagCache step that skips every block took 3.3 ms, against 131 ms for a
computed step). When the pipeline's scheduler keeps a host step index (:class:`~fastdit.cache.runs.SchedulerClock`),
the call's step is that index and its timestep, for forecasts, the scheduler's own; the device values are kept and
checked against the clock once the run is over, when reading them costs nothing:

* calls at one index are one step's branches, so their timesteps must be equal;
* the timesteps must be an affine function of the scheduler's (a forecast over the timestep is the same under any
  affine change of the variable: scale, offset and direction do not matter).

A pipeline that breaks either (a custom sampling loop, a timestep transformed non-linearly) gets a warning and the
exact read from then on. Host tensors and plain numbers are always read exactly: that costs nothing.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fastdit.cache.runs import SchedulerClock
from fastdit.errors import FastditWarning

__all__ = ["TimestepReader"]

# Records kept before they are checked even though the run goes on (a run without an end bounds its memory).
_MAX_RECORDS = 4096
# Relative deviation from the affine fit that still counts as rounding: half-precision timesteps (bf16 keeps 8 bits).
_AFFINE_TOLERANCE = 1e-2


@dataclass(frozen=True)
class _Record:
    run: int
    context: str
    key: int
    value: torch.Tensor  # the call's reduced timestep, still on the device
    position: float | None  # the scheduler's timestep the call was given


class TimestepReader:
    """Reads each call's timestep for one transformer's cache: from the scheduler clock when it can, else exactly.

    Args:
        reduce: Picks the entry of a timestep tensor that follows the schedule (``torch.amax`` or ``torch.amin``).
        owner: The transformer's class name, for the warning.

    Attributes:
        exact_devices: Device types whose tensors are read exactly (reading them does not wait for a device).
        exact: Set once the clock was found not to match the pipeline: every later read is exact.
    """

    exact_devices: frozenset[str] = frozenset({"cpu", "meta"})

    def __init__(self, reduce: Callable[[torch.Tensor], torch.Tensor], owner: str) -> None:
        self._reduce = reduce
        self._owner = owner
        self.exact = False
        self._records: list[_Record] = []

    def read(self, value: torch.Tensor, clock: SchedulerClock | None, context: str) -> tuple[float | None, int | None]:
        """The call's timestep and, when read from the clock, its step index (``None``: read exactly).

        Args:
            value: The timestep tensor the call received.
            clock: The run's :class:`~fastdit.cache.runs.SchedulerClock`, or ``None``.
            context: The call's cache context (the checks compare the calls of one context within one run: one
                clock serves one run).
        """
        if clock is not None and not self.exact and value.device.type not in self.exact_devices:
            key = clock.index()
            if key is not None:
                position = clock.timestep(key)
                reduced = self._reduce(value.detach()).float().reshape(())
                self._records.append(_Record(id(clock), context, key, reduced, position))
                if len(self._records) >= _MAX_RECORDS:
                    self.check()
                return position, key
        return float(self._reduce(value)), None

    def check(self) -> None:
        """Compare the recorded device timesteps with the clock (one read of them all); warn and turn exact on a
        mismatch."""
        records, self._records = self._records, []
        if not records or self.exact:
            return
        values = torch.stack([r.value for r in records]).cpu().tolist()
        problem = _mismatch(records, values)
        if problem is not None:
            self.exact = True
            warnings.warn(
                f"{self._owner}: {problem}, so the scheduler's step index does not tell this pipeline's steps apart; "
                "fastdit reads each call's timestep from the device from now on (exact, but a cached step then "
                "waits for the device). The run just finished may have grouped its calls into steps differently",
                FastditWarning,
                stacklevel=2,
            )


def _mismatch(records: list[_Record], values: list[float]) -> str | None:
    """What about the recorded calls contradicts the clock (``None``: nothing)."""
    last: dict[tuple[int, str], tuple[int, float]] = {}
    points: dict[int, list[tuple[float, float]]] = {}
    for record, value in zip(records, values, strict=True):
        previous = last.get((record.run, record.context))
        if previous is not None and previous[0] == record.key and abs(previous[1] - value) > 1e-9:
            return (
                f"two calls at scheduler step index {record.key} received different timesteps "
                f"({previous[1]:g} and {value:g})"
            )
        last[(record.run, record.context)] = (record.key, value)
        if record.position is not None:
            points.setdefault(record.run, []).append((record.position, value))
    for run_points in points.values():
        problem = _not_affine(run_points)
        if problem is not None:
            return problem
    return None


def _not_affine(points: list[tuple[float, float]]) -> str | None:
    """Whether the timesteps the calls received are an affine function of the scheduler's (up to rounding)."""
    positions = torch.tensor([p for p, _ in points], dtype=torch.float64)
    values = torch.tensor([v for _, v in points], dtype=torch.float64)
    if positions.unique().numel() < 2:
        return None
    design = torch.stack([positions, torch.ones_like(positions)], dim=1)
    solution = torch.linalg.lstsq(design, values.unsqueeze(1)).solution.squeeze(1)
    deviation = (design @ solution - values).abs().max().item()
    if deviation <= _AFFINE_TOLERANCE * max(values.abs().max().item(), 1e-12):
        return None
    return (
        f"the timesteps it received are not an affine function of the scheduler's (deviation {deviation:.3g} "
        "from the best affine fit)"
    )
