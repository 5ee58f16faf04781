"""Held-out evaluation of cache configurations: tuned on calibration seeds, reported on seeds never tuned on.

A cache's quality depends on the images it runs on: a threshold picked on the seeds it is reported on overstates
its quality on any other seed. A :class:`Split` fixes two disjoint seed sets over the same prompts — the
*calibration* set (what presets and calibrations may be tuned on) and the *held-out* set (never used for tuning) —
and :class:`SplitBench` measures every configuration on both, against the uncached outputs of the same cases::

    bench = SplitBench(session, reference_split(), kwargs, blocks=transformer_blocks(session))
    row = bench.measure(fastdit_variant(session, "balanced", cache_config("balanced")))
    row.heldout.psnr_min, row.calibration.psnr_min, DEFAULT_BAR.holds(row.heldout)

Blocks are counted the same way for every library (:class:`BlockCounter`: a pre-hook on each block's first
sub-module fires only when the block really computes), so anchors from other libraries compare on equal terms.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fastdit.bench.sweep import BenchRow, bench_row
from fastdit.bench.timing import RunResult, run
from fastdit.session import Case, Session

__all__ = [
    "CALIBRATION",
    "CALIBRATION_SEEDS",
    "DEFAULT_BAR",
    "HELDOUT",
    "HELDOUT_SEEDS",
    "BlockCounter",
    "QualityBar",
    "Split",
    "SplitBench",
    "SplitRow",
    "Variant",
    "fastdit_variant",
    "reference_split",
    "transformer_blocks",
]

CALIBRATION = "calibration"
"""The part of a split that configurations may be tuned on."""
HELDOUT = "heldout"
"""The part of a split that no configuration is tuned on."""

CALIBRATION_SEEDS: tuple[int, ...] = (0, 1)
"""Seeds presets and calibrations may be tuned on (the seeds the earlier cache tables reported)."""
HELDOUT_SEEDS: tuple[int, ...] = (101, 202)
"""Seeds never used for tuning: a preset's quality claim is the figure measured on these."""


@dataclass(frozen=True)
class Split:
    """Calibration and held-out cases: every prompt with each seed of a part.

    Attributes:
        prompts: The prompts of both parts.
        calibration_seeds: Seeds that configurations may be tuned on.
        heldout_seeds: Seeds that no configuration is tuned on (disjoint from ``calibration_seeds``).

    Raises:
        ValueError: The parts share a seed, or a part or the prompts are empty.
    """

    prompts: tuple[str, ...]
    calibration_seeds: tuple[int, ...] = CALIBRATION_SEEDS
    heldout_seeds: tuple[int, ...] = HELDOUT_SEEDS

    def __post_init__(self) -> None:
        shared = sorted(set(self.calibration_seeds) & set(self.heldout_seeds))
        if shared:
            raise ValueError(f"Split.heldout_seeds={self.heldout_seeds}: seeds {shared} are also calibration seeds")
        for name in ("prompts", "calibration_seeds", "heldout_seeds"):
            if not getattr(self, name):
                raise ValueError(f"Split.{name}=(): needs at least one entry")

    def seeds(self, part: str) -> tuple[int, ...]:
        """The seeds of ``part`` (:data:`CALIBRATION` or :data:`HELDOUT`)."""
        if part == CALIBRATION:
            return self.calibration_seeds
        if part == HELDOUT:
            return self.heldout_seeds
        raise ValueError(f"part={part!r}: expected {CALIBRATION!r} or {HELDOUT!r}")

    def cases(self, part: str) -> list[Case]:
        """Every prompt with every seed of ``part``, seed-major (all prompts of the first seed, then the next)."""
        return [Case(prompt, seed=seed) for seed in self.seeds(part) for prompt in self.prompts]


def reference_split() -> Split:
    """The reference pipeline's split: its 10 digit prompts, calibration seeds 0 and 1, held-out seeds 101 and 202."""
    from fastdit.reference import digit_prompt

    return Split(prompts=tuple(digit_prompt(d) for d in range(10)))


@dataclass(frozen=True)
class QualityBar:
    """What a configuration must reach on one part: at most ``max_blocks`` of the blocks, worst image above a bar.

    Attributes:
        max_blocks: Largest fraction of block evaluations computed.
        psnr_min: Lowest acceptable PSNR of the worst image (dB).
        ssim_min: Lowest acceptable SSIM of the worst image.
    """

    max_blocks: float
    psnr_min: float
    ssim_min: float = 0.0

    def holds(self, row: BenchRow) -> bool:
        """Whether ``row`` computes at most :attr:`max_blocks` with its worst image at or above both minima."""
        return (
            row.blocks_computed_fraction <= self.max_blocks
            and row.psnr_min >= self.psnr_min
            and row.ssim_min >= self.ssim_min
        )


