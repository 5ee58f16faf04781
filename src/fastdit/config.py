"""Frozen configuration dataclasses for every technique fastdit applies.

Each config checks every field in ``__post_init__`` (type first: ``True`` is not a block count, ``"no"`` is not
``False``) and raises :class:`~fastdit.errors.FieldError` (a ``ValueError``) naming the class, the field and the
offending value, so bad input is rejected before any model is touched and front ends can tell which field was wrong.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from fastdit.errors import FieldError, FieldsError

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "FP8_DYNAMIC_MODES",
    "FP8_MAX",
    "LOAD_MODES",
    "QUANTIZE_MODES",
    "STATIC_FP8_MODES",
    "TEA_SIGNALS",
    "WEIGHT_SCALES",
    "ActivationScales",
    "Attention",
    "Compile",
    "CudaGraph",
    "DBCache",
    "DBPrune",
    "FBCache",
    "Fuse",
    "Loading",
    "MagCache",
    "MagCalibration",
    "MagCalibrations",
    "Offload",
    "Parallel",
    "Quantize",
    "StepMask",
    "TaylorSeer",
    "TeaCache",
    "TeaCalibration",
    "config_fields",
]


@dataclass(frozen=True)
class _Rule:
    """What one field accepts: a test, and the phrase naming it in the error (``"an integer >= 1"``)."""

    test: Callable[[Any], bool]
    what: str

    def check(self, owner: str, name: str, value: Any) -> None:
        if not self.test(value):
            raise FieldError(owner, name, value, f"must be {self.what}")


def _is_int(value: Any) -> bool:
    # bool subclasses int, but True given as a block count is a mistake, not a 1; floats are refused too (1.0 would
    # pass a range check and fail later in range() or indexing).
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    # NaN compares false with everything and inf passes any lower bound: neither is a usable threshold or ratio.
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _integer(minimum: int) -> _Rule:
    return _Rule(lambda v: _is_int(v) and v >= minimum, f"an integer >= {minimum}")


def _number(minimum: float, maximum: float | None = None) -> _Rule:
    if maximum is None:
        return _Rule(lambda v: _is_number(v) and v >= minimum, f"a finite number >= {minimum}")
    return _Rule(lambda v: _is_number(v) and minimum <= v <= maximum, f"a number in [{minimum}, {maximum}]")


def _same_kind(value: Any, choice: Any) -> bool:
    if isinstance(choice, bool):
        return isinstance(value, bool)
    if isinstance(choice, int):
        return _is_int(value)  # so neither True nor 1.0 counts as the choice 1
    return isinstance(value, type(choice))


def _one_of(*choices: Any) -> _Rule:
    shown = [repr(c) for c in choices]
    what = " or ".join(shown) if len(choices) <= 2 else f"one of {', '.join(shown)}"
    return _Rule(lambda v: any(_same_kind(v, c) and v == c for c in choices), what)


def _instance(cls: type | tuple[type, ...]) -> _Rule:
    names = " or ".join(c.__name__ for c in (cls if isinstance(cls, tuple) else (cls,)))
    return _Rule(lambda v: isinstance(v, cls), f"a {names}")


def _optional(rule: _Rule) -> _Rule:
    return _Rule(lambda v: v is None or rule.test(v), f"{rule.what} or None")


_BOOL = _Rule(lambda v: isinstance(v, bool), "a bool")
_TEXT = _Rule(lambda v: isinstance(v, str) and bool(v), "a non-empty string")
_PATTERNS = _Rule(
    lambda v: isinstance(v, tuple) and all(isinstance(p, str) and p for p in v), "a tuple of non-empty strings"
)
_STEPS = _Rule(lambda v: isinstance(v, tuple) and all(_is_int(s) and s >= 0 for s in v), "non-negative integers")


def _check_fields(config: Any, **rules: _Rule) -> None:
    """Check each field of ``config`` against its rule, in declaration order.

    Args:
        config: A config dataclass instance.
        **rules: One rule per field of ``config``, by field name.

    Raises:
        FieldError: For the first field whose value its rule refuses.
        TypeError: If a field has no rule or a rule no field: every field is checked, so a new field cannot be
            added without saying what it accepts.
    """
    owner = type(config).__name__
    names = [f.name for f in fields(config)]
    if set(names) != rules.keys():
        raise TypeError(
            f"{owner}: fields without a check: {sorted(set(names) - rules.keys())}, "
            f"checks without a field: {sorted(rules.keys() - set(names))}"
        )
    for name in names:
        rules[name].check(owner, name, getattr(config, name))


def config_fields(cls: type) -> list[tuple[str, Any, str]]:
    """Return ``(name, default, doc)`` for each field of a config dataclass (used by the CLI to derive flags)."""
    out = []
    for f in fields(cls):
        default = f.default if f.default is not f.default_factory else f.default_factory()  # type: ignore[misc]
        out.append((f.name, default, f.metadata.get("doc", "")))
    return out


def _doc(text: str, default: Any) -> Any:
    return field(default=default, metadata={"doc": text})


_HERMITE_SCALE = math.sqrt(0.5)


@dataclass(frozen=True, kw_only=True)
class TaylorSeer:
    """Predict skipped residuals from finite differences of past computed ones (instead of reusing them verbatim)."""

    order: int = _doc("Order of the Taylor expansion: 1 (linear) or 2 (quadratic).", 1)
    forecast_decision: bool = _doc(
        "Decide by comparing the front residual with its own Taylor forecast (instead of with the last computed "
        "one): smooth drift that the forecast follows no longer forces a full step.",
        False,
    )
    variable: Literal["step", "timestep"] = _doc(
        "What the expansion is a polynomial in: 'step' (the step index) or 'timestep' (the value the denoiser "
        "receives; follows a schedule whose spacing is uneven, falls back to the step index without one).",
        "step",
    )
    method: Literal["taylor", "hermite", "foca"] = _doc(
        "How the forecast extrapolates: 'taylor' (the divided-difference Taylor series), 'hermite' (the same "
        "derivative estimates on a scaled Hermite basis that damps long extrapolations) or 'foca' (forecast then "
        "calibrate: the polynomial through the last computed residuals, corrected by a trapezoidal step; order 2).",
        "taylor",
    )
    hermite_scale: float = _doc(
        "The Hermite basis' contraction σ in (0, 1]: the k-th term's growth over long distances is (2σ²)^k times "
        "the Taylor term's; 1/√2 keeps the linear term exact (method='hermite' only).",
        _HERMITE_SCALE,
    )

    def __post_init__(self) -> None:
        _check_fields(
            self,
            order=_one_of(1, 2),
            forecast_decision=_BOOL,
            variable=_one_of("step", "timestep"),
            method=_one_of("taylor", "hermite", "foca"),
            hermite_scale=_Rule(lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]"),
        )
        if self.method == "foca" and self.order != 2:
            # At order 1 the corrector has no curvature to calibrate: the forecast would be Taylor's, under a
            # name that promises more.
            raise FieldError("TaylorSeer", "order", self.order, "must be 2 with method='foca'")
        if self.method != "hermite" and self.hermite_scale != _HERMITE_SCALE:
            raise FieldError("TaylorSeer", "hermite_scale", self.hermite_scale, "applies to method='hermite' only")


STEP_MASK_PRESETS = ("slow", "medium", "fast", "ultra")


@dataclass(frozen=True, kw_only=True)
class StepMask:
    """Which denoising steps must run the full transformer.

    With ``policy="static"`` every step in ``compute_steps`` computes and every other step is served from the cache.
    With ``policy="dynamic"`` the listed steps compute and the others fall back to the residual-difference test.

    A mask that knows the run it was laid out for (``num_steps``, set by :meth:`preset`) refuses a longer run: the
    steps past its end would otherwise all be cached (static) or tested (dynamic) without the mask's last computed
    steps, which loses several dB of quality without a word. A mask without ``num_steps`` applies to any run.
    """

    compute_steps: tuple[int, ...] = _doc("Step indices (0-based) that always compute.", ())
    policy: Literal["static", "dynamic"] = _doc("'static' caches every other step; 'dynamic' tests them.", "dynamic")
    num_steps: int | None = _doc(
        "Steps of the run the mask was laid out for; a longer run is refused (None: any run, steps past the listed "
        "ones follow the policy).",
        None,
    )

    def __post_init__(self) -> None:
        steps = self.compute_steps
        if isinstance(steps, Iterable) and not isinstance(steps, (str, bytes)):
            # Lists and ranges are natural to write; the frozen config keeps a tuple so it stays hashable.
            object.__setattr__(self, "compute_steps", tuple(steps))
        _check_fields(self, compute_steps=_STEPS, policy=_one_of("static", "dynamic"), num_steps=_optional(_integer(1)))
        beyond = [s for s in self.compute_steps if self.num_steps is not None and s >= self.num_steps]
        if beyond:
            raise FieldsError(
                "StepMask",
                {"compute_steps": self.compute_steps, "num_steps": self.num_steps},
                f"steps {beyond} are past the end of a run of {self.num_steps} steps (indices are 0-based)",
            )

    @classmethod
    def preset(cls, name: str, num_steps: int, *, policy: Literal["static", "dynamic"] = "static") -> StepMask:
        """Build a mask from a named preset for a run of ``num_steps`` steps.

        Presets keep the first steps (where the image layout forms) and the last step (fine detail), and compute
        every k-th step in between: slow k=2, medium k=3, fast k=4, ultra k=6.

        Args:
            name: One of ``slow``, ``medium``, ``fast``, ``ultra``.
            num_steps: Number of denoising steps of the run; the mask records it and refuses longer runs.
            policy: ``static`` (the mask alone decides) or ``dynamic``.
        """
        _one_of(*STEP_MASK_PRESETS).check("StepMask", "preset", name)
        _integer(1).check("StepMask", "num_steps", num_steps)
        head, every = {"slow": (4, 2), "medium": (4, 3), "fast": (3, 4), "ultra": (2, 6)}[name]
        head = min(head, num_steps)
        steps = set(range(head)) | set(range(head, num_steps, every)) | {num_steps - 1}
        return cls(compute_steps=tuple(sorted(steps)), policy=policy, num_steps=num_steps)


@dataclass(frozen=True, kw_only=True)
class DBCache:
    """Dual-block cache: run the first ``fn`` and last ``bn`` blocks every step, skip the middle ones when the
    residual of the first ``fn`` blocks changed less than ``threshold`` since the last computed step.

    ``threshold=0`` never caches (bit-identical to the original model).
    """

    fn: int = _doc("Number of front blocks computed every step (their residual decides).", 8)
    bn: int = _doc("Number of back blocks computed every step (they repair the approximation).", 0)
    threshold: float = _doc("Relative L1 difference of the front residual below which a step is cached.", 0.08)
    warmup_steps: int = _doc("Steps at the start of each run that never use the cache.", 8)
    warmup_interval: int = _doc("Inside the warm-up, compute only every k-th step; the others may cache.", 1)
    max_cached_steps: int | None = _doc("Cap on cached steps per run (None: unlimited).", None)
    max_continuous_cached_steps: int | None = _doc("Cap on consecutive cached steps (None: unlimited).", None)
    taylorseer: TaylorSeer | None = _doc("Predict skipped residuals with TaylorSeer (None: reuse them).", None)
    step_mask: StepMask | None = _doc("Steps that must compute (and, if static, the ones that must cache).", None)
    separate_cfg: bool | None = _doc(
        "Keep separate cache state per CFG branch. None: automatic (per cache context / per call within a step).",
        None,
    )
    decide_ahead: bool = _doc(
        "Decide each step from the front residual's drift measured one step earlier (its rate since the last "
        "computed step, carried one step on), so the host never waits for the device: a cached step then costs "
        "about its Fn + Bn blocks. False: decide on the step's own front residual (a device read every step).",
        False,
    )

    def __post_init__(self) -> None:
        _check_fields(
            self,
            decide_ahead=_BOOL,
            fn=_integer(1),
            bn=_integer(0),
            threshold=_number(0),
            warmup_steps=_integer(0),
            warmup_interval=_integer(1),
            max_cached_steps=_optional(_integer(0)),
            max_continuous_cached_steps=_optional(_integer(1)),
            taylorseer=_optional(_instance(TaylorSeer)),
            step_mask=_optional(_instance(StepMask)),
            separate_cfg=_optional(_BOOL),
        )
        if self.decide_ahead and self.taylorseer is not None and self.taylorseer.forecast_decision:
            raise FieldError(
                "DBCache",
                "decide_ahead",
                True,
                "a verified forecast (TaylorSeer.forecast_decision) checks each step's own front residual against "
                "its forecast, which a decision taken ahead does not read; use one or the other",
            )


def FBCache(threshold: float = 0.12, **kwargs: Any) -> DBCache:  # noqa: N802 - reads as a config class
    """First-block cache: :class:`DBCache` with ``fn=1, bn=0``."""
    return DBCache(fn=1, bn=0, threshold=threshold, **kwargs)


@dataclass(frozen=True, kw_only=True)
class DBPrune:
    """Dynamic block pruning: each middle block is skipped on its own when its input changed less than
    ``threshold`` since it last ran; its cached residual is added instead."""

    fn: int = _doc("Front blocks that always compute.", 1)
    bn: int = _doc("Back blocks that always compute.", 0)
    threshold: float = _doc("Relative L1 change of a block's input below which the block is skipped.", 0.08)
    warmup_steps: int = _doc("Steps at the start of each run that never prune.", 4)
    max_pruned_ratio: float = _doc("Largest fraction of middle blocks pruned in one step.", 1.0)
    max_continuous_pruned_steps: int | None = _doc("Cap on consecutive steps one block may be pruned.", None)

    def __post_init__(self) -> None:
        _check_fields(
            self,
            fn=_integer(0),
            bn=_integer(0),
            threshold=_number(0),
            warmup_steps=_integer(0),
            max_pruned_ratio=_number(0, 1),
            max_continuous_pruned_steps=_optional(_integer(1)),
        )


# --- MagCache: whole-step skipping from calibrated residual-magnitude ratios ------------------------------------------


def _ratio_table(value: Any) -> bool:
    return (
        isinstance(value, tuple)
        and bool(value)
        and all(isinstance(r, tuple) and r and all(_is_number(x) and x >= 0 for x in r) for r in value)
    )


@dataclass(frozen=True, kw_only=True)
class MagCalibration:
    """Per-step magnitude ratios of one model's cached residual, recorded on one calibration run.

    ``ratios[b][t]`` is ``mean|r_t| / mean|r_{t-1}|`` for branch ``branches[b]``, where ``r_t`` is the residual the
    skipped blocks add at step ``t`` (``ratios[b][0]`` is 1). The ratios depend on the checkpoint, the sampler's
    schedule and the step count, so a calibration serves runs of exactly :attr:`num_steps` steps.
    """

    branches: tuple[str, ...] = _doc("Branch names the ratios were recorded for ('cond', 'uncond', ...).", ())
    ratios: tuple[tuple[float, ...], ...] = _doc("One ratio per step for each branch, in the order of branches.", ())
    num_steps: int = _doc("Steps of the calibration run; a run of another length is refused.", 1)
    fn: int = _doc("Front blocks of the layout the ratios measure (MagCache.fn must match).", 0)
    bn: int = _doc("Back blocks of the layout the ratios measure (MagCache.bn must match).", 0)
    model: str = _doc("What was calibrated (the transformer's class and configuration), for messages.", "unknown")

    def __post_init__(self) -> None:
        for name in ("branches", "ratios"):
            value = getattr(self, name)
            if isinstance(value, list):  # JSON gives lists; the frozen config keeps tuples
                object.__setattr__(self, name, tuple(tuple(v) if isinstance(v, list) else v for v in value))
        _check_fields(
            self,
            branches=_Rule(
                lambda v: isinstance(v, tuple) and bool(v) and all(isinstance(b, str) for b in v),
                "a non-empty tuple of branch names",
            ),
            ratios=_Rule(_ratio_table, "a non-empty tuple of finite ratios >= 0 per branch"),
            num_steps=_integer(1),
            fn=_integer(0),
            bn=_integer(0),
            model=_TEXT,
        )
        if len(self.ratios) != len(self.branches) or any(len(r) != self.num_steps for r in self.ratios):
            raise FieldsError(
                "MagCalibration",
                {"ratios": [len(r) for r in self.ratios], "num_steps": self.num_steps, "branches": self.branches},
                "needs one ratio per step for every branch",
            )

    def ratios_for(self, branch: str) -> tuple[float, ...]:
        """The ratios of ``branch``.

        Raises:
            FieldError: Owner ``MagCalibration``, field ``branches``: the branch was not calibrated.
        """
        if branch not in self.branches:
            raise FieldError(
                "MagCalibration",
                "branches",
                self.branches,
                f"this run has a branch {branch!r} that was not calibrated; calibrate with the same guidance "
                "(true CFG calibrates 'cond' and 'uncond')",
            )
        return self.ratios[self.branches.index(branch)]


@dataclass(frozen=True, kw_only=True)
class MagCalibrations:
    """One :class:`MagCalibration` per denoiser, for pipelines with several (Wan 2.2's experts).

    Each denoiser's calibration holds the ratios of the steps that denoiser served in the calibration run, counted
    from its own first call (the high-noise expert's first steps, then the low-noise expert's from its step 0), and
    a run gives each denoiser its own ratios. ``fastdit.calibration.calibrate`` records one on such a pipeline.
    """

    components: tuple[str, ...] = _doc("The denoisers' component names ('transformer', 'transformer_2', ...).", ())
    calibrations: tuple[MagCalibration, ...] = _doc("Each denoiser's calibration, in the order of components.", ())
    num_steps: int = _doc("Steps of the calibration run (every denoiser together); another length is refused.", 1)

    def __post_init__(self) -> None:
        for name in ("components", "calibrations"):
            value = getattr(self, name)
            if isinstance(value, list):  # JSON gives lists; the frozen config keeps tuples
                object.__setattr__(self, name, tuple(value))
        _check_fields(
            self,
            components=_Rule(
                lambda v: (
                    isinstance(v, tuple)
                    and bool(v)
                    and all(isinstance(c, str) and c for c in v)
                    and len(set(v)) == len(v)
                ),
                "a non-empty tuple of distinct component names",
            ),
            calibrations=_Rule(
                lambda v: isinstance(v, tuple) and bool(v) and all(isinstance(c, MagCalibration) for c in v),
                "a non-empty tuple of MagCalibration",
            ),
            num_steps=_integer(1),
        )
        if len(self.calibrations) != len(self.components):
            raise FieldsError(
                "MagCalibrations",
                {"components": self.components, "calibrations": len(self.calibrations)},
                "needs one calibration per component",
            )
        layouts = {(c.fn, c.bn) for c in self.calibrations}
        if len(layouts) != 1:
            raise FieldError(
                "MagCalibrations", "calibrations", sorted(layouts), "every denoiser must be calibrated on one layout"
            )
        longest = max(c.num_steps for c in self.calibrations)
        if longest > self.num_steps:
            raise FieldError(
                "MagCalibrations", "num_steps", self.num_steps, f"a denoiser served {longest} steps of the run"
            )

    @property
    def fn(self) -> int:
        """Front blocks of the layout every denoiser's ratios measure."""
        return self.calibrations[0].fn

    @property
    def bn(self) -> int:
        """Back blocks of the layout every denoiser's ratios measure."""
        return self.calibrations[0].bn

    def for_component(self, component: str) -> MagCalibration:
        """The calibration of denoiser ``component``.

        Raises:
            FieldError: Owner ``MagCalibrations``, field ``components``: that denoiser was not calibrated.
        """
        if component not in self.components:
            raise FieldError(
                "MagCalibrations",
                "components",
                self.components,
                f"the denoiser {component!r} was not calibrated; calibrate this pipeline (one calibration run "
                "records every denoiser)",
            )
        return self.calibrations[self.components.index(component)]

    def check_components(self, denoisers: Sequence[str]) -> None:
        """Refuse a pipeline whose denoisers are not exactly the calibrated ones.

        Raises:
            FieldError: Owner ``MagCalibrations``, field ``components``, naming both sets.
        """
        if set(denoisers) != set(self.components):
            raise FieldError(
                "MagCalibrations",
                "components",
                self.components,
                f"the pipeline's denoisers are {tuple(denoisers)}; a calibration serves the pipeline it was "
                "recorded on (one calibration run records every denoiser)",
            )


@dataclass(frozen=True, kw_only=True)
class MagCache:
    """Whole-step cache (MagCache): skip a step while the calibrated drift of the cached residual stays small.

    At each step past the retained ones the step's calibrated magnitude ratio is folded into an accumulated ratio
    and error (``err += |1 - prod(ratios)|``); the skipped blocks re-add the residual of the last computed step while
    ``err < threshold`` and at most ``max_skip_steps`` steps in a row were skipped, else the step computes and the
    accumulators restart. The decision needs no tensor of the current step, so it is taken before the first block
    and is equal on every rank. ``fn=0`` skips every block (the whole block stack's residual is reused), so it also
    covers models of one block. ``threshold=0`` never skips (bit-identical to no cache).
    """

    threshold: float = _doc("Accumulated magnitude error below which a step is skipped (0: never skip).", 0.06)
    max_skip_steps: int = _doc("Cap on consecutive skipped steps (K).", 3)
    retention_ratio: float = _doc("Fraction of the first steps that always compute (rounded to steps).", 0.2)
    final_steps: int = _doc("Last steps of the run that always compute (fine detail forms there).", 0)
    fn: int = _doc("Front blocks computed every step (0: the whole block stack is skipped).", 0)
    bn: int = _doc("Back blocks computed every step (they repair the reused residual).", 0)
    calibration: MagCalibration | MagCalibrations | None = _doc(
        "The model's magnitude ratios (MagCalibration, see fastdit.cache.magcache; MagCalibrations for a pipeline "
        "of several denoisers); needed when threshold > 0.",
        None,
    )
    calibrate: bool = _doc("Record the ratios of each run instead of skipping (every step computes).", False)
    taylorseer: TaylorSeer | None = _doc("Forecast skipped residuals with TaylorSeer (None: reuse them).", None)
    separate_cfg: bool | None = _doc(
        "Keep separate cache state per CFG branch. None: automatic (per cache context / per call within a step).",
        None,
    )

    def __post_init__(self) -> None:
        _check_fields(
            self,
            threshold=_number(0),
            max_skip_steps=_integer(1),
            retention_ratio=_number(0, 1),
            final_steps=_integer(0),
            fn=_integer(0),
            bn=_integer(0),
            calibration=_optional(_instance((MagCalibration, MagCalibrations))),
            calibrate=_BOOL,
            taylorseer=_optional(_instance(TaylorSeer)),
            separate_cfg=_optional(_BOOL),
        )
        _check_calibrated(self, "MagCalibration", "fastdit.calibration.calibrate")


# --- TeaCache: whole-step skipping from the accumulated, rescaled change of the block stack's input -------------------

_MAX_TEA_DEGREE = 4
TEA_SIGNALS = ("input", "spectral")
"""What TeaCache may measure: the first block's input, or the spectral estimate of the clean latent."""


def _coefficients(value: Any) -> bool:
    return isinstance(value, tuple) and 1 <= len(value) <= _MAX_TEA_DEGREE + 1 and all(_is_number(c) for c in value)


@dataclass(frozen=True, kw_only=True)
class TeaCalibration:
    """A model's polynomial from the change of the block stack's input to the change of its residual.

    ``x`` is the relative L1 change of the first block's input between consecutive steps, ``y`` that of the residual
    the block stack adds (output − input); one calibration run records ``(x, y)`` at every step and
    ``numpy.polyfit`` gives ``y ≈ p(x)``. A cached run accumulates ``max(p(x), 0)`` instead of ``x``, so the threshold
    reads as a residual change whatever the model's input scale. Unlike MagCache's per-step ratios the polynomial
    does not follow the schedule step by step, so it serves runs of any length.
    """

    coefficients: tuple[float, ...] = _doc(
        "Polynomial coefficients, highest power first (numpy.polyval order); 1 to 5 of them (degree <= 4).", (1.0, 0.0)
    )
    num_steps: int = _doc("Steps of the calibration run (the run length assumed where no scheduler tells one).", 1)
    fn: int = _doc("Front blocks of the layout the residual was measured on (TeaCache.fn must match).", 0)
    bn: int = _doc("Back blocks of the layout the residual was measured on (TeaCache.bn must match).", 0)
    signal: str = _doc("The input change the polynomial maps (TeaCache.signal must match).", "input")
    model: str = _doc("What was calibrated (the transformer's class and configuration), for messages.", "unknown")

    def __post_init__(self) -> None:
        if isinstance(self.coefficients, list):  # JSON gives lists; the frozen config keeps tuples
            object.__setattr__(self, "coefficients", tuple(self.coefficients))
        _check_fields(
            self,
            coefficients=_Rule(_coefficients, f"a tuple of 1 to {_MAX_TEA_DEGREE + 1} finite numbers"),
            num_steps=_integer(1),
            fn=_integer(0),
            bn=_integer(0),
            signal=_one_of(*TEA_SIGNALS),
            model=_TEXT,
        )

    def rescale(self, distance: float) -> float:
        """The residual change the polynomial predicts for an input change ``distance`` (never below 0)."""
        value = 0.0
        for coefficient in self.coefficients:  # Horner's scheme, in float64 on the host
            value = value * distance + coefficient
        # A fit of degree up to 4 can dip below 0 near the ends of its data; a negative change would pay back
        # accumulated drift, so it counts as none.
        return max(value, 0.0)


@dataclass(frozen=True, kw_only=True)
class TeaCache:
    """Whole-step cache (TeaCache): skip a step while the accumulated change of the block stack's input is small.

    Before a step's blocks run, the relative L1 change of the first block's input since the previous step is mapped
    through the model's calibrated polynomial (:class:`TeaCalibration`) and added to an accumulator; the step reuses
    the residual of the last computed step (or its TaylorSeer forecast) while the accumulator stays under
    ``threshold`` and at most ``max_skip_steps`` steps in a row were skipped, else it computes and the accumulator
    restarts. The change is a sum reduced over the ranks that share a sample, so every rank takes the same branch.
    ``fn=0`` skips every block (models of one block too); ``threshold=0`` never skips (bit-identical to no cache).

    ``signal="spectral"`` measures instead the change of a Wiener estimate of the clean latent — the transformer's
    noisy latent filtered over its grid with a gain that follows the step's noise level
    (:mod:`fastdit.cache.spectral`) — and accumulates it as it is unless a calibration of that signal is given. It
    needs a model whose adapter declares its latent (``ModelAdapter.latent``).

    ``decide_ahead=True`` keeps the host from waiting for the device each step: the step's change is sent to pinned
    host memory behind its kernels and read at the next step, and the decision of step *t* takes the change of step
    *t − 1* for its own — ``accumulated + rescaled(d[t−1])`` against the threshold, where ``accumulated`` is the exact
    sum through step *t − 1*, corrected with each true change when it arrives, so the lag never compounds. Both
    signals work (each measures before the step's blocks). The first two steps compute (no earlier change is
    known); retained and final steps, the cap and the restart after a computed step are as without it. A calibration
    run ignores it (every step computes and records its own change).
    """

    threshold: float = _doc("Accumulated rescaled input change below which a step is skipped (0: never skip).", 0.2)
    max_skip_steps: int = _doc("Cap on consecutive skipped steps.", 2)
    retention_ratio: float = _doc("Fraction of the first steps that always compute (rounded to steps).", 0.07)
    final_steps: int = _doc("Last steps of the run that always compute (fine detail forms there).", 0)
    fn: int = _doc("Front blocks computed every step (0: the whole block stack is skipped).", 0)
    bn: int = _doc("Back blocks computed every step (they repair the reused residual).", 0)
    signal: Literal["input", "spectral"] = _doc(
        "What changes are measured on: the first block's input, or a noise-level-aware spectral estimate of the "
        "clean latent.",
        "input",
    )
    spectral_exponent: float = _doc("Exponent p of the clean-latent spectrum 1/|f|^p the spectral filter assumes.", 3.0)
    calibration: TeaCalibration | None = _doc(
        "The model's rescaling polynomial (TeaCalibration, see fastdit.cache.teacache); needed when threshold > 0 "
        "with signal='input'.",
        None,
    )
    calibrate: bool = _doc(
        "Record (input change, residual change) pairs instead of skipping (every step computes).", False
    )
    taylorseer: TaylorSeer | None = _doc("Forecast skipped residuals with TaylorSeer (None: reuse them).", None)
    separate_cfg: bool | None = _doc(
        "Keep separate cache state per CFG branch. None: automatic (per cache context / per call within a step).",
        None,
    )
    decide_ahead: bool = _doc(
        "Decide each step with the previous step's measured change standing in for its own (corrected when its "
        "own arrives a step later), so the host never waits for the device. False: wait for the step's own change.",
        False,
    )

    def __post_init__(self) -> None:
        _check_fields(
            self,
            decide_ahead=_BOOL,
            threshold=_number(0),
            max_skip_steps=_integer(1),
            retention_ratio=_number(0, 1),
            final_steps=_integer(0),
            fn=_integer(0),
            bn=_integer(0),
            signal=_one_of(*TEA_SIGNALS),
            spectral_exponent=_Rule(lambda v: _is_number(v) and v > 0, "a finite number > 0"),
            calibration=_optional(_instance(TeaCalibration)),
            calibrate=_BOOL,
            taylorseer=_optional(_instance(TaylorSeer)),
            separate_cfg=_optional(_BOOL),
        )
        _check_calibrated(self, "TeaCalibration", "fastdit.calibration.calibrate(..., policy='teacache')")
        cal = self.calibration
        if cal is not None and cal.signal != self.signal:
            raise FieldsError(
                "TeaCache",
                {"signal": self.signal, "calibration": f"<TeaCalibration of signal {cal.signal!r}>"},
                "the calibration's polynomial maps changes of another signal; calibrate this signal",
            )


CACHE_CONFIGS: tuple[type, ...] = (DBCache, DBPrune, MagCache, TeaCache)
"""The step-cache policies, one config class each: what ``cache=`` takes (exact classes)."""

CacheConfig = DBCache | DBPrune | MagCache | TeaCache
"""Any step-cache configuration (a type alias of the classes in :data:`CACHE_CONFIGS`)."""


def _check_calibrated(config: MagCache | TeaCache, kind: str, how: str) -> None:
    """The combination checks of a calibrated whole-step policy (``kind``: its calibration class)."""
    owner = type(config).__name__
    if config.taylorseer is not None and config.taylorseer.forecast_decision:
        raise FieldError(owner, "taylorseer", config.taylorseer, "forecast_decision applies to DBCache's residual test")
    if config.calibrate and config.calibration is not None:
        raise FieldsError(
            owner,
            {"calibrate": config.calibrate, "calibration": f"<{kind}>"},
            "a calibration run records new values: leave calibration unset",
        )
    # The spectral signal is a relative change of a content estimate already: it may accumulate as it is.
    raw_ok = isinstance(config, TeaCache) and config.signal == "spectral"
    if config.threshold > 0 and config.calibration is None and not config.calibrate and not raw_ok:
        raise FieldError(
            owner,
            "calibration",
            None,
            f"threshold > 0 needs the model's calibration ({how}, or load_calibration of a saved one); "
            "threshold=0 needs none",
        )
    cal = config.calibration
    if cal is not None and (cal.fn, cal.bn) != (config.fn, config.bn):
        raise FieldsError(
            owner,
            {"fn": config.fn, "bn": config.bn},
            f"the calibration measured the layout fn={cal.fn}, bn={cal.bn}; calibrate this layout",
        )


# Long enough for the legitimate waits of a healthy run — ranks joining after loading the weights at different
# speeds, the first calls compiling or capturing graphs one rank ahead of another — and far shorter than torch's
# 10 minutes (NCCL) or 30 (gloo), so a rank that stalls ends the run in minutes.
DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True, kw_only=True)
class Parallel:
    """Degrees of parallelism. Their product must equal the number of processes (under ``torchrun``)."""

    ulysses: int = _doc("Ulysses (all-to-all) context-parallel degree.", 1)
    ring: int = _doc("Ring-attention context-parallel degree.", 1)
    tp: int = _doc("Tensor-parallel degree of the transformer.", 1)
    cfg: int = _doc("CFG-parallel degree (1 or 2): cond and uncond branches on different ranks.", 1)
    text_encoder: bool = _doc(
        "Split the text encoders with tensor parallelism over all ranks of the job (every rank encodes the same "
        "prompts, CFG ranks included); needs more than one process.",
        False,
    )
    vae: bool = _doc("Decode the latent in parallel over all ranks.", False)
    ulysses_chunks: int = _doc(
        "Pipeline Ulysses attention over this many head chunks, so one chunk's all-to-all overlaps another's "
        "attention (1: one exchange each way; used only when the heads split evenly).",
        1,
    )
    comm_fp8: bool = _doc(
        "Send Ulysses all-to-alls as float8 with per-tensor scales (lossy; half the bf16 bytes).", False
    )
    timeout_s: float = _doc(
        "Seconds a rank waits for the others (in a collective, or to join the process group) before the run fails "
        "naming the ranks that did not answer; applies to the process groups fastdit creates.",
        DEFAULT_TIMEOUT_S,
    )

    def __post_init__(self) -> None:
        _check_fields(
            self,
            ulysses=_integer(1),
            ring=_integer(1),
            tp=_integer(1),
            cfg=_one_of(1, 2),
            text_encoder=_BOOL,
            vae=_BOOL,
            ulysses_chunks=_integer(1),
            comm_fp8=_BOOL,
            timeout_s=_number(1),
        )

    @property
    def world_size(self) -> int:
        """Number of processes this layout needs."""
        return self.ulysses * self.ring * self.tp * self.cfg

    @property
    def is_parallel(self) -> bool:
        """Whether any form of parallelism is requested."""
        return self.world_size > 1 or self.text_encoder or self.vae


