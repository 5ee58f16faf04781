"""Quality-targeted cache calibration: search cache configurations on calibration cases for a target, check held-out.

The search space is a set of *ladders*: one policy with one cap on consecutive skipped steps, its threshold rising
step by step (more work skipped, lower quality). Each ladder is climbed from its least aggressive rung until the
target stops holding (a quality target) or first holds (a work target), so a ladder costs at most its length in runs
and usually far less:

- ``Target(psnr=32)``: the fewest blocks computed among configurations whose worst calibration image has
  PSNR ≥ ``psnr + margin_db`` and SSIM ≥ ``ssim`` (the margin absorbs the drop to cases never tuned on);
- ``Target(speedup=3)``: at most 1/3 of the blocks, and among those the best worst-image PSNR (SSIM ≥ ``ssim``).

The chosen configuration is then measured on the held-out cases (never used by the search), so the report says how
the claim holds where it was not tuned. Work is counted as block evaluations (:class:`BlockCounter`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastdit.bench.heldout import CALIBRATION, HELDOUT, SplitBench, fastdit_variant
from fastdit.bench.sweep import BenchRow
from fastdit.config import DBCache, MagCache, MagCalibration, MagCalibrations, TaylorSeer, TeaCache, TeaCalibration

__all__ = [
    "DEFAULT_POLICIES",
    "POLICIES",
    "Calibrated",
    "Ladder",
    "Target",
    "calibrate_cache",
    "ladders",
]

POLICIES = ("magcache", "teacache", "spectral", "dbcache")
"""Policies the search can try: MagCache (whole-step, calibrated ratios), TeaCache (whole-step, calibrated input
change), TeaCache's spectral signal (whole-step, the noise-aware change of the latent: no calibration, for families
that declare their latent) and DBCache F1B0 with TaylorSeer."""

DEFAULT_POLICIES = ("magcache", "dbcache")
"""Policies searched unless asked otherwise (TeaCache found nothing better on the reference pipeline, see
``docs/cache.md``, and its ladders would double the search's cost)."""

# Thresholds along each ladder, from nearly lossless to aggressive.
_MAG_THRESHOLDS = (0.02, 0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.9)
_MAG_CAPS = (2, 3, 4, 5)
# The MagCache settings the held-out frontier favoured (docs/cache.md): few retained steps, a second-order forecast.
_MAG_RETENTION = 0.07
# TeaCache: the accumulated rescaled change is a residual change summed over the skipped steps; on the reference
# pipeline a step adds 0.03 to 0.15, so from 0.3 on the cap binds and the rungs take MagCache's steps.
_TEA_THRESHOLDS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.8)
_TEA_CAPS = (2, 3, 4)
_TEA_RETENTION = 0.07
# The spectral signal: on the video reference a step changes the filtered latent by 0.02 to 0.3 early and less
# later; its frontier point (τ 0.35, cap 4, one retained and the final step computed) sits mid-ladder.
_SPECTRAL_THRESHOLDS = (0.1, 0.2, 0.3, 0.35, 0.45, 0.6)
_SPECTRAL_CAPS = (3, 4)
_DB_THRESHOLDS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.65, 0.8, 1.0, 1.3)
_DB_CAPS = (2, 3, 4, 6)


