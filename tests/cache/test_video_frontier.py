"""The video reference's cache claim (docs/benchmarks.md, "The cache frontier on the video reference"): the chosen
configuration, on its packaged calibration, keeps its block reduction and a worst-clip PSNR on held-out clips.

The default test runs two held-out clips (seeds of the held-out part, never used to tune or calibrate), so it fails
when the cache or the shipped calibration regresses; the whole held-out part is under ``slow``.
"""

from __future__ import annotations

import numpy as np
import pytest

import fastdit
from fastdit.metrics import compare
from fastdit.reference.video import (
    DIRECTIONS,
    VIDEO_REFERENCE_CFG,
    VIDEO_REFERENCE_DEFAULTS,
    generate_videos,
    load_video_reference_pipeline,
    video_reference_dir,
)

STEPS = VIDEO_REFERENCE_DEFAULTS["num_inference_steps"]


@pytest.fixture(scope="module")
def pipe():
    try:
        video_reference_dir()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    return load_video_reference_pipeline()


def chosen_config() -> fastdit.MagCache:
    """The configuration docs/benchmarks.md names for the CFG path: MagCache ``balanced`` on the CFG calibration."""
    from fastdit.cache.magcache import magcache_preset, video_reference_calibration

    return magcache_preset("balanced", video_reference_calibration(cfg=True))


def worst_clip(pipe, digits, directions, seeds, config) -> tuple[float, float, float, float]:
    """Blocks computed, the worst clip's PSNR and SSIM (each the mean over its frames) against the uncached clips,
    and the mean clip PSNR."""
    base = generate_videos(pipe, digits, directions, seeds, **VIDEO_REFERENCE_CFG)
    fastdit.accelerate(pipe, cache=config)
    try:
        cached = generate_videos(pipe, digits, directions, seeds, **VIDEO_REFERENCE_CFG)
        fraction = fastdit.summary(pipe).blocks_computed_fraction
    finally:
        fastdit.disable(pipe)
    found = [compare(a, b) for a, b in zip(base, cached, strict=True)]
    return fraction, min(c.psnr for c in found), min(c.ssim for c in found), float(np.mean([c.psnr for c in found]))


def test_packaged_video_calibrations_load() -> None:
    from fastdit.cache.magcache import video_reference_calibration
    from fastdit.cache.teacache import video_reference_calibration as tea_calibration

    plain, cfg = video_reference_calibration(), video_reference_calibration(cfg=True)
    assert plain.num_steps == cfg.num_steps == STEPS
    assert plain.branches == ("cond",) and cfg.branches == ("cond", "uncond")
    assert "WanTransformer3DModel" in cfg.model and cfg.fn == cfg.bn == 0
    for tea in (tea_calibration(), tea_calibration(cfg=True)):
        assert tea.fn == tea.bn == 0 and tea.num_steps == STEPS and len(tea.coefficients) == 5


def test_chosen_configuration_keeps_its_claim_on_held_out_clips(pipe) -> None:
    fraction, psnr, ssim, _ = worst_clip(pipe, [3, 7], ["up", "right"], [101, 202], chosen_config())
    # MagCache decides from its calibration alone: the fraction is the measured one exactly, whatever the clips.
    assert fraction <= 0.40
    # Measured 42.9 dB / 0.999 on these two clips (seed 101 digit 3 up, seed 202 digit 7 right).
    assert psnr >= 38.0 and ssim >= 0.99, (psnr, ssim)


@pytest.mark.slow
def test_chosen_configuration_keeps_its_figures_on_the_held_out_part(pipe) -> None:
    """Every digit in every direction with both held-out seeds: the measured 40 % of the blocks, mean clip >= 35 dB.

    The worst clip (16.3 dB measured) misses the 30 dB goal: a few held-out clips are unstable even uncached, so the
    bar guards the measured figure, not the goal (docs/benchmarks.md).
    """
    digits = [d for _ in (101, 202) for d in range(10) for _ in DIRECTIONS]
    directions = [r for _ in (101, 202) for _ in range(10) for r in DIRECTIONS]
    seeds = [s for s in (101, 202) for _ in range(40)]
    fraction, psnr, ssim, mean = worst_clip(pipe, digits, directions, seeds, chosen_config())
    assert fraction <= 0.40 and mean >= 35.0 and psnr >= 15.0 and ssim >= 0.55, (fraction, mean, psnr, ssim)