LOAD_MODES = ("every-rank", "rank0", "node-rank0")
"""How the processes of a job get the weights (:attr:`Loading.mode`)."""


@dataclass(frozen=True, kw_only=True)
class Loading:
    """How the processes of a job get the weights: each reads the files, or one reads them and broadcasts.

    A single process always reads the files itself, whatever the mode. See ``docs/parallel.md`` ("Loading the
    weights") for the memory and time each mode costs.
    """

    mode: str = _doc(
        "'every-rank': every process reads the whole checkpoint; 'rank0': global rank 0 reads it and broadcasts "
        "every tensor to the other ranks, which build the pipeline from its configs without reading weights; "
        "'node-rank0': each node's local rank 0 reads it and broadcasts within its node.",
        "every-rank",
    )
    timeout_s: float = _doc(
        "Seconds the other ranks wait for the reading rank (they wait in the first collective while it reads); "
        "applies to the process group created for loading.",
        DEFAULT_TIMEOUT_S,
    )

    def __post_init__(self) -> None:
        _check_fields(self, mode=_one_of(*LOAD_MODES), timeout_s=_number(1))

    @property
    def broadcasts(self) -> bool:
        """Whether one rank (per job or per node) reads the files and broadcasts the tensors."""
        return self.mode != "every-rank"