@dataclass(frozen=True)
class Target:
    """What the calibration aims for: a worst-image PSNR or a reduction of the work (exactly one).

    Attributes:
        psnr: Lowest PSNR (dB) the worst image may have.
        speedup: Block evaluations of an uncached run / those of the cached run.
        ssim: Lowest SSIM the worst image may have (both kinds of target).
        margin_db: With ``psnr``: how far above it the calibration cases must stay.
    """

    psnr: float | None = None
    speedup: float | None = None
    ssim: float = 0.90
    margin_db: float = 1.0

    def __post_init__(self) -> None:
        if (self.psnr is None) == (self.speedup is None):
            raise ValueError(f"Target(psnr={self.psnr}, speedup={self.speedup}): give exactly one of them")
        if self.psnr is not None and not self.psnr > 0:
            raise ValueError(f"Target.psnr={self.psnr}: expected a positive number of dB")
        if self.speedup is not None and not self.speedup > 1:
            raise ValueError(f"Target.speedup={self.speedup}: expected a number above 1")
        if not 0 <= self.ssim <= 1:
            raise ValueError(f"Target.ssim={self.ssim}: expected a value in [0, 1]")
        if self.margin_db < 0:
            raise ValueError(f"Target.margin_db={self.margin_db}: expected a non-negative number")

    def meets(self, row: BenchRow) -> bool:
        """Whether ``row`` (measured on the calibration cases) satisfies the target."""
        psnr, ssim = row.worst  # a video is judged clip by clip, as its goal is stated
        if ssim < self.ssim:
            return False
        if self.psnr is not None:
            return psnr >= self.psnr + self.margin_db
        return row.blocks_computed_fraction <= 1 / self.speedup

    def better(self, row: BenchRow, than: BenchRow) -> bool:
        """Whether ``row`` is preferred over ``than`` (both meeting the target)."""
        mine, theirs = row.worst[0], than.worst[0]
        if self.psnr is not None:
            return (row.blocks_computed_fraction, -mine) < (than.blocks_computed_fraction, -theirs)
        return (mine, -row.blocks_computed_fraction) > (theirs, -than.blocks_computed_fraction)

    def describe(self) -> str:
        """The target in words, for tables and errors."""
        if self.psnr is not None:
            return f"PSNR_min >= {self.psnr:g} dB (+{self.margin_db:g} dB margin), SSIM_min >= {self.ssim:g}"
        return f"<= {100 / self.speedup:.1f}% of the blocks ({self.speedup:g}x), SSIM_min >= {self.ssim:g}"


@dataclass(frozen=True)
class Ladder:
    """One policy and cap, its configurations from the least to the most aggressive."""

    name: str
    configs: tuple[tuple[str, Any], ...]


def ladders(
    policies: Sequence[str],
    num_steps: int,
    calibration: MagCalibration | MagCalibrations | None,
    tea_calibration: TeaCalibration | None = None,
) -> list[Ladder]:
    """The search space for ``policies`` (MagCache needs ``calibration``: one per denoiser where there are several;
    TeaCache ``tea_calibration``).

    Raises:
        ValueError: An unknown policy, or a calibrated policy without its calibration.
    """
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        raise ValueError(f"policies={list(policies)}: expected some of {', '.join(POLICIES)}")
    out: list[Ladder] = []
    forecast = TaylorSeer(order=2, variable="timestep")
    if "magcache" in policies:
        if calibration is None:
            raise ValueError("policy 'magcache' needs the model's MagCalibration")
        for cap in _MAG_CAPS:
            rungs = tuple(
                (
                    f"magcache,threshold={t:g},max_skip_steps={cap}",
                    MagCache(threshold=t, max_skip_steps=cap, retention_ratio=_MAG_RETENTION, taylorseer=forecast,
                             calibration=calibration),
                )
                for t in _MAG_THRESHOLDS
            )  # fmt: skip
            out.append(Ladder(f"magcache TaylorSeer cap {cap}", rungs))
    if "teacache" in policies:
        if tea_calibration is None:
            raise ValueError("policy 'teacache' needs the model's TeaCalibration")
        for cap in _TEA_CAPS:
            rungs = tuple(
                (
                    f"teacache,threshold={t:g},max_skip_steps={cap}",
                    TeaCache(threshold=t, max_skip_steps=cap, retention_ratio=_TEA_RETENTION, final_steps=0,
                             taylorseer=forecast, calibration=tea_calibration),
                )
                for t in _TEA_THRESHOLDS
            )  # fmt: skip
            out.append(Ladder(f"teacache TaylorSeer cap {cap}", rungs))
    if "spectral" in policies:
        for cap in _SPECTRAL_CAPS:
            rungs = tuple(
                (
                    f"teacache,signal=spectral,threshold={t:g},max_skip_steps={cap}",
                    TeaCache(signal="spectral", threshold=t, max_skip_steps=cap, retention_ratio=_TEA_RETENTION,
                             final_steps=1, taylorseer=forecast),
                )
                for t in _SPECTRAL_THRESHOLDS
            )  # fmt: skip
            out.append(Ladder(f"teacache spectral TaylorSeer cap {cap}", rungs))
    if "dbcache" in policies:
        for cap in _DB_CAPS:
            rungs = tuple(
                (
                    f"dbcache,fn=1,bn=0,threshold={t:g},max_continuous_cached_steps={cap}",
                    DBCache(fn=1, bn=0, threshold=t, warmup_steps=2, max_continuous_cached_steps=cap,
                            taylorseer=forecast),
                )
                for t in _DB_THRESHOLDS
            )  # fmt: skip
            out.append(Ladder(f"dbcache F1B0 TaylorSeer cap {cap}", rungs))
    del num_steps  # the thresholds are schedule-relative: one space serves every step count
    return out


