"""TeaCache: its config, decision, polynomial fit, calibration and cache files, and runs on tiny pipelines."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

import fastdit
from fastdit.cache.files import CacheFile, config_from_dict, config_to_dict, load_cache_file, save_cache_file
from fastdit.cache.teacache import (
    TeaAccumulator,
    fit_calibration,
    load_calibration,
    retained_steps,
    save_calibration,
    tea_decide,
)
from fastdit.calibration import calibrate, calibration_of
from fastdit.errors import FieldError
from fastdit.testing.pipelines import build_tiny, run_tiny
from tests.cache.toy_dit import TOY_ADAPTER, ToyDiT, sample

# The input change taken as the residual change: the threshold reads in input units.
IDENTITY = fastdit.TeaCalibration(coefficients=(1.0, 0.0), num_steps=10)


# --- config ---


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"threshold": -0.1}, "threshold"),
        ({"threshold": float("nan")}, "threshold"),
        ({"max_skip_steps": 0}, "max_skip_steps"),
        ({"retention_ratio": 1.5}, "retention_ratio"),
        ({"final_steps": -1}, "final_steps"),
        ({"fn": True}, "fn"),
        ({"calibrate": "yes"}, "calibrate"),
        ({"calibration": (1.0, 0.0)}, "calibration"),
        ({"threshold": 0.1}, "calibration"),  # skipping needs the model's polynomial
        ({"taylorseer": fastdit.TaylorSeer(forecast_decision=True)}, "taylorseer"),
        ({"threshold": 0.1, "fn": 1, "calibration": IDENTITY}, "fn"),  # calibrated on another layout
        ({"calibrate": True, "calibration": IDENTITY}, "calibrate"),
    ],
)
def test_config_refuses_bad_fields(fields: dict, field: str) -> None:
    with pytest.raises(FieldError) as caught:
        fastdit.TeaCache(**{"threshold": 0.0, **fields})
    assert caught.value.owner == "TeaCache" and caught.value.field == field


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"coefficients": ()}, "coefficients"),
        ({"coefficients": (1.0,) * 6}, "coefficients"),  # degree 5
        ({"coefficients": (1.0, float("inf"))}, "coefficients"),
        ({"num_steps": 0}, "num_steps"),
        ({"model": ""}, "model"),
    ],
)
def test_calibration_refuses_bad_fields(fields: dict, field: str) -> None:
    with pytest.raises(FieldError) as caught:
        fastdit.TeaCalibration(**fields)
    assert caught.value.owner == "TeaCalibration" and caught.value.field == field


def test_rescale_is_the_polynomial_clamped_at_zero() -> None:
    calibration = fastdit.TeaCalibration(coefficients=(3.0, -2.0, 0.5, -0.01))
    for x in (0.0, 0.05, 0.3, 1.2):
        assert calibration.rescale(x) == pytest.approx(max(np.polyval(calibration.coefficients, x), 0.0))
    assert calibration.rescale(0.0) == 0.0  # -0.01 at 0: a negative change counts as none


# --- the decision ---


def _schedule(config: fastdit.TeaCache, distances: list[float], num_steps: int | None) -> list[int]:
    acc = TeaAccumulator(num_steps=num_steps)
    cached = []
    for step, distance in enumerate(distances):
        if not tea_decide(config, acc, step, None if step == 0 else distance, step > 0):
            cached.append(step)
    return cached


def test_decision_accumulates_caps_and_keeps_retained_and_final_steps() -> None:
    config = fastdit.TeaCache(
        threshold=0.25, max_skip_steps=5, retention_ratio=0.2, final_steps=1, calibration=IDENTITY
    )
    assert retained_steps(config, 10) == 2
    # Steps 0-1 retained; then 0.1 and 0.2 accumulate under 0.25 (skipped), 0.3 computes and restarts; step 9 is final.
    assert _schedule(config, [0.1] * 10, 10) == [2, 3, 5, 6, 8]
    capped = fastdit.TeaCache(
        threshold=10.0, max_skip_steps=2, retention_ratio=0.0, final_steps=0, calibration=IDENTITY
    )
    assert _schedule(capped, [0.1] * 8, 8) == [1, 2, 4, 5, 7]
    # A scheduler that counts fewer steps than the run takes: without final steps the later ones decide as before.
    assert _schedule(capped, [0.1] * 8, 3) == [1, 2, 4, 5, 7]
    # No run length known (no scheduler): neither retained nor final steps apply.
    assert _schedule(config, [0.1] * 4, None) == [1, 2]


def test_decision_uses_the_rescaled_change() -> None:
    # p(x) = 4x: a change of 0.1 counts 0.4, over the threshold at once, where the identity skips two steps in three.
    steep = fastdit.TeaCalibration(coefficients=(4.0, 0.0))
    config = fastdit.TeaCache(threshold=0.25, max_skip_steps=3, retention_ratio=0.0, final_steps=0, calibration=steep)
    assert _schedule(config, [0.1] * 6, 6) == []
    assert _schedule(dataclasses.replace(config, calibration=IDENTITY), [0.1] * 6, 6) == [1, 2, 4, 5]
    # 0.02 counts 0.08: 0.08, 0.16, 0.24 skip, the fourth would pass the cap of 3 (and the threshold).
    assert _schedule(config, [0.02] * 6, 6) == [1, 2, 3, 5]


# --- the polynomial fit and files ---


def test_fit_recovers_a_polynomial_and_refuses_too_few_pairs() -> None:
    xs = np.linspace(0.01, 0.3, 12)
    pairs = [(float(x), float(2.0 * x**2 + 0.5 * x + 0.01)) for x in xs]
    calibration = fit_calibration(pairs, 2, num_steps=13, model="Toy")
    np.testing.assert_allclose(calibration.coefficients, (2.0, 0.5, 0.01), atol=1e-9)
    assert len(fit_calibration(pairs, num_steps=13).coefficients) == 5  # degree 4 by default
    with pytest.raises(ValueError, match="needs at least 5"):
        fit_calibration(pairs[:4], 4, num_steps=5)
    with pytest.raises(ValueError, match="degree=5"):
        fit_calibration(pairs, 5, num_steps=13)


def test_calibration_and_cache_files_round_trip(tmp_path) -> None:
    calibration = fastdit.TeaCalibration(
        coefficients=(498.65165123, -283.781631, 55.8554382, -3.82021401, 0.264230861), num_steps=28, model="Toy"
    )
    path = save_calibration(calibration, tmp_path / "tea.json")
    assert load_calibration(path) == calibration  # every digit kept: high powers amplify rounding
    (tmp_path / "other.json").write_text(json.dumps({"format": "fastdit.magcache/1"}))
    with pytest.raises(ValueError, match="not a TeaCache calibration"):
        load_calibration(tmp_path / "other.json")
    config = fastdit.TeaCache(
        threshold=0.4, max_skip_steps=2, calibration=calibration, taylorseer=fastdit.TaylorSeer(order=2)
    )
    assert config_from_dict(json.loads(json.dumps(config_to_dict(config)))) == config
    save_cache_file(tmp_path / "cache.json", CacheFile(config, "toy", 28))
    assert load_cache_file(tmp_path / "cache.json", num_steps=28).config == config
    data = json.loads((tmp_path / "cache.json").read_text())
    data["config"]["fields"]["calibration"]["fields"]["coefficients"] = []
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(FieldError) as caught:
        load_cache_file(tmp_path / "bad.json")
    assert (caught.value.owner, caught.value.field) == ("TeaCalibration", "coefficients")


def test_packaged_reference_calibration_loads() -> None:
    from fastdit.cache.teacache import reference_calibration

    calibration = reference_calibration()
    assert len(calibration.coefficients) == 5 and (calibration.fn, calibration.bn, calibration.num_steps) == (0, 0, 28)
    # Over the input changes the reference run showed (0.013 to 0.091 per step), the residual changes it predicts
    # rise with them and stay in the range it recorded (0.026 to 0.149).
    predicted = [calibration.rescale(x) for x in np.linspace(0.013, 0.091, 12)]
    assert predicted[-1] > predicted[0] and all(0.0 < y < 0.2 for y in predicted)


# --- runs ---


@pytest.fixture(scope="module")
def flux():
    return build_tiny("flux")


def _forced(**fields) -> fastdit.TeaCache:
    """Skips every step it may: a huge threshold and cap, nothing retained."""
    settings = {"threshold": 1e6, "max_skip_steps": 100, "retention_ratio": 0.0, "final_steps": 0}
    return fastdit.TeaCache(**{**settings, "calibration": IDENTITY, **fields})


def test_threshold_zero_and_calibration_runs_are_bit_identical(flux) -> None:
    pipe, tiny = flux
    kwargs = {"num_inference_steps": 4}
    baseline = run_tiny(pipe, tiny, **kwargs)
    for config in (
        fastdit.TeaCache(threshold=0.0),
        fastdit.TeaCache(calibrate=True),
        fastdit.TeaCache(threshold=0.0, fn=1, bn=1),
    ):
        fastdit.accelerate(pipe, cache=config)
        try:
            out = run_tiny(pipe, tiny, **kwargs)
            assert fastdit.summary(pipe).num_cached_steps == 0
            if config.calibrate:
                calibration = calibration_of(pipe, degree=1)
        finally:
            fastdit.disable(pipe)
        np.testing.assert_array_equal(out, baseline)
    assert isinstance(calibration, fastdit.TeaCalibration) and calibration.num_steps == 4
    assert calibrate(pipe, lambda: run_tiny(pipe, tiny, **kwargs), policy="teacache", degree=1) == calibration
    assert len(calibration.coefficients) == 2 and calibration.model.startswith("FluxTransformer2DModel")


def test_forced_skipping_skips_every_later_step_and_disable_restores(flux) -> None:
    pipe, tiny = flux
    kwargs = {"num_inference_steps": 5}
    baseline = run_tiny(pipe, tiny, **kwargs)
    blocks = len(pipe.transformer.transformer_blocks) + len(pipe.transformer.single_transformer_blocks)
    taylor = fastdit.TaylorSeer(order=1)
    outputs = {}
    for name, config, cached in (
        ("all", _forced(), [1, 2, 3, 4]),
        ("cap 1", _forced(max_skip_steps=1), [1, 3]),
        ("cap 1 TaylorSeer", _forced(max_skip_steps=1, taylorseer=taylor), [1, 3]),
    ):
        fastdit.accelerate(pipe, cache=config)
        try:
            outputs[name] = run_tiny(pipe, tiny, **kwargs)
            stats = fastdit.summary(pipe)
        finally:
            fastdit.disable(pipe)
        (branch,) = stats.transformers["transformer"]["cache"]["branches"].values()
        assert branch["cached_steps"] == cached, name
        # fn=0: a skipped step computes no block at all.
        assert branch["blocks_computed"] == (5 - len(cached)) * blocks, name
        assert np.isfinite(outputs[name]).all() and not np.array_equal(outputs[name], baseline), name
    # Step 3 forecasts from the residuals of steps 0 and 2 instead of reusing step 2's.
    assert not np.array_equal(outputs["cap 1"], outputs["cap 1 TaylorSeer"])
    np.testing.assert_array_equal(run_tiny(pipe, tiny, **kwargs), baseline)


def test_cfg_branches_keep_separate_state(flux) -> None:
    pipe, tiny = flux
    kwargs = {"num_inference_steps": 6, "negative_prompt": "", "true_cfg_scale": 2.0}
    fastdit.accelerate(pipe, cache=fastdit.TeaCache(calibrate=True))
    try:
        run_tiny(pipe, tiny, **kwargs)
        engine = fastdit.api.context_of(pipe).state("cache", "transformer")
        pairs = engine.pairs()
        calibration = calibration_of(pipe, degree=2)
    finally:
        fastdit.disable(pipe)
    assert set(pairs) == {"cond", "uncond"} and all(len(p) == 5 for p in pairs.values())
    assert pairs["cond"] != pairs["uncond"]  # each branch compares with its own previous input and residual
    assert calibration.num_steps == 6
    # Skipping: each branch counts its own 6 steps and accumulates its own changes (one state shared by both would
    # count 12 calls and skip every other one).
    fastdit.accelerate(pipe, cache=_forced(max_skip_steps=2, calibration=IDENTITY))
    try:
        out = run_tiny(pipe, tiny, **kwargs)
        branches = fastdit.summary(pipe).transformers["transformer"]["cache"]["branches"]
    finally:
        fastdit.disable(pipe)
    assert np.isfinite(out).all()
    assert {name: b["cached_steps"] for name, b in branches.items()} == {"cond": [1, 2, 4, 5], "uncond": [1, 2, 4, 5]}


# Dynamo hands each graph of a compiled block to this backend, which runs it as traced.
_TRACED: list[str] = []


@torch._dynamo.register_backend(name="fastdit_test_teacache")
def _recording_backend(graph: torch.fx.GraphModule, inputs: list) -> object:
    _TRACED.append(graph.code)
    return graph.forward


def test_compiled_blocks_skip_the_same_steps_with_no_graph_break(flux) -> None:
    """Compiled blocks (``fullgraph``: a graph break inside a block fails) beneath TeaCache: the decision reads the
    first block's input in the eager hook around it, so the same steps skip, forecast included, with the eager
    cache's output."""
    pipe, tiny = flux
    kwargs = {"num_inference_steps": 5}
    config = _forced(max_skip_steps=2, taylorseer=fastdit.TaylorSeer(order=2, method="foca"))
    compiled = fastdit.Compile(backend="fastdit_test_teacache", fullgraph=True)
    outputs, served = [], []
    torch._dynamo.reset()
    _TRACED.clear()
    try:
        for options in ({}, {"compile": compiled}):
            fastdit.accelerate(pipe, cache=config, **options)
            try:
                outputs.append(run_tiny(pipe, tiny, **kwargs))
                (branch,) = fastdit.summary(pipe).transformers["transformer"]["cache"]["branches"].values()
                served.append(branch["cached_steps"])
            finally:
                fastdit.disable(pipe)
    finally:
        torch._dynamo.reset()
    assert _TRACED, "no block was compiled"
    assert served == [[1, 2, 4], [1, 2, 4]]  # computes 0 and 3: step 4 forecasts from two residuals
    np.testing.assert_allclose(outputs[1], outputs[0], atol=1e-6)