# torch.compile modes that capture CUDA graphs themselves.
_GRAPHING_MODES = ("reduce-overhead", "max-autotune")


@dataclass(frozen=True, kw_only=True)
class Compile:
    """torch.compile settings for the transformer blocks (cache decisions stay outside compiled code), and
    optionally the VAE decoders."""

    backend: str = _doc("torch.compile backend.", "inductor")
    mode: str | None = _doc("torch.compile mode, e.g. 'max-autotune-no-cudagraphs'.", None)
    fullgraph: bool = _doc("Fail on graph breaks inside a block.", False)
    dynamic: bool | None = _doc("Dynamic shapes (None: torch decides).", None)
    cuda_graph: bool = _doc(
        "Capture calls in CUDA graphs per input signature and replay them, collectives included (removes CPU launch "
        "overhead; CUDA only).",
        False,
    )
    graph_scope: str = _doc(
        "'call': one graph per transformer call; 'blocks': one per block call, inside the cache's block hooks so "
        "cache decisions stay on the host; 'auto': 'blocks' with a cache, else 'call'.",
        "auto",
    )
    graph_warmup: int = _doc("Calls per input signature run normally before the CUDA graph is captured.", 2)
    max_graphs: int = _doc("Input signatures captured per transformer; later new signatures run without a graph.", 8)
    vae: bool = _doc(
        "Also compile each VAE's decoder (its norms and activations fuse; the decode is part of every image's "
        "time). Not with Parallel(vae=True), whose row bands exchange halos between the decoder's layers.",
        False,
    )

    outer: bool = _doc(
        "Also compile each of the transformer's modules outside its blocks (patch, time and text embedders, RoPE "
        "tables, the final norm and projection) on its own: a step a cache skips runs little else, so their many "
        "small kernels are most of what such a step costs beyond its front blocks.",
        False,
    )

    def __post_init__(self) -> None:
        _check_fields(
            self,
            vae=_BOOL,
            outer=_BOOL,
            backend=_TEXT,
            mode=_optional(_TEXT),
            fullgraph=_BOOL,
            dynamic=_optional(_BOOL),
            cuda_graph=_BOOL,
            graph_scope=_one_of("auto", "call", "blocks"),
            graph_warmup=_integer(1),
            max_graphs=_integer(1),
        )
        if self.cuda_graph and self.mode in _GRAPHING_MODES:
            raise FieldsError(
                "Compile",
                {"mode": self.mode, "cuda_graph": self.cuda_graph},
                f"a mode among {_GRAPHING_MODES} captures CUDA graphs itself, so does cuda_graph=True; "
                "use one of them (e.g. mode='max-autotune-no-cudagraphs')",
            )


