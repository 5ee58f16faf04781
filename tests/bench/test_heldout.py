"""``fastdit.bench.heldout``: the calibration / held-out split and configurations measured on both parts."""

from __future__ import annotations

import math

import pytest
import torch

import fastdit
from fastdit.bench.heldout import (
    CALIBRATION,
    DEFAULT_BAR,
    HELDOUT,
    HELDOUT_SEEDS,
    QualityBar,
    Split,
    SplitBench,
    fastdit_variant,
    reference_split,
    transformer_blocks,
)
from fastdit.bench.sweep import BenchRow
from fastdit.session import ModelSource, Session


def test_split_is_disjoint_and_seed_major() -> None:
    split = reference_split()
    assert split.heldout_seeds == HELDOUT_SEEDS == (101, 202)
    assert not set(split.calibration_seeds) & set(split.heldout_seeds)
    cases = split.cases(HELDOUT)
    assert len(cases) == 20 and [c.seed for c in cases[:10]] == [101] * 10
    assert cases[3].prompt == "a handwritten digit 3" and cases[13].prompt == "a handwritten digit 3"
    with pytest.raises(ValueError, match=r"seeds \[1\] are also calibration seeds"):
        Split(prompts=("a",), calibration_seeds=(0, 1), heldout_seeds=(1, 2))
    with pytest.raises(ValueError, match="part='test'"):
        split.cases("test")


def test_quality_bar_needs_work_and_the_worst_image() -> None:
    row = BenchRow("x", None, 1.0, blocks_computed_fraction=0.3, psnr=40.0, psnr_min=30.0, ssim_min=0.95)
    assert DEFAULT_BAR.holds(row)
    assert not QualityBar(0.25, 30.0).holds(row)  # too much work
    assert not QualityBar(0.4, 35.0).holds(row)  # the worst image is below the bar


def test_split_bench_scores_each_part_against_its_own_baseline() -> None:
    from fastdit.models.flux import tiny_flux

    pipe = tiny_flux(0)
    pipe.set_progress_bar_config(disable=True)
    session = Session(pipe, ModelSource("tiny", "diffusers.FluxPipeline"), torch.device("cpu"))
    kwargs = {"num_inference_steps": 3, "height": 32, "width": 32, "max_sequence_length": 16, "output_type": "np"}
    split = Split(prompts=("a cat",), calibration_seeds=(0,), heldout_seeds=(7,))
    bench = SplitBench(session, split, kwargs, transformer_blocks(session), batch=1)
    try:
        plain = bench.measure(fastdit_variant(session, "none", None))
        mask = fastdit.StepMask(compute_steps=(0, 2), policy="static")
        cached = bench.measure(fastdit_variant(session, "mask", fastdit.DBCache(fn=1, bn=0, step_mask=mask)))
    finally:
        bench.close()
    # A part compared with the other part's baseline would give a finite PSNR for the plain pipeline.
    assert plain.calibration.psnr == plain.heldout.psnr == math.inf
    assert plain.heldout.blocks_computed_fraction == 1.0
    # The block counter agrees with the cache's own count: 2 of 3 steps compute all blocks, 1 only the front one.
    blocks = len(transformer_blocks(session))
    for row in (cached.calibration, cached.heldout):
        assert row.blocks_computed_fraction == pytest.approx((2 * blocks + 1) / (3 * blocks))
        assert row.psnr < math.inf and row.cached_steps == 1
    assert set(cached.to_dict()) == {"name", "library", CALIBRATION, HELDOUT}
    assert not session.accelerated
