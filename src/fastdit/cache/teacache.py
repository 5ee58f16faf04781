"""TeaCache: skip whole steps while the accumulated, rescaled change of the block stack's input stays small.

A step's blocks are costly, their input is not: it exists before the first block runs. How much that input changed
since the previous step (relative L1 over every element) predicts how much the residual the blocks add would
change, through a polynomial fitted once per model (:class:`~fastdit.config.TeaCalibration`: a calibration run
records ``(input change, residual change)`` at every step, :func:`fit_calibration` fits ``numpy.polyfit``). A run
adds the rescaled change of each step to an accumulator (:func:`tea_decide`) and reuses the last computed residual
(or its TaylorSeer forecast) while the accumulator stays under the threshold; a computed step restarts it.

The input is the first block's ``hidden_states`` as the adapter names them — the same argument for every family,
so no model needs code of its own. (TeaCache proper measures the timestep-modulated input of the first block, which
sits inside each family's block code; the calibrated polynomial absorbs the difference in scale, not in shape, so
the timestep's own contribution is missing — see ``docs/cache.md``.)

``signal="spectral"`` measures the change of another input: a Wiener estimate of the clean latent, the noisy
latent the transformer receives filtered over its grid with a gain that follows the step's noise level
(:mod:`fastdit.cache.spectral`). It reads the latent where the transformer call begins, before any block, and
accumulates the raw change unless a calibration of that signal rescales it.

Under context parallelism each rank holds a slice of the input: the two sums of the relative L1 are reduced over
the ranks that share a sample (``context.cache_reducer``) before the host reads them, so every rank accumulates the
same number and takes the same branch. The spectral signal's latent is whole on every rank; its sums are reduced
all the same, so that every rank reads the one float the reduction returns.

With :attr:`~fastdit.config.TeaCache.decide_ahead` the two sums are not read at the step that measures them: they
are sent to the host (:class:`~fastdit.cache.policy.PendingDrift`) and read at the next step, whose decision takes
the change they carry for its own and corrects the accumulator with it (:func:`tea_decide_ahead`). Every rank sends
the same reduction at the same step and reads it at the same later one, so the decisions stay equal across ranks.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastdit.cache.policy import PendingDrift, Reducer, l1_sums, relative_l1
from fastdit.cache.spectral import latent_axes, noise_to_signal, spectral_estimate, timestep_sigma
from fastdit.cache.state import BranchState
from fastdit.cache.whole_step import WholeStepEngine, segment_residuals
from fastdit.config import TeaCache, TeaCalibration
from fastdit.errors import FieldError
from fastdit.models.base import LatentLayout

__all__ = [
    "CALIBRATION_FORMAT",
    "DEFAULT_DEGREE",
    "TeaAccumulator",
    "TeaCacheEngine",
    "check_latent",
    "fit_calibration",
    "load_calibration",
    "reference_calibration",
    "reference_calibration_path",
    "rescaled",
    "retained_steps",
    "save_calibration",
    "tea_decide",
    "tea_decide_ahead",
    "video_reference_calibration",
    "video_reference_calibration_path",
]

CALIBRATION_FORMAT = "fastdit.teacache/1"
"""The ``format`` entry of a TeaCache calibration file."""

DEFAULT_DEGREE = 4
"""Degree of the fitted polynomial unless asked otherwise (TeaCache's own choice)."""


@dataclass
class TeaAccumulator:
    """What TeaCache keeps per branch: the accumulated change since the last computed step, and the last input."""

    accumulated: float = 0.0
    skipped: int = 0
    # The run's length (from the scheduler at its first step; the calibration's where none tells).
    num_steps: int | None = None
    # The previous step's measured input: the first block's, or (spectral signal) the clean-latent estimate.
    previous_input: torch.Tensor | None = None
    # This step's relative L1 input change (None at the first step).
    distance: float | None = None
    # Calibration: the residual segments of the last computed step and the (x, y) pairs recorded so far.
    residuals: list[torch.Tensor] = field(default_factory=list)
    pairs: list[tuple[float, float]] = field(default_factory=list)
    # decide_ahead: the change sent to the host at the step it was measured (read at the next step), the previous
    # step's change as this step read it (None when none was measured), and the estimate this step decided on.
    pending: PendingDrift | None = None
    lagged: float | None = None
    estimate: float | None = None

    def restart(self) -> None:
        """Start accumulating afresh (after a computed step)."""
        self.accumulated, self.skipped = 0.0, 0


def retained_steps(config: TeaCache, num_steps: int) -> int:
    """The first steps that always compute: ``retention_ratio`` of the run, rounded to the nearest step."""
    return int(config.retention_ratio * num_steps + 0.5)


def rescaled(config: TeaCache, distance: float) -> float:
    """What a measured change adds to the accumulator: its calibrated image, or itself without a calibration."""
    return distance if config.calibration is None else config.calibration.rescale(distance)


def _forced(config: TeaCache, acc: TeaAccumulator, step: int, distance: float | None, has_cache: bool) -> bool:
    """Whether step ``step`` computes whatever the accumulator holds (``distance``: the change it would add)."""
    num_steps = acc.num_steps
    return (
        not has_cache
        or config.threshold == 0  # the no-op setting: never skip
        or (config.calibration is None and config.signal == "input")
        or distance is None
        or not math.isfinite(distance)  # the previous input was all zeros: nothing to compare with
        or (num_steps is not None and step < retained_steps(config, num_steps))
        # The scheduler's count may fall short of the steps taken (second-order samplers): without final steps to
        # keep, the steps past it decide like any other.
        or (num_steps is not None and config.final_steps > 0 and step >= num_steps - config.final_steps)
    )


def tea_decide(config: TeaCache, acc: TeaAccumulator, step: int, distance: float | None, has_cache: bool) -> bool:
    """Whether step ``step`` computes (``True``) or reuses the cached residual; updates ``acc``.

    Args:
        config: The settings (with a calibration whenever ``threshold > 0`` and ``signal="input"``).
        acc: The branch's accumulator (``acc.num_steps``: the run's length, ``None`` if unknown).
        step: 0-based step index.
        distance: The relative L1 change of the stack's input since the previous step, reduced over the ranks
            (``None`` at the first step).
        has_cache: Whether a residual of an earlier computed step is there to reuse.
    """
    if not _forced(config, acc, step, distance, has_cache):
        acc.accumulated += rescaled(config, distance)
        acc.skipped += 1
        if acc.accumulated < config.threshold and acc.skipped <= config.max_skip_steps:
            return False
    acc.restart()
    return True


def tea_decide_ahead(config: TeaCache, acc: TeaAccumulator, step: int, lagged: float | None, has_cache: bool) -> bool:
    """:func:`tea_decide` for :attr:`TeaCache.decide_ahead`: step ``step`` decided before its own change is read.

    ``acc.accumulated`` holds the exact sum of the rescaled changes since the last computed step, through step
    ``step − 1``: the previous step's change, arriving now, first takes its place there if that step was skipped (a
    computed step restarts the sum, as without deciding ahead). The same change then stands in for this step's own,
    so the decision compares ``accumulated + rescaled(lagged)`` with the threshold, and stores it in
    ``acc.estimate``. Each estimate is replaced by the true value a step later, so the lag never compounds: a
    decision differs from :func:`tea_decide`'s only where this step's change differs from the previous one.

    Args:
        config: As for :func:`tea_decide`.
        acc: As for :func:`tea_decide`; ``acc.skipped > 0`` tells that the previous step was skipped.
        step: 0-based step index.
        lagged: The relative L1 change measured at step ``step − 1`` (against step ``step − 2``), reduced over the
            ranks; ``None`` when none was (the first two steps).
        has_cache: Whether a residual of an earlier computed step is there to reuse.
    """
    if acc.skipped > 0 and lagged is not None:
        acc.accumulated += rescaled(config, lagged)
    acc.estimate = None
    if not _forced(config, acc, step, lagged, has_cache):
        acc.estimate = acc.accumulated + rescaled(config, lagged)
        acc.skipped += 1
        if acc.estimate < config.threshold and acc.skipped <= config.max_skip_steps:
            return False
    acc.restart()
    return True


def _residual_change(current: list[torch.Tensor], previous: list[torch.Tensor], reduce: Reducer | None) -> float:
    """Relative L1 change of the residual over every segment (and every rank, with ``reduce``)."""
    sums = torch.stack(
        [
            torch.stack([(c.float() - p.float()).abs().sum() for c, p in zip(current, previous, strict=True)]).sum(),
            torch.stack([p.float().abs().sum() for p in previous]).sum(),
        ]
    )
    if reduce is not None:
        sums = reduce(sums)
    num, den = sums.tolist()
    return num / den if den > 0 else float("inf")


def check_latent(latent: Any, layout: LatentLayout, family: str = "") -> None:
    """Refuse a latent the declared layout does not fit, naming the family, the argument and the axis.

    A wrong declaration would otherwise filter over the channels (or across items) and measure a signal nobody chose,
    or fail inside the FFT with a message that names neither.

    Raises:
        FieldError: Owner ``TeaCache``, field ``signal``.
    """
    owner = f"the {family!r} adapter" if family else "the adapter"
    declared = f"{owner} declares its latent as {layout.describe()}"
    if not isinstance(latent, torch.Tensor):
        raise FieldError(
            "TeaCache", "signal", "spectral", f"{declared}, but the transformer got {type(latent).__name__} for it"
        )
    try:
        latent_axes(latent.shape, layout.channel_dim, layout.item_dims)
    except ValueError as exc:
        raise FieldError(
            "TeaCache", "signal", "spectral", f"{declared}, which does not fit the tensor it got: {exc}"
        ) from None


class TeaCacheEngine(WholeStepEngine):
    """The step cache of one transformer with TeaCache's decision (the block hooks are DBCache's).

    The decision is taken when the step's first block is called (:meth:`enter_stack`), before it runs: with
    ``fn=0`` that block is a middle block, which then computes or passes through with the rest.
    """

    def begin_call(self, context: str, timestep: float | None, signature: tuple, key: int | None = None) -> None:
        """Start a transformer call; the step computes unless :meth:`enter_stack` decides otherwise."""
        state = self.tracker.begin_call(context, timestep, signature, key)
        state.blocks_total += self.num_blocks
        if state.step == 0 or state.policy is None:
            state.policy = TeaAccumulator(num_steps=self._run_length())
        acc = state.policy
        acc.distance = None
        # Read before this step sends its own change (into the same pinned buffer): the previous step's kernels
        # were issued a whole step ago, so on a GPU the read finds them done.
        pending = acc.pending
        acc.lagged = pending.drift() if self._ahead and pending is not None and pending.step == state.step - 1 else None
        state.computing = True

    def _run_length(self) -> int | None:
        scheduled = self.tracker.schedule() if self.tracker.schedule is not None else None
        if scheduled is not None:
            return scheduled
        calibration = self.config.calibration
        return calibration.num_steps if calibration is not None else None

    @property
    def reads_latent(self) -> bool:
        """Whether the signal is the spectral one (measured on each call's noisy latent)."""
        return self.config.signal == "spectral"

    @property
    def _ahead(self) -> bool:
        # A calibration run computes every step and records each step's own change: nothing to decide ahead.
        return self.config.decide_ahead and not self.config.calibrate

    def _measure(self, state: BranchState, current: torch.Tensor, previous: torch.Tensor) -> None:
        """This step's change of the signal: read now, or (deciding ahead) sent to the host to be read next step."""
        acc = state.policy
        if self._ahead:
            # Reduced now, at the same step on every rank, so that every rank reads the same float next step.
            sums = l1_sums(current, previous, self.reducer)
            acc.pending = PendingDrift.launch(sums, state.step, state.step - 1, acc.pending)
        else:
            acc.distance = relative_l1(current, previous, self.reducer)  # reduced: the same float on every rank

    def _measures(self) -> bool:
        config = self.config
        if config.calibrate:
            return True
        return config.threshold > 0 and (config.calibration is not None or config.signal == "spectral")

    def observe_latent(self, latent: Any, layout: LatentLayout, family: str = "") -> None:
        """Measure the spectral signal's change on the call's noisy latent (before any block runs).

        Args:
            latent: The value of the declared argument in this call.
            layout: Where the family declares its latent (:attr:`~fastdit.models.base.ModelAdapter.latent`).
            family: The family's name, for messages.

        Raises:
            FieldError: Owner ``TeaCache``, field ``signal``: the latent is no tensor, or the declared layout does not
                fit it (naming the family, the argument and the axis), or the step's noise level is unknown (no
                scheduler and no timestep).
        """
        state = self.tracker.active
        assert state is not None and isinstance(state.policy, TeaAccumulator)
        acc = state.policy
        if not self._measures():
            return
        check_latent(latent, layout, family)
        estimate = spectral_estimate(
            latent, self._noise_to_signal(state), self.config.spectral_exponent, layout.channel_dim, layout.item_dims
        )
        previous = acc.previous_input
        if previous is not None and previous.shape == estimate.shape:
            self._measure(state, estimate, previous)
        acc.previous_input = estimate

    def _noise_to_signal(self, state: BranchState) -> float:
        found = self.tracker.sigma(state.timestep) if self.tracker.sigma is not None else None
        if found is not None:
            sigma, flow = found
            return noise_to_signal(sigma, flow=flow)
        if state.timestep is None:
            raise FieldError(
                "TeaCache",
                "signal",
                "spectral",
                "needs each step's noise level: run it in a pipeline whose scheduler has sigmas, or on a model that "
                "takes a timestep",
            )
        return noise_to_signal(timestep_sigma(state.timestep))

    def enter_stack(self, state: BranchState, hidden: torch.Tensor) -> None:
        """Measure the input change since the previous step and decide whether this step computes.

        With the spectral signal the change was measured when the call began (:meth:`observe_latent`). Deciding
        ahead (:attr:`TeaCache.decide_ahead`), this step's change is only sent on its way, and the previous step's
        (read in :meth:`begin_call`) decides (:func:`tea_decide_ahead`).
        """
        acc = state.policy
        measure = self._measures()
        if self.config.signal == "input":
            previous = acc.previous_input
            if measure and previous is not None and previous.shape == hidden.shape:
                self._measure(state, hidden, previous)
            # A copy: the step's input must survive whatever the model's loop does to the tensor in place.
            acc.previous_input = hidden.detach().clone() if measure else None
        config = self.config
        if config.calibrate:
            compute, statistic = True, acc.accumulated
        elif self._ahead:
            compute = tea_decide_ahead(config, acc, state.step, acc.lagged, state.has_cache)
            statistic = acc.estimate
        else:
            compute = tea_decide(config, acc, state.step, acc.distance, state.has_cache)
            statistic = acc.accumulated
        self.settle(state, compute, statistic)

    def _record(self, state: BranchState) -> None:
        acc = state.policy
        residuals = segment_residuals(state)
        previous = acc.residuals
        if acc.distance is not None and [r.shape for r in previous] == [r.shape for r in residuals]:
            acc.pairs.append((acc.distance, _residual_change(residuals, previous, self.reducer)))
        acc.residuals = residuals

    def pairs(self) -> dict[str, list[tuple[float, float]]]:
        """The ``(input change, residual change)`` pairs of the last calibration run, per branch."""
        return {
            name: list(s.policy.pairs)
            for name, s in self.tracker.report().items()
            if isinstance(s.policy, TeaAccumulator) and s.policy.pairs
        }

    def calibration(self, model: str, degree: int = DEFAULT_DEGREE) -> TeaCalibration:
        """The polynomial fitted on the last calibration run (every branch's pairs together).

        Raises:
            ValueError: Nothing was recorded, or too few pairs for ``degree``.
        """
        branches = self.pairs()
        if not branches:
            raise ValueError("no input/residual changes recorded: run the pipeline once with TeaCache(calibrate=True)")
        steps = max(s.step + 1 for s in self.tracker.report().values())
        pairs = [pair for branch in branches.values() for pair in branch]
        config = self.config
        return fit_calibration(
            pairs, degree, num_steps=steps, fn=config.fn, bn=config.bn, model=model, signal=config.signal
        )


def fit_calibration(
    pairs: list[tuple[float, float]],
    degree: int = DEFAULT_DEGREE,
    *,
    num_steps: int,
    fn: int = 0,
    bn: int = 0,
    model: str = "unknown",
    signal: str = "input",
) -> TeaCalibration:
    """Fit ``residual change ≈ p(input change)`` by least squares (``numpy.polyfit``).

    Args:
        pairs: ``(input change, residual change)`` of consecutive computed steps.
        degree: The polynomial's degree, 1 to 4.
        num_steps: Steps of the calibration run.
        fn: Front blocks of the calibrated layout.
        bn: Back blocks of the calibrated layout.
        model: What was calibrated, for messages.
        signal: The input change measured (:attr:`TeaCache.signal`).

    Raises:
        ValueError: ``degree`` out of range, fewer than ``degree + 1`` pairs, or a non-finite pair.
    """
    if isinstance(degree, bool) or not isinstance(degree, int) or not 1 <= degree <= 4:
        raise ValueError(f"degree={degree!r}: expected an integer from 1 to 4")
    data = np.asarray(pairs, dtype=np.float64).reshape(-1, 2)
    if len(data) < degree + 1:
        raise ValueError(
            f"{len(data)} input/residual pairs recorded, a fit of degree {degree} needs at least {degree + 1}: "
            "calibrate a run with more steps, or lower the degree"
        )
    if not np.isfinite(data).all():
        raise ValueError("a recorded input/residual change is not finite (an all-zero input or residual?)")
    coefficients = np.polyfit(data[:, 0], data[:, 1], degree)
    return TeaCalibration(
        coefficients=tuple(float(c) for c in coefficients),
        num_steps=num_steps,
        fn=fn,
        bn=bn,
        signal=signal,
        model=model,
    )


def save_calibration(calibration: TeaCalibration, path: str | os.PathLike[str]) -> Path:
    """Write ``calibration`` as a small JSON file (atomically); return its path."""
    from fastdit.io import write_json

    data = {
        "format": CALIBRATION_FORMAT,
        "model": calibration.model,
        "num_steps": calibration.num_steps,
        "fn": calibration.fn,
        "bn": calibration.bn,
        "signal": calibration.signal,
        "coefficients": list(calibration.coefficients),  # full precision: high powers amplify rounding
    }
    return write_json(path, data, indent=1)


def load_calibration(path: str | os.PathLike[str]) -> TeaCalibration:
    """Read a calibration file written by :func:`save_calibration`.

    Raises:
        ValueError: Not a TeaCache calibration file (wrong ``format``, missing entries).
        FieldError: An entry the calibration's own checks refuse (owner ``TeaCalibration``).
    """
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or data.get("format") != CALIBRATION_FORMAT:
        raise ValueError(f"{path}: not a TeaCache calibration (format {CALIBRATION_FORMAT!r} expected)")
    try:
        return TeaCalibration(
            coefficients=tuple(data["coefficients"]),
            num_steps=data["num_steps"],
            fn=data["fn"],
            bn=data["bn"],
            signal=data.get("signal", "input"),  # files written before the spectral signal measured the input
            model=data["model"],
        )
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{path}: incomplete TeaCache calibration ({exc!r})") from None


def reference_calibration_path() -> Path:
    """Where the packaged TeaCache calibration of the reference transformer lives (``fn=0, bn=0``, one branch)."""
    from fastdit.reference import reference_dir

    return reference_dir() / "transformer" / "teacache_f0b0.json"


def reference_calibration() -> TeaCalibration:
    """The packaged TeaCache calibration of the reference pipeline: degree 4, fitted on the 27 pairs of one 28-step
    run of digit 0 with seed 0 (a calibration case)."""
    return load_calibration(reference_calibration_path())


def video_reference_calibration_path(*, cfg: bool = False) -> Path:
    """Where the packaged TeaCache calibration of the video reference transformer lives (``fn=0, bn=0``).

    Args:
        cfg: The calibration recorded on the CFG path (``VIDEO_REFERENCE_CFG``, both branches) instead of the
            one-forward path's.
    """
    from fastdit.reference.video import video_reference_dir

    return video_reference_dir() / "transformer" / ("teacache_f0b0_cfg.json" if cfg else "teacache_f0b0.json")


def video_reference_calibration(*, cfg: bool = False) -> TeaCalibration:
    """The packaged TeaCache calibration of the video reference: degree 4, fitted on one 30-step run of digit 0
    moving left with seed 0 (a calibration case), on the one-forward path or (``cfg``) the CFG path."""
    return load_calibration(video_reference_calibration_path(cfg=cfg))