@dataclass(frozen=True, kw_only=True)
class Fuse:
    """Projections that share an input computed as one matmul per group (their weights concatenated), as the
    transformer's family declares them (FLUX: each single block's Q/K/V and MLP input projections, each double
    block's Q/K/V per stream). The model's outputs are unchanged up to the matmuls' rounding."""

    exclude: tuple[str, ...] = _doc(
        "Member-layer patterns (fnmatch, relative to the transformer, e.g. 'single_transformer_blocks.*.proj_mlp'): "
        "a group with a matching member is left unfused.",
        (),
    )

    def __post_init__(self) -> None:
        if isinstance(self.exclude, str):  # one pattern given alone
            object.__setattr__(self, "exclude", (self.exclude,))
        elif isinstance(self.exclude, Iterable) and not isinstance(self.exclude, bytes):
            object.__setattr__(self, "exclude", tuple(self.exclude))
        _check_fields(self, exclude=_PATTERNS)


@dataclass(frozen=True, kw_only=True)
class Offload:
    """Transformer blocks kept in host memory and brought onto the device for their own call.

    For a transformer larger than the device's memory: the blocks beyond :attr:`resident_blocks` wait in (pinned)
    host memory and are copied in on a side stream while earlier blocks compute. Offload sits beneath a step cache:
    a block that a cached step passes through is never transferred, and the blocks every step runs (a cache's front
    and back blocks) are the first to stay resident.
    """

    resident_blocks: int = _doc(
        "Blocks that stay on the device: those every step runs first (a cache's front and back blocks), then evenly "
        "spaced among the rest. 0: every block is streamed.",
        0,
    )
    prefetch: int = _doc("Streamed blocks copied ahead of the one computing (more overlap, more memory).", 2)
    device: str | None = _doc(
        "Where the pipeline computes ('cuda', 'cuda:1'; None: the current CUDA device, else where it is now). Every "
        "other weight of the pipeline is moved there.",
        None,
    )
    pin_memory: bool = _doc("Pin the host copies (faster, asynchronous copies; CUDA only).", True)

    def __post_init__(self) -> None:
        _check_fields(
            self,
            resident_blocks=_integer(0),
            prefetch=_integer(0),
            device=_optional(_TEXT),
            pin_memory=_BOOL,
        )
        if self.device is not None and not re.fullmatch(r"[a-z]+(:\d+)?", self.device):
            raise FieldError("Offload", "device", self.device, "must be a device name such as 'cuda' or 'cuda:1'")