def test_calibration_of_an_unaccelerated_pipeline_is_refused(flux) -> None:
    with pytest.raises(ValueError, match="not accelerated with a MagCache or TeaCache"):
        calibration_of(flux[0])


def test_one_block_model_calibrates_and_skips_its_only_block() -> None:
    torch.manual_seed(0)
    model = ToyDiT(depth=1)
    baseline = sample(model, steps=10)
    fastdit.accelerate(model, cache=fastdit.TeaCache(calibrate=True), adapter=TOY_ADAPTER)
    try:
        assert torch.equal(sample(model, steps=10), baseline)  # calibration computes every step
        calibration = calibration_of(model, degree=2)
    finally:
        fastdit.disable(model)
    assert calibration.num_steps == 10 and len(calibration.coefficients) == 3
    # No scheduler: the calibration's 10 steps are the run length, so retention and the final step apply.
    config = fastdit.TeaCache(
        threshold=1e6, max_skip_steps=1, retention_ratio=0.2, final_steps=1, calibration=calibration
    )
    fastdit.accelerate(model, cache=config, adapter=TOY_ADAPTER)
    try:
        cached = sample(model, steps=10)
        stats = fastdit.summary(model)
    finally:
        fastdit.disable(model)
    assert stats.transformers["transformer"]["cache"]["branches"]["default"]["cached_steps"] == [2, 4, 6, 8]
    assert torch.isfinite(cached).all() and not torch.equal(cached, baseline)
    assert torch.equal(sample(model, steps=10), baseline)
