"""``fastdit.bench.sweep`` and ``compare``: rows of a baseline and cache configurations, quality against it."""

from __future__ import annotations

import math

import numpy as np
import pytest

import fastdit
from fastdit.bench import BASELINE, RunResult, Sweep, bench_row, compare_outputs, default_prompts, measure
from fastdit.session import Case, ModelSource
from tests.bench.fakes import FakeSession


def test_compare_outputs_goes_frame_by_frame() -> None:
    image = np.linspace(0, 1, 16 * 16 * 3, dtype=np.float32).reshape(16, 16, 3)
    video = np.stack([image, image[::-1]])
    same = compare_outputs([image, video], [image, video])
    assert same.count == 3 and same.psnr == math.inf and same.ssim_min == 1.0
    noisy = compare_outputs([video], [np.clip(video + 0.01, 0, 1)])
    assert noisy.count == 2 and 30 < noisy.psnr < math.inf


def test_bench_row_against_the_baseline() -> None:
    image = np.zeros((16, 16, 3), np.float32)
    baseline = RunResult(outputs=[image], seconds=[4.0])
    result = RunResult(outputs=[image + 0.1], seconds=[2.0])
    row = bench_row("fast", fastdit.FBCache(), result, baseline, count=2)
    assert row.seconds == 1.0 and row.speedup == 2.0 and row.config["type"] == "DBCache"
    assert row.psnr == row.psnr_min == pytest.approx(20.0) and row.ssim < 1
    first = bench_row(BASELINE, None, baseline, None, count=2)
    assert first.config is None and first.to_dict()["psnr"] == "inf"


def test_measure_runs_the_baseline_then_every_configuration() -> None:
    session = FakeSession()
    sweep = Sweep(
        source=session.source,
        pipeline_class=type(session.pipe),
        kwargs={},
        cases=[Case("a"), Case("b", seed=1)],
        configs=[("none", None), ("fbcache", fastdit.FBCache())],
        warmup=0,
        repeat=2,
        num_steps=4,
    )
    measured = measure(session, sweep)
    assert [row.name for row, _ in measured] == [BASELINE, "none", "fbcache"]
    assert session.log == ["accelerate cache", "disable"] * 3  # the warm-up round and 2 passes; "none" runs plain
    none, cached = measured[1][0], measured[2][0]
    assert none.psnr == math.inf and none.blocks_computed_fraction == 1.0
    assert cached.blocks_computed_fraction == 0.75 and cached.cached_steps == 2
    assert sweep.title == "fake: 2 images, 4 steps, cpu"


def test_default_prompts() -> None:
    other = default_prompts(ModelSource("x", "diffusers.FluxPipeline"), 10)
    assert len(other) == 10 and other[0] == other[8] and len(set(other)) == 8
    reference = default_prompts(ModelSource("reference", "diffusers.FluxPipeline", reference=True), 11)
    assert reference[3] == "a handwritten digit 3" and reference[10] == reference[0]