ATTENTION_BACKENDS = ("sdpa", "flash", "cudnn", "efficient", "math", "flash-attn", "sage", "cudnn-fp8")


@dataclass(frozen=True, kw_only=True)
class Attention:
    """Attention backend selection: the local kernel under context parallelism, every SDPA call of the transformer
    on one device.

    ``cudnn-fp8`` runs cuDNN's fused FP8 attention (``nvidia-cudnn-frontend``; CUDA, compute capability >= 9.0)
    with per-tensor scales: each call's own absmax of Q, K and V, or — with ``scales`` — the maxima a calibration
    recorded at each attention module (:func:`fastdit.calibration.calibrate_scales` records them beside the Linear
    layers' inputs), which spares the producers of Q/K/V a reduction over the whole tensor. On one device, calls a
    backend cannot take (masks for the kernels without them, dropout, causal) run the ordinary SDPA.
    """

    backend: str = _doc(f"One of {', '.join(ATTENTION_BACKENDS)}.", "sdpa")
    gqa: Literal["auto", "native", "repeat"] = _doc("GQA: 'native' (enable_gqa), 'repeat' K/V, or 'auto'.", "auto")
    scales: ActivationScales | None = _doc(
        "backend='cudnn-fp8': static Q/K/V scales per attention module, from a calibration "
        "(fastdit.calibration.calibrate_scales; on the command line scales=PATH); modules without a recorded "
        "scale keep dynamic scales.",
        None,
    )
    headroom: float = _doc(
        "With scales: each scale is the recorded maximum times this over 448 (larger inputs are clipped to it).", 1.0
    )
    calibrate: bool = _doc(
        "Record every attention module's largest |Q|, |K|, |V| while computing with the backend (any but "
        "'cudnn-fp8'); fastdit.calibration.calibrate_scales reads them.",
        False,
    )

    def __post_init__(self) -> None:
        _check_fields(
            self,
            backend=_one_of(*ATTENTION_BACKENDS),
            gqa=_one_of("auto", "native", "repeat"),
            scales=_optional(_instance(ActivationScales)),
            headroom=_number(1.0, 1024.0),
            calibrate=_BOOL,
        )
        if (self.scales is not None or self.headroom != 1.0) and self.backend != "cudnn-fp8":
            given = {"backend": self.backend, "scales": self.scales, "headroom": self.headroom}
            raise FieldsError("Attention", given, "scales and headroom belong to backend='cudnn-fp8'")
        if self.calibrate and (self.backend == "cudnn-fp8" or self.scales is not None):
            given = {"backend": self.backend, "scales": self.scales, "calibrate": True}
            raise FieldsError(
                "Attention", given, "calibrate records in the model's dtype: use another backend and no scales"
            )


