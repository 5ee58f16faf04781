"""A cache sweep: a baseline and several cache configurations on the same cases, one :class:`BenchRow` each."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from fastdit.bench.compare import clip_minima, compare_outputs
from fastdit.bench.plain import plain
from fastdit.bench.timing import RunResult, run_variants
from fastdit.session import Case, ModelSource, Session

__all__ = ["BASELINE", "BenchRow", "Sweep", "bench_row", "measure"]

BASELINE = "baseline"
"""The name of the un-accelerated row every sweep starts with."""


@dataclass
class Sweep:
    """What a sweep runs: the model, the call, the cases and the configurations.

    Attributes:
        source: The model.
        pipeline_class: Its pipeline class.
        kwargs: Call arguments from :func:`~fastdit.session.call_arguments`.
        cases: Prompt and seed of each output, the same for every configuration.
        configs: ``(name, cache config)`` pairs; a ``None`` config runs without a cache (a determinism check).
        device: Where it runs.
        dtype: Parameter dtype.
        num_steps: Denoising steps per call (``None`` if the pipeline does not say).
        warmup: Untimed calls per configuration.
        repeat: Timed passes per configuration.
    """

    source: ModelSource
    pipeline_class: type
    kwargs: dict[str, Any]
    cases: list[Case]
    configs: list[tuple[str, Any]]
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.float32
    num_steps: int | None = None
    warmup: int = 1
    repeat: int = 1

    @property
    def title(self) -> str:
        """One line naming the model, the work and the device, for tables and plots."""
        return f"{self.source.name}: {len(self.cases)} images, {self.num_steps} steps, {self.device}"


@dataclass
class BenchRow:
    """One line of a sweep.

    Attributes:
        name: The configuration as given (:data:`BASELINE` for the baseline).
        config: The cache configuration as plain data (``None``: no cache).
        seconds: Median time per output.
        speedup: Baseline seconds / these seconds.
        blocks_computed_fraction: Blocks computed / blocks of an uncached run.
        cached_steps: Cached steps over all outputs of one pass.
        psnr, psnr_min, ssim, ssim_min: Quality against the baseline outputs (mean and minimum over every image or
            frame).
        psnr_clip_min, ssim_clip_min: Videos only: the worst clip, each judged by its mean over its frames
            (``None`` for images and audio).
        peak_memory: Peak bytes (``None`` when not measurable).
    """

    name: str
    config: dict[str, Any] | None
    seconds: float
    speedup: float = 1.0
    blocks_computed_fraction: float = 1.0
    cached_steps: int = 0
    psnr: float = float("inf")
    psnr_min: float = float("inf")
    ssim: float = 1.0
    ssim_min: float = 1.0
    psnr_clip_min: float | None = None
    ssim_clip_min: float | None = None
    peak_memory: int | None = None

    @property
    def worst(self) -> tuple[float, float]:
        """The worst output's PSNR and SSIM: the worst clip for videos, else the worst image or waveform."""
        if self.psnr_clip_min is not None and self.ssim_clip_min is not None:
            return self.psnr_clip_min, self.ssim_clip_min
        return self.psnr_min, self.ssim_min

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (infinite PSNR as the string ``"inf"``)."""
        from fastdit.metrics import json_safe

        out = asdict(self)
        for name in ("psnr", "psnr_min", "ssim", "ssim_min", "psnr_clip_min", "ssim_clip_min"):
            out[name] = None if out[name] is None else json_safe(out[name])
        return out


def bench_row(name: str, config: Any, result: RunResult, baseline: RunResult | None, count: int) -> BenchRow:
    """The row of one configuration's result, compared with the baseline's (``None``: this is the baseline).

    Args:
        name: The configuration's name.
        config: Its cache config (``None``: no cache).
        result: Its measurement.
        baseline: The baseline's measurement, on the same cases.
        count: Outputs per pass, to turn pass times into times per output.
    """
    row = BenchRow(
        name=name, config=plain(config), seconds=result.median_seconds / count, peak_memory=result.peak_memory
    )
    if result.cache is not None:
        row.blocks_computed_fraction = result.cache.blocks_computed_fraction
        row.cached_steps = result.cache.cached_steps
    if baseline is not None:
        quality = compare_outputs(baseline.outputs, result.outputs, audio=result.output_kind == "audio")
        row.speedup = baseline.median_seconds / result.median_seconds
        row.psnr, row.psnr_min, row.ssim, row.ssim_min = quality.psnr, quality.psnr_min, quality.ssim, quality.ssim_min
        if result.output_kind != "audio":
            clips = clip_minima(result.outputs, quality)
            if clips is not None:
                row.psnr_clip_min, row.ssim_clip_min = clips
    return row


def measure(session: Session, sweep: Sweep) -> list[tuple[BenchRow, RunResult]]:
    """Run the baseline and every configuration, interleaved (see :func:`~fastdit.bench.timing.run_variants`).

    Args:
        session: The loaded, un-accelerated pipeline (left un-accelerated).
        sweep: What to run.

    Returns:
        The baseline's row and result, then each configuration's, in order.
    """
    variants = [{}] + [{"cache": config} if config is not None else {} for _, config in sweep.configs]
    results = run_variants(
        session, variants, sweep.cases, sweep.kwargs, warmup=sweep.warmup, repeat=sweep.repeat, track_memory=True
    )
    baseline, count = results[0], len(sweep.cases)
    measured = [(bench_row(BASELINE, None, baseline, None, count), baseline)]
    for (name, config), result in zip(sweep.configs, results[1:], strict=True):
        measured.append((bench_row(name, config, result, baseline, count), result))
    return measured
