"""MagCache: skip whole steps while the calibrated magnitude drift of the skipped blocks' residual stays small.

The residual the skipped blocks add (``r_t``: output − input of each middle segment, every block with ``fn=0``)
changes its magnitude smoothly and in a model-specific way over the schedule. One calibration run records the ratio
``mean|r_t| / mean|r_{t-1}|`` at every step (:func:`calibrate`, stored per model as a small JSON file with
:func:`save_calibration`). A run then folds the calibrated ratio of each step into an accumulated error
(:func:`mag_decide`) and reuses the last computed residual while the error stays under the threshold.

The decision reads only the calibration and the step counter — host values equal on every rank — so it is taken
before the step's first block and every rank of a context-parallel group takes the same branch. The calibration's
magnitudes are sums reduced over the ranks that share a sample (``context.cache_reducer``), so a calibration run
under parallelism records the same ratios as one process.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from fastdit.cache.hooks import BlockSlot
from fastdit.cache.policy import Reducer
from fastdit.cache.state import BranchState, branch_alias
from fastdit.cache.whole_step import WholeStepEngine, segment_residuals
from fastdit.config import MagCache, MagCalibration, MagCalibrations, TaylorSeer
from fastdit.errors import FieldError

__all__ = [
    "CALIBRATION_FORMAT",
    "DENOISERS_FORMAT",
    "MAGCACHE_PRESETS",
    "MagAccumulator",
    "MagCacheEngine",
    "check_denoisers",
    "denoiser_config",
    "load_calibration",
    "mag_decide",
    "magcache_preset",
    "model_name",
    "reference_calibration",
    "reference_calibration_path",
    "retained_steps",
    "save_calibration",
    "video_reference_calibration",
    "video_reference_calibration_path",
]

CALIBRATION_FORMAT = "fastdit.magcache/1"
"""The ``format`` entry of a calibration file (one denoiser)."""
DENOISERS_FORMAT = "fastdit.magcache.denoisers/1"
"""The ``format`` entry of a calibration file of several denoisers (one :class:`MagCalibration` per component)."""


@dataclass
class MagAccumulator:
    """What MagCache accumulates per branch since the last computed step."""

    ratio: float = 1.0
    error: float = 0.0
    skipped: int = 0
    # Calibration: magnitude of the last computed residual and the ratio of every step so far.
    magnitude: float | None = None
    recorded: list[float] = field(default_factory=list)

    def restart(self) -> None:
        """Start accumulating afresh (after a computed step)."""
        self.ratio, self.error, self.skipped = 1.0, 0.0, 0


def retained_steps(config: MagCache, num_steps: int) -> int:
    """The first steps that always compute: ``retention_ratio`` of the run, rounded to the nearest step."""
    return int(config.retention_ratio * num_steps + 0.5)


def mag_decide(config: MagCache, acc: MagAccumulator, step: int, ratios: tuple[float, ...], has_cache: bool) -> bool:
    """Whether step ``step`` computes (``True``) or reuses the cached residual; updates ``acc``.

    Args:
        config: The settings.
        acc: The branch's accumulators.
        step: 0-based step index.
        ratios: The branch's calibrated ratio of every step.
        has_cache: Whether a residual of an earlier computed step is there to reuse.
    """
    num_steps = len(ratios)
    forced = (
        not has_cache
        or config.threshold == 0  # the no-op setting: never skip, whatever the ratios say
        or step < retained_steps(config, num_steps)
        or step >= num_steps - config.final_steps
    )
    if not forced:
        acc.ratio *= ratios[step]
        acc.error += abs(1.0 - acc.ratio)
        acc.skipped += 1
        if acc.error < config.threshold and acc.skipped <= config.max_skip_steps:
            return False
    acc.restart()
    return True


class MagCacheEngine(WholeStepEngine):
    """The step cache of one transformer with MagCache's decision (the block hooks are DBCache's)."""

    def __init__(self, config: MagCache, slots: list[BlockSlot], reducer: Reducer | None = None) -> None:
        super().__init__(config, slots, reducer)
        self._names: dict[int, str] = {}

    def _branch(self, state: BranchState) -> str:
        name = self._names.get(id(state))
        if name is None or state.step == 0:
            name = next(n for n, s in self.tracker.branches().items() if s is state)
            self._names[id(state)] = name
        return name

    def _calibrated_branch(self, state: BranchState, calibration: MagCalibration) -> str:
        """The branch's name in ``calibration``: its own, or the one the other layout gives it. A pipeline that
        announces no branch gets ``default`` and ``default/1`` on one process, while CFG parallelism announces the
        same calls as ``cond`` and ``uncond``; a calibration recorded under either serves both."""
        name = self._branch(state)
        alias = branch_alias(name)
        if name not in calibration.branches and alias is not None and alias in calibration.branches:
            return alias
        return name

    def _check_length(self, state: BranchState) -> None:
        calibration = self.config.calibration
        if calibration is None:
            return
        scheduled = self.tracker.schedule() if state.step == 0 and self.tracker.schedule is not None else None
        if scheduled is not None and scheduled != calibration.num_steps:
            self._refuse(calibration, f"this run has {scheduled} steps")
        if state.step >= calibration.num_steps:
            self._refuse(calibration, f"this run has more than {calibration.num_steps} steps")

    @staticmethod
    def _refuse(calibration: MagCalibration | MagCalibrations, what: str) -> None:
        if isinstance(calibration, MagCalibrations):
            owner, model = "MagCalibrations", f"the denoisers {', '.join(calibration.components)}"
        else:
            owner, model = "MagCalibration", calibration.model
        raise FieldError(
            owner,
            "num_steps",
            calibration.num_steps,
            f"the calibration of {model} was recorded on a run of {calibration.num_steps} steps and "
            f"{what}; calibrate a run of this length (the ratios follow the schedule step by step)",
        )

    def begin_call(self, context: str, timestep: float | None, signature: tuple, key: int | None = None) -> None:
        """Start a transformer call and decide, before any block runs, whether this step computes.

        Raises:
            FieldError: The run's length differs from the calibration's (owner ``MagCalibration``), or its branch
                was not calibrated.
        """
        state = self.tracker.begin_call(context, timestep, signature, key)
        self._check_length(state)
        state.blocks_total += self.num_blocks
        if state.step == 0 or state.policy is None:
            state.policy = MagAccumulator()
        config = self.config
        if config.calibration is None:  # threshold 0 or a calibration run: every step computes
            compute = True
        else:
            ratios = config.calibration.ratios_for(self._calibrated_branch(state, config.calibration))
            compute = mag_decide(config, state.policy, state.step, ratios, state.has_cache)
        self.settle(state, compute, state.policy.error)

    def _record(self, state: BranchState) -> None:
        residuals = segment_residuals(state)
        sums = torch.stack([r.float().abs().sum() for r in residuals]).sum().reshape(1)
        count = torch.tensor([float(sum(r.numel() for r in residuals))], device=sums.device)
        both = torch.cat([sums, count])
        if self.reducer is not None:
            both = self.reducer(both)  # global magnitude: every rank records the same ratio
        total, numel = both.tolist()
        magnitude = total / numel if numel else 0.0
        acc = state.policy
        previous = acc.magnitude
        acc.recorded.append(1.0 if previous is None or previous == 0 else magnitude / previous)
        acc.magnitude = magnitude

    def calibration(self, model: str) -> MagCalibration:
        """The ratios recorded by the last calibration run, per branch.

        Raises:
            ValueError: Nothing was recorded (not a calibration run, or no run yet).
        """
        branches = {
            name: tuple(s.policy.recorded)
            for name, s in self.tracker.report().items()
            if s.policy is not None and s.policy.recorded
        }
        if not branches:
            raise ValueError("no magnitude ratios recorded: run the pipeline once with MagCache(calibrate=True)")
        lengths = {len(r) for r in branches.values()}
        if len(lengths) != 1:
            raise ValueError(f"branches recorded different step counts {sorted(lengths)}: calibrate one full run")
        return MagCalibration(
            branches=tuple(branches),
            ratios=tuple(branches.values()),
            num_steps=lengths.pop(),
            fn=self.config.fn,
            bn=self.config.bn,
            model=model,
        )


def model_name(transformer: torch.nn.Module) -> str:
    """A short description of ``transformer`` for calibration files: its class and block counts."""
    config = getattr(transformer, "config", None)
    layers = [f"{k}={config[k]}" for k in ("num_layers", "num_single_layers") if config is not None and k in config]
    return type(transformer).__name__ + (f"({', '.join(layers)})" if layers else "")


def denoiser_config(config: MagCache, component: str) -> MagCache:
    """The settings denoiser ``component`` runs with: its own calibration out of a :class:`MagCalibrations`.

    Raises:
        FieldError: Owner ``MagCalibrations``, field ``components``: ``component`` was not calibrated.
    """
    calibration = config.calibration
    if not isinstance(calibration, MagCalibrations):
        return config
    return dataclasses.replace(config, calibration=calibration.for_component(component))


def check_denoisers(config: MagCache, denoisers: Sequence[str]) -> None:
    """Refuse a calibration that does not fit the pipeline's denoisers, before anything is installed.

    A :class:`MagCalibrations` must name exactly the pipeline's denoisers; one :class:`MagCalibration` serves a
    pipeline of one denoiser only, because with several each denoiser serves its own part of the schedule.

    Raises:
        FieldError: Owner ``MagCalibrations`` (field ``components``) or ``MagCache`` (field ``calibration``).
    """
    calibration = config.calibration
    if isinstance(calibration, MagCalibrations):
        calibration.check_components(denoisers)
    elif calibration is not None and len(denoisers) > 1:
        raise FieldError(
            "MagCache",
            "calibration",
            f"<MagCalibration of {calibration.model}>",
            f"the pipeline has the denoisers {tuple(denoisers)}, each serving its own steps: it needs one calibration "
            "per denoiser (a MagCalibrations, which fastdit.calibration.calibrate records on this pipeline)",
        )


def _calibration_dict(calibration: MagCalibration) -> dict[str, Any]:
    return {
        "model": calibration.model,
        "num_steps": calibration.num_steps,
        "fn": calibration.fn,
        "bn": calibration.bn,
        "branches": {
            b: [round(r, 6) for r in rs] for b, rs in zip(calibration.branches, calibration.ratios, strict=True)
        },
    }


def _calibration_of(data: dict[str, Any]) -> MagCalibration:
    branches = data["branches"]
    return MagCalibration(
        branches=tuple(branches),
        ratios=tuple(tuple(r) for r in branches.values()),
        num_steps=data["num_steps"],
        fn=data["fn"],
        bn=data["bn"],
        model=data["model"],
    )


def save_calibration(calibration: MagCalibration | MagCalibrations, path: str | os.PathLike[str]) -> Path:
    """Write ``calibration`` as a small JSON file (atomically); return its path.

    A :class:`MagCalibrations` (several denoisers) is written with its ``components``, each as a one-denoiser
    calibration, under the format :data:`DENOISERS_FORMAT`.
    """
    from fastdit.io import write_json

    if isinstance(calibration, MagCalibrations):
        data = {
            "format": DENOISERS_FORMAT,
            "num_steps": calibration.num_steps,
            "components": {
                name: _calibration_dict(c)
                for name, c in zip(calibration.components, calibration.calibrations, strict=True)
            },
        }
    else:
        data = {"format": CALIBRATION_FORMAT, **_calibration_dict(calibration)}
    return write_json(path, data, indent=1)


def load_calibration(path: str | os.PathLike[str], *, num_steps: int | None = None) -> MagCalibration | MagCalibrations:
    """Read a calibration file written by :func:`save_calibration`.

    Args:
        path: The file.
        num_steps: The steps of the runs it will serve; a calibration of another length is refused here.

    Returns:
        A :class:`MagCalibration`, or a :class:`MagCalibrations` for a file of several denoisers.

    Raises:
        ValueError: Not a calibration file (wrong ``format``, missing entries).
        FieldError: Owner ``MagCalibration`` (``MagCalibrations`` for several denoisers), field ``num_steps``: it
            was recorded on a run of another length.
    """
    data = json.loads(Path(path).read_text())
    kind = data.get("format") if isinstance(data, dict) else None
    if kind not in (CALIBRATION_FORMAT, DENOISERS_FORMAT):
        raise ValueError(f"{path}: not a MagCache calibration (format {CALIBRATION_FORMAT!r} expected)")
    try:
        if kind == DENOISERS_FORMAT:
            components = data["components"]
            calibration: MagCalibration | MagCalibrations = MagCalibrations(
                components=tuple(components),
                calibrations=tuple(_calibration_of(c) for c in components.values()),
                num_steps=data["num_steps"],
            )
        else:
            calibration = _calibration_of(data)
    except (KeyError, AttributeError, TypeError) as exc:
        raise ValueError(f"{path}: incomplete MagCache calibration ({exc!r})") from None
    if num_steps is not None and num_steps != calibration.num_steps:
        MagCacheEngine._refuse(calibration, f"it is asked to serve runs of {num_steps} steps")
    return calibration


def reference_calibration_path() -> Path:
    """Where the packaged calibration of the reference transformer lives (28 steps, ``fn=0, bn=0``, one branch)."""
    from fastdit.reference import reference_dir

    return reference_dir() / "transformer" / "magcache_28steps_f0b0.json"


def reference_calibration(num_steps: int = 28) -> MagCalibration:
    """The packaged MagCache calibration of the reference pipeline (recorded on digit 0, seed 0: a calibration case).

    Raises:
        FieldError: ``num_steps`` is not the calibrated 28.
    """
    return load_calibration(reference_calibration_path(), num_steps=num_steps)


def video_reference_calibration_path(*, cfg: bool = False) -> Path:
    """Where the packaged calibration of the video reference transformer lives (30 steps, ``fn=0, bn=0``).

    Args:
        cfg: The calibration of the CFG path (``VIDEO_REFERENCE_CFG``: the ``cond`` and ``uncond`` branches) instead
            of the one-forward path's (``cond`` only).
    """
    from fastdit.reference.video import VIDEO_REFERENCE_DEFAULTS, video_reference_dir

    steps = VIDEO_REFERENCE_DEFAULTS["num_inference_steps"]
    suffix = "_cfg" if cfg else ""
    return video_reference_dir() / "transformer" / f"magcache_{steps}steps_f0b0{suffix}.json"


def video_reference_calibration(*, cfg: bool = False) -> MagCalibration:
    """The packaged MagCache calibration of the video reference (recorded on one calibration case: digit 0 moving
    left, seed 0), of the one-forward path or (``cfg``) of the CFG path with both branches."""
    return load_calibration(video_reference_calibration_path(cfg=cfg))


def _settings(method: str = "taylor", **values: Any) -> MappingProxyType[str, Any]:
    # Two retained steps (0.07 of 28 rounds to 2), the accumulated error bound 0.3 (the cap binds in the middle of the
    # run, the threshold near its end where the magnitudes move fastest), TaylorSeer order 2 over the timestep.
    taylor = TaylorSeer(order=2, variable="timestep", method=method)
    return MappingProxyType({"threshold": 0.3, "retention_ratio": 0.07, "taylorseer": taylor, **values})


MAGCACHE_PRESETS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        # At K 3 the FoCa forecast lifts the worst image on the calibration and held-out seeds and keeps the claim
        # on the confirmation seeds; at K 2 it lowers the held-out one, and at K 4 its 0.2 dB calibration gain
        # turned into 4.3 dB lost on the confirmation seeds (docs/cache.md, "Forecast methods").
        "balanced": _settings(max_skip_steps=2),
        "fast": _settings(method="foca", max_skip_steps=3),
        "ultra": _settings(max_skip_steps=4),
    }
)
"""MagCache settings by name, the calibrated counterparts of the DBCache presets (``docs/cache.md`` has their
figures on calibration and held-out seeds)."""


def magcache_preset(name: str, calibration: MagCalibration, **overrides: Any) -> MagCache:
    """The MagCache settings called ``name`` with the model's ``calibration`` (field ``overrides`` win).

    Raises:
        LookupError: ``name`` is not in :data:`MAGCACHE_PRESETS`.
        FieldError: An override is invalid, or the calibration does not fit (see :class:`~fastdit.config.MagCache`).
    """
    if name not in MAGCACHE_PRESETS:
        raise LookupError(f"unknown MagCache preset {name!r}; known: {', '.join(MAGCACHE_PRESETS)}")
    return MagCache(**{**MAGCACHE_PRESETS[name], "calibration": calibration, **overrides})