GRAPH_SCOPES = ("auto", "call", "blocks")


@dataclass(frozen=True, kw_only=True)
class CudaGraph:
    """CUDA graphs: capture calls once per input signature and replay them (CUDA only; no ``torch.compile`` needed).

    Graphs remove CPU launch overhead, which dominates when each GPU's share of the work is small (context
    parallelism, small images, compiled kernels). With :class:`Compile` as well, the compiled blocks are graphed.
    """

    scope: str = _doc(
        "'call': one graph per transformer call (hooks and collectives included); 'blocks': one per block call, "
        "beneath the cache's block hooks so cache decisions stay on the host; 'auto': 'blocks' with a cache, else "
        "'call'.",
        "auto",
    )
    warmup: int = _doc("Calls per input signature run normally before the graph is captured.", 2)
    max_graphs: int = _doc(
        "Input signatures captured per transformer (or block); later new ones run without a graph.", 8
    )

    def __post_init__(self) -> None:
        _check_fields(self, scope=_one_of(*GRAPH_SCOPES), warmup=_integer(1), max_graphs=_integer(1))

    @classmethod
    def from_compile(cls, compile: Compile) -> CudaGraph | None:
        """The graphs a ``Compile(cuda_graph=True, graph_*=...)`` asks for (``None`` without ``cuda_graph``)."""
        if not compile.cuda_graph:
            return None
        return cls(scope=compile.graph_scope, warmup=compile.graph_warmup, max_graphs=compile.max_graphs)