@dataclass
class Calibrated:
    """What a calibration found.

    Attributes:
        target: The target.
        chosen: The chosen configuration's name and config (``None``: none met the target).
        calibration: The chosen configuration on the calibration cases.
        heldout: The chosen configuration on the held-out cases (``None``: no held-out cases).
        candidates: Every configuration measured, on the calibration cases, in the order run.
    """

    target: Target
    chosen: tuple[str, Any] | None
    calibration: BenchRow | None
    heldout: BenchRow | None
    candidates: list[BenchRow] = field(default_factory=list)


def _search_ladder(ladder: Ladder, measure: Callable[[str, Any], BenchRow], target: Target) -> int | None:
    """Index of the rung of ``ladder`` the target takes (``None``: none), climbing from the least aggressive.

    A quality target climbs while the rungs meet it and stops at the first miss: along a ladder quality mostly
    falls, but not always (MagCache's skipped steps move with the threshold, so a higher threshold can skip better
    steps), and a rung that passes beyond a miss passed by chance of the calibration cases more often than not. A
    speed-up target climbs until the first rung within the work budget: the rungs after it lose more quality.
    """
    found: int | None = None
    for index, (name, config) in enumerate(ladder.configs):
        meets = target.meets(measure(name, config))
        if target.psnr is None:
            if meets:
                return index
            continue
        if not meets:
            break
        found = index
    return found


def calibrate_cache(
    bench: SplitBench,
    target: Target,
    space: Sequence[Ladder],
    *,
    heldout: bool = True,
    progress: Callable[[BenchRow], None] | None = None,
) -> Calibrated:
    """Search ``space`` on ``bench``'s calibration cases for ``target``; measure the choice on the held-out cases.

    Args:
        bench: The model and both parts of the split (its uncached baselines are run on first use).
        target: What to reach.
        space: The ladders to search (:func:`ladders`).
        heldout: Also measure the chosen configuration on the held-out cases.
        progress: Called with each measured row.

    Returns:
        The choice and every row measured; ``chosen`` is ``None`` when no configuration met the target.
    """
    rows: dict[str, BenchRow] = {}

    def measure(name: str, config: Any) -> BenchRow:
        if name not in rows:
            rows[name] = bench.measure_part(fastdit_variant(bench.session, name, config), CALIBRATION)
            if progress is not None:
                progress(rows[name])
        return rows[name]

    best: tuple[str, Any] | None = None
    for ladder in space:
        index = _search_ladder(ladder, measure, target)
        if index is None:
            continue
        name, config = ladder.configs[index]
        if best is None or target.better(rows[name], rows[best[0]]):
            best = (name, config)
    result = Calibrated(target, best, rows[best[0]] if best else None, None, list(rows.values()))
    if best is not None and heldout:
        result.heldout = bench.measure_part(fastdit_variant(bench.session, *best), HELDOUT)
    return result
