"""MagCache: its config, decision, calibration files, and runs on tiny pipelines and a one-block model."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import fastdit
from fastdit.cache.magcache import (
    MagAccumulator,
    load_calibration,
    mag_decide,
    retained_steps,
    save_calibration,
)
from fastdit.calibration import calibrate, calibration_of
from fastdit.errors import FieldError
from fastdit.testing.pipelines import build_tiny, run_tiny
from tests.cache.toy_dit import TOY_ADAPTER, ToyDiT, sample


def _calibration(steps: int = 10, ratio: float = 1.0, branches: tuple[str, ...] = ("cond",)) -> fastdit.MagCalibration:
    return fastdit.MagCalibration(branches=branches, ratios=((ratio,) * steps,) * len(branches), num_steps=steps)


# --- config ---


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"threshold": -0.1}, "threshold"),
        ({"threshold": float("nan")}, "threshold"),
        ({"max_skip_steps": 0}, "max_skip_steps"),
        ({"retention_ratio": 1.5}, "retention_ratio"),
        ({"fn": True}, "fn"),
        ({"final_steps": -1}, "final_steps"),
        ({"threshold": 0.1}, "calibration"),  # skipping needs the model's ratios
        ({"taylorseer": fastdit.TaylorSeer(forecast_decision=True)}, "taylorseer"),
    ],
)
def test_config_refuses_bad_fields(fields: dict, field: str) -> None:
    with pytest.raises(FieldError) as caught:
        fastdit.MagCache(**{"threshold": 0.0, **fields})
    assert caught.value.owner == "MagCache" and caught.value.field == field


def test_config_refuses_a_calibration_of_another_layout() -> None:
    with pytest.raises(FieldError, match="fn=0, bn=0; calibrate this layout"):
        fastdit.MagCache(threshold=0.1, fn=1, calibration=_calibration())
    with pytest.raises(FieldError, match="leave calibration unset"):
        fastdit.MagCache(calibrate=True, calibration=_calibration())


def test_calibration_needs_one_ratio_per_step() -> None:
    with pytest.raises(FieldError, match="one ratio per step"):
        fastdit.MagCalibration(branches=("cond",), ratios=((1.0, 1.0),), num_steps=3)
    with pytest.raises(FieldError) as caught:
        fastdit.MagCalibration(branches=("cond",), ratios=((1.0, float("inf")),), num_steps=2)
    assert caught.value.field == "ratios"
    with pytest.raises(FieldError, match="'uncond' that was not calibrated"):
        _calibration().ratios_for("uncond")


# --- the decision ---


def _schedule(config: fastdit.MagCache, ratios: tuple[float, ...]) -> list[int]:
    acc = MagAccumulator()
    return [step for step in range(len(ratios)) if not mag_decide(config, acc, step, ratios, step > 0)]


def test_decision_caps_consecutive_skips_and_keeps_retained_and_final_steps() -> None:
    config = fastdit.MagCache(
        threshold=1.0, max_skip_steps=2, retention_ratio=0.2, final_steps=1, calibration=_calibration()
    )
    assert retained_steps(config, 10) == 2
    # Steps 0-1 retained, then skip 2 in a row and compute one; the last step always computes.
    assert _schedule(config, (1.0,) * 10) == [2, 3, 5, 6, 8]


def test_decision_accumulates_the_magnitude_error() -> None:
    config = fastdit.MagCache(threshold=0.1, max_skip_steps=5, retention_ratio=0.0, calibration=_calibration())
    # |1 - 0.85| is not below 0.1: a drift of 15 % per step never skips; 2 % per step skips twice
    # (errors 0.02, 0.0596) and the third accumulated error (0.1188) forces a compute.
    assert _schedule(config, (0.85,) * 6) == []
    assert _schedule(config, (0.98,) * 8) == [1, 2, 4, 5, 7]


def test_threshold_zero_never_skips_even_with_constant_ratios() -> None:
    # A ratio of exactly 1 accumulates no error: only the threshold's own rule keeps the no-op a no-op.
    config = fastdit.MagCache(threshold=0.0, retention_ratio=0.0, calibration=_calibration())
    assert _schedule(config, (1.0,) * 10) == []


# --- calibration files ---


def test_calibration_file_round_trip_and_mismatch(tmp_path) -> None:
    calibration = fastdit.MagCalibration(
        branches=("cond", "uncond"), ratios=((1.0, 0.5, 1.25), (1.0, 2.0, 0.75)), num_steps=3, model="Toy"
    )
    path = save_calibration(calibration, tmp_path / "cal.json")
    assert load_calibration(path) == calibration
    assert load_calibration(path, num_steps=3) == calibration
    with pytest.raises(FieldError, match="recorded on a run of 3 steps") as caught:
        load_calibration(path, num_steps=28)
    assert (caught.value.owner, caught.value.field) == ("MagCalibration", "num_steps")
    (tmp_path / "other.json").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ValueError, match="not a MagCache calibration"):
        load_calibration(tmp_path / "other.json")


def test_packaged_reference_calibration_loads() -> None:
    from fastdit.cache.magcache import reference_calibration

    calibration = reference_calibration()
    assert calibration.num_steps == 28 and calibration.branches == ("cond",) and calibration.ratios[0][0] == 1.0
    with pytest.raises(FieldError, match="28 steps"):
        reference_calibration(num_steps=50)


# --- runs ---


@pytest.fixture(scope="module")
def flux():
    return build_tiny("flux")


def test_threshold_zero_is_bit_identical_and_calibration_computes_every_step(flux) -> None:
    pipe, tiny = flux
    kwargs = {"num_inference_steps": 4}
    baseline = run_tiny(pipe, tiny, **kwargs)
    for config in (
        fastdit.MagCache(threshold=0.0),
        fastdit.MagCache(calibrate=True),
        fastdit.MagCache(threshold=0.0, fn=1, bn=1),
    ):
        fastdit.accelerate(pipe, cache=config)
        try:
            out = run_tiny(pipe, tiny, **kwargs)
            assert fastdit.summary(pipe).num_cached_steps == 0
        finally:
            fastdit.disable(pipe)
        np.testing.assert_array_equal(out, baseline)
    np.testing.assert_array_equal(run_tiny(pipe, tiny, **kwargs), baseline)


def test_calibrated_run_skips_per_branch_and_refuses_another_length(flux) -> None:
    pipe, tiny = flux
    kwargs = {"num_inference_steps": 6, "negative_prompt": "", "true_cfg_scale": 2.0}
    calibration = calibrate(pipe, lambda: run_tiny(pipe, tiny, **kwargs))
    assert calibration.branches == ("cond", "uncond") and calibration.num_steps == 6
    assert calibration.ratios[0] != calibration.ratios[1]  # each branch keeps its own magnitudes
    config = fastdit.MagCache(threshold=50.0, max_skip_steps=2, retention_ratio=0.2, calibration=calibration)
    fastdit.accelerate(pipe, cache=config)
    try:
        out = run_tiny(pipe, tiny, **kwargs)
        branches = fastdit.summary(pipe).transformers["transformer"]["cache"]["branches"]
        with pytest.raises(FieldError, match="recorded on a run of 6 steps and this run has 5 steps"):
            run_tiny(pipe, tiny, **{**kwargs, "num_inference_steps": 5})
    finally:
        fastdit.disable(pipe)
    assert np.isfinite(out).all()
    assert {name: b["cached_steps"] for name, b in branches.items()} == {"cond": [1, 2, 4, 5], "uncond": [1, 2, 4, 5]}
    # fn=0: a skipped step computes no block at all.
    blocks = len(pipe.transformer.transformer_blocks) + len(pipe.transformer.single_transformer_blocks)
    assert all(b["blocks_computed"] == 2 * blocks for b in branches.values())


def _branch_steps(target, config: fastdit.MagCache, run, **accelerate) -> dict[str, list[int]]:
    fastdit.accelerate(target, cache=config, **accelerate)
    try:
        run()
        branches = fastdit.summary(target).transformers["transformer"]["cache"]["branches"]
    finally:
        fastdit.disable(target)
    return {name: b["cached_steps"] for name, b in branches.items()}


def test_a_calibration_serves_the_branches_under_the_names_the_other_layout_gives_them(flux) -> None:
    """A pipeline that announces no branch has its two calls of a step named ``default`` and ``default/1`` on one
    process, and announced as ``cond`` and ``uncond`` by CFG parallelism to the cache beneath it: a calibration
    recorded under either names serves both, each branch by its own ratios."""
    steady, drifting = (1.0,) * 6, (3.0,) * 6  # ratio 1 skips up to the cap; ratio 3 adds 2 to the error each step

    def config(branches: tuple[str, str]) -> fastdit.MagCache:
        calibration = fastdit.MagCalibration(branches=branches, ratios=(steady, drifting), num_steps=6)
        return fastdit.MagCache(threshold=1.0, max_skip_steps=2, retention_ratio=0.0, calibration=calibration)

    # Flux's true CFG announces "cond" and "uncond"; a calibration of an unannounced pipeline names them by order.
    pipe, tiny = flux
    kwargs = {"num_inference_steps": 6, "negative_prompt": "", "true_cfg_scale": 2.0}
    served = _branch_steps(pipe, config(("default", "default/1")), lambda: run_tiny(pipe, tiny, **kwargs))
    assert served == {"cond": [1, 2, 4, 5], "uncond": []}
    # The toy model's two calls per step announce nothing; a calibration recorded under CFG parallelism names them.
    torch.manual_seed(0)
    model = ToyDiT(depth=2)
    served = _branch_steps(model, config(("cond", "uncond")), lambda: sample(model, 6, cfg=True), adapter=TOY_ADAPTER)
    assert served == {"default": [1, 2, 4, 5], "default/1": []}
    with pytest.raises(FieldError, match=r"this run has a branch 'default/1' that was not calibrated"):
        _branch_steps(model, config(("cond", "other")), lambda: sample(model, 6, cfg=True), adapter=TOY_ADAPTER)


def test_calibration_of_an_unaccelerated_pipeline_is_refused(flux) -> None:
    with pytest.raises(ValueError, match="not accelerated with a MagCache"):
        calibration_of(flux[0])


def test_one_block_model_skips_its_only_block() -> None:
    torch.manual_seed(0)
    model = ToyDiT(depth=1)
    baseline = sample(model, steps=10)
    fastdit.accelerate(model, cache=fastdit.MagCache(calibrate=True), adapter=TOY_ADAPTER)
    try:
        assert torch.equal(sample(model, steps=10), baseline)  # calibration computes every step
        calibration = calibration_of(model, component="transformer")
    finally:
        fastdit.disable(model)
    assert calibration.branches == ("default",) and calibration.num_steps == 10
    config = fastdit.MagCache(threshold=10.0, max_skip_steps=1, retention_ratio=0.0, calibration=calibration)
    fastdit.accelerate(model, cache=config, adapter=TOY_ADAPTER)
    try:
        cached = sample(model, steps=10)
        stats = fastdit.summary(model)
    finally:
        fastdit.disable(model)
    assert stats.num_cached_steps == 5 and stats.blocks_computed_fraction == 0.5
    assert torch.isfinite(cached).all() and not torch.equal(cached, baseline)
    assert torch.equal(sample(model, steps=10), baseline)


def test_magcache_presets_take_the_model_calibration() -> None:
    from fastdit.cache.magcache import MAGCACHE_PRESETS, magcache_preset, reference_calibration

    calibration = reference_calibration()
    assert list(MAGCACHE_PRESETS) == ["balanced", "fast", "ultra"]
    caps = [magcache_preset(name, calibration).max_skip_steps for name in MAGCACHE_PRESETS]
    assert caps == sorted(caps) and len(set(caps)) == 3  # each preset skips more than the one before
    fast = magcache_preset("fast", calibration, threshold=0.1)
    assert fast.calibration is calibration and fast.threshold == 0.1 and fast.taylorseer.variable == "timestep"
    with pytest.raises(LookupError, match="known: balanced, fast, ultra"):
        magcache_preset("turbo", calibration)


@pytest.mark.slow
def test_fast_presets_hold_their_claims_on_held_out_seeds() -> None:
    """The claims docs/cache.md makes for ``fast`` (DBCache) and MagCache ``fast``, on the held-out seeds."""
    from fastdit.bench.heldout import HELDOUT, SplitBench, fastdit_variant, reference_split, transformer_blocks
    from fastdit.cache.magcache import magcache_preset, reference_calibration
    from fastdit.cache.presets import cache_config
    from fastdit.session import Session, call_arguments, resolve_model

    source = resolve_model(None, None)
    session = Session.load(source, device="cpu", dtype=torch.float32)
    kwargs = call_arguments(session.pipeline_class, source.defaults, {})
    bench = SplitBench(session, reference_split(), kwargs, transformer_blocks(session))
    try:
        fast = bench.measure_part(fastdit_variant(session, "fast", cache_config("fast")), HELDOUT)
        mag = bench.measure_part(
            fastdit_variant(session, "mag", magcache_preset("fast", reference_calibration())), HELDOUT
        )
    finally:
        bench.close()
    assert fast.blocks_computed_fraction <= 0.38 and fast.psnr_min >= 35.0 and fast.ssim_min >= 0.99
    assert mag.blocks_computed_fraction <= 0.30 and mag.psnr_min >= 35.0 and mag.ssim_min >= 0.99