QUANTIZE_MODES = ("fp8", "fp8_static", "fp8_tensor", "fp8_weight", "int8_weight", "int8")
"""The :class:`Quantize` modes: FP8 dynamic activations and weights with per-row (``fp8``) or per-tensor
(``fp8_tensor``) scales, FP8 with static per-tensor activation scales recorded on calibration runs
(``fp8_static``), FP8 or int8 weight-only (``fp8_weight``, ``int8_weight``: for memory), and int8 dynamic
activations and weights (``int8``)."""

FP8_DYNAMIC_MODES = ("fp8", "fp8_tensor")
"""The modes whose matmuls run in FP8 with scales computed from each activation (CUDA compute capability 8.9 or
newer: torchao's dynamic FP8 refuses other devices)."""

STATIC_FP8_MODES = ("fp8_static",)
"""The modes whose matmuls run in FP8 with activation scales fixed by a calibration (:class:`ActivationScales`)."""

WEIGHT_SCALES = ("tensor", "row")
"""How ``Quantize(mode="fp8_static")`` scales a weight: one scale for the whole tensor, or one per output channel."""

FP8_MAX = 448.0
"""The largest finite value of ``float8_e4m3fn``: a static scale maps a layer's recorded maximum to it."""


def static_fp8_scale(amax: float, headroom: float) -> float:
    """The fixed FP8 scale mapping ``amax * headroom`` to e4m3's largest value; an input that was all zeros on the
    calibration gets the smallest normal float32 (a scale of 0 would divide by zero)."""
    return max(amax * headroom / FP8_MAX, 1.1754943508222875e-38)  # float32's smallest normal: torch.finfo's tiny


_LAYER_NAMES = _Rule(
    lambda v: isinstance(v, tuple) and all(isinstance(n, str) and n for n in v) and len(set(v)) == len(v),
    "a tuple of unique non-empty layer names",
)
_MAXIMA = _Rule(
    lambda v: isinstance(v, tuple) and all(_is_number(a) and a >= 0 for a in v), "a tuple of finite numbers >= 0"
)
_RANKS = _Rule(lambda v: isinstance(v, tuple) and all(_is_int(d) and d >= 2 for d in v), "a tuple of integers >= 2")