DEFAULT_BAR = QualityBar(max_blocks=0.30, psnr_min=30.0, ssim_min=0.90)
"""The cache frontier's bar: at most 30 % of the blocks with the worst image at PSNR ≥ 30 dB and SSIM ≥ 0.90."""


class BlockCounter:
    """Counts the blocks that really compute: a forward pre-hook on each block's first sub-module.

    The first sub-module runs only when the block's own forward runs, whichever library's hook decided, so every
    library's cache is counted alike.

    Args:
        blocks: The blocks to count.
    """

    def __init__(self, blocks: Sequence[torch.nn.Module]) -> None:
        self.count = 0
        self.num_blocks = len(blocks)
        self._handles = [next(block.children()).register_forward_pre_hook(self._hit) for block in blocks]

    def _hit(self, *_: object) -> None:
        self.count += 1

    def remove(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def transformer_blocks(session: Session) -> list[torch.nn.Module]:
    """Every block of every denoiser of ``session``'s pipeline, in execution order (through its adapter)."""
    from fastdit.components import walk

    return [block for item in walk(session.pipe).denoisers for _, block in item.blocks()]


@dataclass
class Variant:
    """One configuration to measure: how to install it and take it off again.

    Attributes:
        name: The configuration's name in tables.
        library: Who implements it (``fastdit``, ``diffusers 0.42.1``, ...).
        install: Puts it on the pipeline.
        remove: Takes it off.
        config: The configuration object, for the JSON (``None``: none to record).
    """

    name: str
    library: str
    install: Callable[[], None]
    remove: Callable[[], None]
    config: Any = None


def fastdit_variant(session: Session, name: str, config: Any) -> Variant:
    """A fastdit cache configuration as a :class:`Variant` (``config=None``: the plain pipeline)."""
    if config is None:
        return Variant(name, "fastdit", lambda: None, lambda: None)
    return Variant(name, "fastdit", lambda: session.accelerate(cache=config), session.disable, config)


@dataclass
class SplitRow:
    """One configuration measured on both parts of a split."""

    name: str
    library: str
    calibration: BenchRow
    heldout: BenchRow

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (infinite PSNR as ``"inf"``)."""
        return {
            "name": self.name,
            "library": self.library,
            CALIBRATION: self.calibration.to_dict(),
            HELDOUT: self.heldout.to_dict(),
        }


@dataclass
class SplitBench:
    """Measures configurations on both parts of a split against the uncached outputs of the same cases.

    Attributes:
        session: The loaded, un-accelerated pipeline.
        split: The cases.
        kwargs: Call arguments (:func:`~fastdit.session.call_arguments`).
        blocks: The blocks to count (:func:`transformer_blocks`).
        batch: Cases per pipeline call (a cache decides per call, for every case in it at once).
    """

    session: Session
    split: Split
    kwargs: dict[str, Any]
    blocks: Sequence[torch.nn.Module]
    batch: int = 20
    _counter: BlockCounter | None = field(default=None, init=False, repr=False)
    _baselines: dict[str, tuple[RunResult, int]] = field(default_factory=dict, init=False, repr=False)

    @property
    def counter(self) -> BlockCounter:
        """The block counter (installed on first use)."""
        if self._counter is None:
            self._counter = BlockCounter(self.blocks)
        return self._counter

    def _pass(self, part: str) -> tuple[RunResult, int]:
        self.counter.count = 0
        result = run(self.session, self.split.cases(part), self.kwargs, batch=self.batch)
        return result, self.counter.count

    def baseline(self, part: str) -> tuple[RunResult, int]:
        """The uncached run of ``part`` (run once) and the blocks it computed."""
        if part not in self._baselines:
            self._baselines[part] = self._pass(part)
        return self._baselines[part]

    def measure_part(self, variant: Variant, part: str) -> BenchRow:
        """Run ``variant`` on one part; its quality is against that part's uncached outputs."""
        base, base_blocks = self.baseline(part)
        variant.install()
        try:
            result, blocks = self._pass(part)
        finally:
            variant.remove()
        row = bench_row(variant.name, variant.config, result, base, len(self.split.cases(part)))
        # The counter, not the cache's own statistics: it counts other libraries' caches too.
        row.blocks_computed_fraction = blocks / base_blocks if base_blocks else 1.0
        return row

    def measure(self, variant: Variant) -> SplitRow:
        """Run ``variant`` on both parts; each row's quality is against that part's uncached outputs."""
        calibration, heldout = (self.measure_part(variant, part) for part in (CALIBRATION, HELDOUT))
        return SplitRow(variant.name, variant.library, calibration, heldout)

    def close(self) -> None:
        """Remove the block counter."""
        if self._counter is not None:
            self._counter.remove()
            self._counter = None
