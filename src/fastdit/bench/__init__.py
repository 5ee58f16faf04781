"""Time, measure and compare runs of a :class:`~fastdit.session.Session`, and report them.

::

    session, load_seconds = timed_load(resolve_model(None, None), device="cpu", dtype=torch.float32)
    kwargs = call_arguments(session.pipeline_class, session.source.defaults, {})
    base, cached = run_variants(session, [{}, {"cache": fastdit.FBCache(0.12)}], [Case("a handwritten digit 3")],
                                kwargs, warmup=1, repeat=3)
    base.median_seconds / cached.median_seconds, compare_outputs(base.outputs, cached.outputs).psnr

Modules: :mod:`~fastdit.bench.timing` (runs and their times), :mod:`~fastdit.bench.memory` (peak memory),
:mod:`~fastdit.bench.compare` (quality against a baseline), :mod:`~fastdit.bench.sweep` (cache configurations against
a baseline), :mod:`~fastdit.bench.heldout` (calibration vs held-out seeds), :mod:`~fastdit.bench.report` (markdown,
JSON, plot), :mod:`~fastdit.bench.plain` (configs as JSON data),
:mod:`~fastdit.bench.prompts` (default prompts).
"""

from __future__ import annotations

from fastdit.bench.compare import compare_outputs
from fastdit.bench.memory import MemoryTracker
from fastdit.bench.plain import json_ready, plain, plain_options
from fastdit.bench.prompts import BENCH_PROMPTS, default_prompts
from fastdit.bench.report import device_name, markdown, markdown_table, plot, report_json, write_reports
from fastdit.bench.sweep import BASELINE, BenchRow, Sweep, bench_row, measure
from fastdit.bench.timing import CacheStats, RunResult, run, run_variants, time_calls, timed_load

__all__ = [
    "BASELINE",
    "BENCH_PROMPTS",
    "BenchRow",
    "CacheStats",
    "MemoryTracker",
    "RunResult",
    "Sweep",
    "bench_row",
    "compare_outputs",
    "default_prompts",
    "device_name",
    "json_ready",
    "markdown",
    "markdown_table",
    "measure",
    "plain",
    "plain_options",
    "plot",
    "report_json",
    "run",
    "run_variants",
    "time_calls",
    "timed_load",
    "write_reports",
]