@dataclass(frozen=True, kw_only=True, repr=False)
class ActivationScales:
    """The largest absolute input each Linear layer saw on calibration runs: ``Quantize(mode="fp8_static")`` fixes
    every layer's activation scale to ``amax * headroom / 448`` (448: e4m3's largest value).

    Record them with :func:`fastdit.calibration.calibrate_scales` (or ``fastdit calibrate MODEL --scales PATH``);
    a layer's name is its denoiser's name in the pipeline and its path there
    (``transformer.single_transformer_blocks.0.proj_out``). Under context or tensor parallelism every rank records
    the maximum over all ranks, so every rank quantizes with the same scales.

    A calibration also records the attention inputs of each attention module whose processor goes through diffusers'
    dispatch: ``<denoiser>.<module path>:q`` (``:k``, ``:v``), the largest absolute query, key and value, for
    ``Attention(backend="cudnn-fp8", scales=...)``.
    """

    layers: tuple[str, ...] = _doc("Layer names, '<denoiser>.<path in the denoiser>'.", ())
    amax: tuple[float, ...] = _doc("The largest absolute input of each layer, in the order of layers.", ())
    ndims: tuple[int, ...] = _doc("The number of dimensions of each layer's input (the shape of its scale).", ())
    model: str = _doc("What was calibrated (the denoisers' classes), for messages.", "unknown")

    def __post_init__(self) -> None:
        for name in ("layers", "amax", "ndims"):
            value = getattr(self, name)
            if isinstance(value, list):  # JSON gives lists; the frozen config keeps tuples
                object.__setattr__(self, name, tuple(value))
        _check_fields(self, layers=_LAYER_NAMES, amax=_MAXIMA, ndims=_RANKS, model=_TEXT)
        if not len(self.layers) == len(self.amax) == len(self.ndims):
            raise FieldsError(
                "ActivationScales",
                {"layers": len(self.layers), "amax": len(self.amax), "ndims": len(self.ndims)},
                "needs one amax and one input rank per layer",
            )

    def __repr__(self) -> str:  # the full table would drown every message that shows a Quantize
        return f"ActivationScales(model={self.model!r}, {len(self.layers)} layers)"

    def lookup(self) -> dict[str, tuple[float, int]]:
        """Layer name → (amax, input rank)."""
        return {name: (a, d) for name, a, d in zip(self.layers, self.amax, self.ndims, strict=True)}


@dataclass(frozen=True, kw_only=True)
class Quantize:
    """Quantize the transformer's linear layers with torchao (the ``torchao`` package: ``fastdit[quant]``).

    By default every ``nn.Linear`` inside the transformer blocks is quantized, and nothing outside them: the
    embedders (patch, time, text) and the final norm and projection stay in the model's dtype, which is where
    quantization costs the most quality for the least time. ``include`` widens or narrows that set by name.
    """

    mode: str = _doc(
        "'fp8': FP8 activations and weights, per-row scales (CUDA, compute capability >= 8.9); 'fp8_tensor': the "
        "same with per-tensor scales; 'fp8_static': FP8 with per-tensor activation scales fixed by a calibration "
        "(scales=; no reduction over the activations at run time); 'fp8_weight' / 'int8_weight': weights only "
        "(memory; any device); 'int8': int8 activations and weights.",
        "fp8",
    )
    include: tuple[str, ...] = _doc(
        "Layer-name patterns (fnmatch, relative to the transformer, e.g. 'transformer_blocks.*') to quantize "
        "(empty: every Linear inside the transformer blocks).",
        (),
    )
    exclude: tuple[str, ...] = _doc(
        "Layer-name patterns never quantized, even when included (e.g. '*.norm1.linear' keeps AdaLN modulation).", ()
    )
    min_size: int = _doc("Linear layers with fewer weight elements than this stay unquantized.", 0)
    scales: ActivationScales | None = _doc(
        "mode='fp8_static': the recorded input maxima (fastdit.calibration.calibrate_scales; on the command line "
        "scales=PATH, a file fastdit calibrate --scales wrote).",
        None,
    )
    headroom: float = _doc(
        "mode='fp8_static': each scale is the recorded maximum times this over 448, so inputs up to this many "
        "times larger than any calibration input are not clipped (e4m3 keeps its relative precision at any scale).",
        1.0,
    )
    calibrate: bool = _doc(
        "mode='fp8_static': record the input maxima instead of quantizing (the model computes in its own dtype; "
        "fastdit.calibration.calibrate_scales reads them).",
        False,
    )
    weight_scales: str = _doc(
        "mode='fp8_static': 'tensor' (one scale per weight: torchao's static config) or 'row' (one scale per output "
        "channel, the matmul by torch._scaled_mm's row-wise kernels; bfloat16 weights).",
        "tensor",
    )

    def __post_init__(self) -> None:
        for name in ("include", "exclude"):
            value = getattr(self, name)
            if isinstance(value, str):  # one pattern given alone
                object.__setattr__(self, name, (value,))
            elif isinstance(value, Iterable) and not isinstance(value, bytes):
                object.__setattr__(self, name, tuple(value))
        _check_fields(
            self,
            mode=_one_of(*QUANTIZE_MODES),
            include=_PATTERNS,
            exclude=_PATTERNS,
            min_size=_integer(0),
            scales=_optional(_instance(ActivationScales)),
            headroom=_number(1.0, 1024.0),
            calibrate=_BOOL,
            weight_scales=_one_of(*WEIGHT_SCALES),
        )
        static = self.mode in STATIC_FP8_MODES
        if not static and (
            self.scales is not None or self.calibrate or self.headroom != 1.0 or self.weight_scales != "tensor"
        ):
            given = {
                "mode": self.mode,
                "scales": self.scales,
                "headroom": self.headroom,
                "calibrate": self.calibrate,
                "weight_scales": self.weight_scales,
            }
            raise FieldsError(
                "Quantize", given, "scales, headroom, calibrate and weight_scales belong to mode='fp8_static'"
            )
        if static and self.scales is None and not self.calibrate:
            raise FieldsError(
                "Quantize",
                {"mode": self.mode, "scales": None},
                "needs the activation scales of a calibration: record them with "
                "fastdit.calibration.calibrate_scales(pipe, run) (or `fastdit calibrate MODEL --scales PATH`) and "
                "pass scales=",
            )

    @property
    def dynamic_fp8(self) -> bool:
        """Whether the matmuls run in FP8 with dynamic scales (a GPU of compute capability 8.9 or newer)."""
        return self.mode in FP8_DYNAMIC_MODES

    @property
    def fp8_matmuls(self) -> bool:
        """Whether the matmuls run in FP8 (dynamic or static scales: both dims of a weight a multiple of 16)."""
        return self.mode in FP8_DYNAMIC_MODES or self.mode in STATIC_FP8_MODES
