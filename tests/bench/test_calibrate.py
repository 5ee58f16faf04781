"""The calibration search: each ladder climbed to its first miss, the choice across ladders, held-out once."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fastdit.bench.calibrate import Ladder, Target, calibrate_cache, ladders
from fastdit.bench.heldout import CALIBRATION, HELDOUT
from fastdit.bench.sweep import BenchRow
from fastdit.cache.magcache import reference_calibration
from fastdit.config import DBCache, MagCache, TeaCache, TeaCalibration


class FakeBench:
    """Rows from ``quality(config, part) -> (blocks fraction, worst PSNR)``; records what was measured."""

    session = SimpleNamespace(accelerate=lambda **_: None, disable=lambda: None)

    def __init__(self, quality) -> None:
        self.quality = quality
        self.calls: list[tuple[str, str]] = []

    def measure_part(self, variant, part: str) -> BenchRow:
        self.calls.append((variant.name, part))
        blocks, psnr = self.quality(variant.config, part)
        return BenchRow(variant.name, None, 1.0, blocks_computed_fraction=blocks, psnr=psnr + 3, psnr_min=psnr,
                        ssim_min=0.99)  # fmt: skip


def ladder(name: str, slope: float, n: int = 9) -> Ladder:
    """Rung i computes 1 - i/(n+1) of the blocks at a worst PSNR of 50 - slope * i."""
    return Ladder(name, tuple((f"{name}/{i}", (name, i, slope, n)) for i in range(n)))


def quality(config, part: str) -> tuple[float, float]:
    _, i, slope, n = config
    return 1 - i / (n + 1), 50 - slope * i - (1.5 if part == HELDOUT else 0)


def test_psnr_target_takes_the_fewest_blocks_above_the_bar() -> None:
    bench = FakeBench(quality)
    result = calibrate_cache(bench, Target(psnr=30, margin_db=1), [ladder("a", 4), ladder("b", 2)])
    # a: PSNR 50 - 4i >= 31 up to i = 4; b: 50 - 2i >= 31 up to i = 9 -> its last rung (8), fewer blocks
    assert result.chosen[0] == "b/8"
    assert result.calibration.psnr_min == 34 and result.heldout.psnr_min == 32.5
    runs = [name for name, part in bench.calls if part == CALIBRATION]
    assert runs == [f"a/{i}" for i in range(6)] + [f"b/{i}" for i in range(9)]  # a stops at its first miss (5)
    assert bench.calls[-1] == ("b/8", HELDOUT) and sum(part == HELDOUT for _, part in bench.calls) == 1
    assert [r.name for r in result.candidates] == runs


def test_speedup_target_takes_the_best_quality_within_the_budget() -> None:
    result = calibrate_cache(FakeBench(quality), Target(speedup=2), [ladder("a", 4), ladder("b", 2)])
    # <= 50 % of the blocks: rung 5 at the earliest (1 - 5/10); b loses less quality there
    assert result.chosen[0] == "b/5" and result.calibration.blocks_computed_fraction == 0.5


def test_a_pass_beyond_a_miss_is_not_taken() -> None:
    psnr = {0: 40, 1: 35, 2: 29, 3: 33, 4: 36}  # quality along a ladder is not always monotone

    def bumpy(config, part: str) -> tuple[float, float]:
        return 1 - config[1] / 10, psnr[config[1]]

    bench = FakeBench(bumpy)
    result = calibrate_cache(
        bench, Target(psnr=30, margin_db=1), [Ladder("a", tuple((f"a/{i}", ("a", i)) for i in psnr))]
    )
    assert result.chosen[0] == "a/1" and [n for n, p in bench.calls if p == CALIBRATION] == ["a/0", "a/1", "a/2"]


def test_no_configuration_meets_the_target() -> None:
    bench = FakeBench(quality)
    result = calibrate_cache(bench, Target(psnr=60), [ladder("a", 4)])
    assert result.chosen is None and result.calibration is None and result.heldout is None
    assert result.candidates and all(part == CALIBRATION for _, part in bench.calls)


def test_ssim_floor_applies_to_both_kinds() -> None:
    row = BenchRow("x", None, 1.0, blocks_computed_fraction=0.2, psnr_min=40, ssim_min=0.85)
    assert not Target(psnr=30).meets(row) and not Target(speedup=3).meets(row)
    assert Target(psnr=30, ssim=0.8).meets(row) and Target(speedup=3, ssim=0.8).meets(row)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [({}, "exactly one"), ({"psnr": 30, "speedup": 2}, "exactly one"), ({"speedup": 1}, "above 1"),
     ({"psnr": -3}, "positive"), ({"psnr": 30, "ssim": 2}, "Target.ssim=2"), ({"psnr": 30, "margin_db": -1}, "margin")],
)  # fmt: skip
def test_target_refuses_bad_values(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        Target(**kwargs)


def test_search_space() -> None:
    space = ladders(["magcache", "dbcache"], 28, reference_calibration())
    assert {type(config) for ladder in space for _, config in ladder.configs} == {MagCache, DBCache}
    for item in space:  # each ladder: one policy and cap, its threshold rising
        thresholds = [config.threshold for _, config in item.configs]
        assert thresholds == sorted(thresholds) and len(set(thresholds)) == len(thresholds)
    with pytest.raises(ValueError, match="needs the model's MagCalibration"):
        ladders(["magcache"], 28, None)
    with pytest.raises(ValueError, match="needs the model's TeaCalibration"):
        ladders(["teacache"], 28, None)
    with pytest.raises(ValueError, match="expected some of"):
        ladders(["fastercache"], 28, None)
    tea = ladders(["teacache"], 28, None, TeaCalibration(coefficients=(1.0, 0.0)))
    assert tea and all(isinstance(config, TeaCache) for ladder in tea for _, config in ladder.configs)
    assert all(config.taylorseer is not None for ladder in tea for _, config in ladder.configs)
    spectral = ladders(["spectral"], 28, None)  # no calibration needed
    configs = [config for ladder in spectral for _, config in ladder.configs]
    assert configs and all(isinstance(c, TeaCache) and c.signal == "spectral" and c.final_steps == 1 for c in configs)


def test_a_video_is_judged_by_its_worst_clip() -> None:
    """Per-frame values 40, 40, 26 dB make a 35.3 dB clip: the target reads the clip, the row keeps the frame."""
    import numpy as np

    from fastdit.bench.compare import clip_minima
    from fastdit.metrics import Comparison

    outputs = [np.zeros((3, 8, 8, 3)), np.zeros((3, 8, 8, 3))]
    quality = Comparison(count=6, psnr_per_frame=(40, 40, 26, 50, 50, 50), ssim_per_frame=(1, 1, 0.7, 1, 1, 1))
    psnr, ssim = clip_minima(outputs, quality)
    assert psnr == pytest.approx(35.33, abs=0.01) and ssim == pytest.approx(0.9)
    assert clip_minima([np.zeros((8, 8, 3))], Comparison(count=1, psnr_per_frame=(30,), ssim_per_frame=(1,))) is None
    row = BenchRow(
        name="x", config=None, seconds=1.0, psnr_min=26.0, ssim_min=0.7, psnr_clip_min=psnr, ssim_clip_min=ssim
    )
    assert row.worst == (psnr, ssim)
    assert Target(psnr=34, margin_db=1).meets(row) and not Target(psnr=35, margin_db=1).meets(row)
