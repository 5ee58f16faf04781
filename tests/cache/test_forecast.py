"""Forecast methods of TaylorSeer (taylor, hermite, foca): their math, their config, and their runs in the caches."""

from __future__ import annotations

import math

import pytest
import torch

import fastdit
from fastdit.cache.files import config_from_dict, config_to_dict
from fastdit.cache.forecast import Forecast, foca_predict, forecast_predict, forecast_update, hermite_weights
from fastdit.cache.taylorseer import taylor_predict, taylor_update
from fastdit.cli.options import cache_from_spec
from fastdit.config import DBCache, MagCache, TaylorSeer
from fastdit.errors import FieldError
from tests.cache.toy_dit import TOY_ADAPTER, ToyDiT, sample

SQRT_HALF = 1 / math.sqrt(2)


def _fed(config: TaylorSeer, function, positions: list[float], indices: list[int] | None = None) -> Forecast:
    """A forecast that has seen ``function`` computed at ``positions`` (step indices 0, 1, ... unless given)."""
    forecast = Forecast()
    for index, position in zip(indices or range(len(positions)), positions, strict=True):
        forecast_update(config, forecast, torch.tensor([function(position)], dtype=torch.float64), position, index)
    return forecast


def _at(config: TaylorSeer, forecast: Forecast, position: float) -> float:
    return float(forecast_predict(config, forecast, position))


# --- the math ---


def test_taylor_method_is_the_taylor_series() -> None:
    config = TaylorSeer(order=2, variable="timestep")
    positions = [1.0, 0.9, 0.75, 0.5]
    forecast = _fed(config, lambda p: math.sin(3 * p), positions)
    coefficients, last = [], None
    for p in positions:
        coefficients = taylor_update(coefficients, last, torch.tensor([math.sin(3 * p)], dtype=torch.float64), p, 2)
        last = p
    assert _at(config, forecast, 0.3) == float(taylor_predict(coefficients, 0.5, 0.3))


@pytest.mark.parametrize("scale", [0.3, 0.5, SQRT_HALF, 1.0])
def test_hermite_is_exact_on_constants(scale: float) -> None:
    config = TaylorSeer(order=2, method="hermite", hermite_scale=scale)
    forecast = _fed(config, lambda p: 2.5, [0, 1, 3])
    assert _at(config, forecast, 9) == 2.5


def test_hermite_order_one_at_scale_sqrt_half_is_the_linear_forecast() -> None:
    # H_1(x) = 2x, so σ·H_1(σx) = 2σ²x: exact on linear drift when 2σ² = 1, over an uneven timestep schedule too.
    config = TaylorSeer(order=1, method="hermite", hermite_scale=SQRT_HALF, variable="timestep")
    forecast = _fed(config, lambda p: 3 * p + 1, [1.0, 0.96, 0.85], indices=[0, 1, 3])
    assert _at(config, forecast, 0.6) == pytest.approx(3 * 0.6 + 1, abs=1e-12)
    damped = TaylorSeer(order=1, method="hermite", hermite_scale=0.5, variable="timestep")
    forecast = _fed(damped, lambda p: 3 * p + 1, [1.0, 0.96, 0.85], indices=[0, 1, 3])
    # 2σ² = 1/2: half the linear drift from the last computed residual.
    assert _at(damped, forecast, 0.6) == pytest.approx(3 * 0.85 + 1 + 0.5 * 3 * (0.6 - 0.85), abs=1e-12)


def test_hermite_does_not_depend_on_the_timestep_scale_or_direction() -> None:
    config = TaylorSeer(order=2, method="hermite", hermite_scale=0.6, variable="timestep")
    indices = [0, 2, 3, 5]
    unit = [1.0, 0.93, 0.88, 0.7]
    base = _at(config, _fed(config, lambda p: math.exp(p), unit, indices), 0.55)
    rescaled = _at(
        config, _fed(config, lambda p: math.exp((1000 - p) / 1000), [1000 - 1000 * p for p in unit], indices), 450
    )
    assert rescaled == pytest.approx(base, rel=1e-10)


def test_hermite_second_order_offset_at_the_last_position() -> None:
    # H_2(x) = 4x² − 2: at distance 0 the forecast is f − σ²·f'' (over the step index), HiCache's known offset.
    config = TaylorSeer(order=2, method="hermite", hermite_scale=0.5)
    forecast = _fed(config, lambda p: p * p, [0, 1, 2])
    f, second = forecast.coefficients[0].item(), forecast.coefficients[2].item()
    assert _at(config, forecast, 2) == pytest.approx(f - 0.25 * second)


@pytest.mark.parametrize("scale", [0.4, 0.6, SQRT_HALF, 0.9])
def test_hermite_scale_sets_the_growth_of_long_extrapolations(scale: float) -> None:
    # The k-th weight tends to (2σ²)^k times the Taylor weight d^k/k! as the distance grows.
    for distance in (1e3, 1e5):
        weights = hermite_weights(distance, 1.0, scale, 2)
        for k, weight in enumerate(weights, start=1):
            ratio = weight / (distance**k / math.factorial(k))
            assert ratio == pytest.approx((2 * scale * scale) ** k, rel=10 / distance)
    # Below 1/√2 a long forecast stays closer to the last computed residual than the Taylor one does.
    taylor, hermite = TaylorSeer(order=2), TaylorSeer(order=2, method="hermite", hermite_scale=0.5)
    drift = lambda p: 0.5 * p * p + p  # noqa: E731
    last = drift(4)
    long_taylor = _at(taylor, _fed(taylor, drift, [0, 2, 4], [0, 2, 4]), 40) - last
    long_hermite = _at(hermite, _fed(hermite, drift, [0, 2, 4], [0, 2, 4]), 40) - last
    assert 0 < long_hermite < 0.3 * long_taylor


def test_foca_predictor_is_exact_on_quadratics_at_uneven_positions() -> None:
    quadratic = lambda p: 2 * p * p - 3 * p + 1  # noqa: E731
    points = [(p, torch.tensor([quadratic(p)], dtype=torch.float64)) for p in (1.0, 0.8, 0.45)]
    for target in (0.3, 0.0, -1.0):
        assert float(foca_predict(points, target, corrected=False)) == pytest.approx(quadratic(target), abs=1e-12)


def test_foca_corrector_keeps_lines_and_halves_the_bend() -> None:
    config = TaylorSeer(order=2, method="foca", variable="timestep")
    line = _fed(config, lambda p: 3 * p + 1, [1.0, 0.8, 0.45])
    assert _at(config, line, -2.0) == pytest.approx(3 * -2.0 + 1, abs=1e-12)
    # On c·p² the trapezoidal step misses by exactly c·d²/2: half the curvature from the last computed position.
    c, last = 2.0, 0.45
    forecast = _fed(config, lambda p: c * p * p, [1.0, 0.8, last])
    for target in (0.3, 0.0):
        d = target - last
        assert _at(config, forecast, target) == pytest.approx(c * target * target - c * d * d / 2, abs=1e-12)
    # Taylor's backward differences are not exact on the slope: on the same points the FoCa forecast is closer.
    taylor = TaylorSeer(order=2, variable="timestep")
    truth = c * 0.1 * 0.1
    taylor_error = abs(_at(taylor, _fed(taylor, lambda p: c * p * p, [1.0, 0.8, last]), 0.1) - truth)
    assert abs(_at(config, forecast, 0.1) - truth) < taylor_error


@pytest.mark.parametrize("method", ["taylor", "hermite", "foca"])
def test_one_computed_residual_is_no_forecast(method: str) -> None:
    config = TaylorSeer(order=2, method=method)
    forecast = _fed(config, lambda p: 1.0, [3])
    assert not forecast.ready  # the caches reuse the residual
    assert _fed(config, lambda p: p, [3, 4]).ready


@pytest.mark.parametrize("method", ["taylor", "hermite"])
def test_equal_positions_carry_no_slope(method: str) -> None:
    config = TaylorSeer(order=2, method=method, variable="timestep")
    forecast = _fed(config, lambda p: 1.0, [0.5])
    forecast_update(config, forecast, torch.tensor([4.0], dtype=torch.float64), 0.5, 1)
    assert not forecast.ready and float(forecast.coefficients[0]) == 4.0


def test_foca_equal_position_replaces_the_last_point() -> None:
    config = TaylorSeer(order=2, method="foca", variable="timestep")
    forecast = _fed(config, lambda p: 10 * p, [1.0, 0.5])
    forecast_update(config, forecast, torch.tensor([7.0], dtype=torch.float64), 0.5, 2)
    assert [p for p, _ in forecast.points] == [1.0, 0.5]
    # Two points left: the linear forecast through (1.0, 10) and (0.5, 7).
    assert _at(config, forecast, 0.0) == pytest.approx(4.0)
    assert len(_fed(config, lambda p: p, [4, 3, 2, 1, 0]).points) == 3  # three points fix the predictor


# --- the config ---


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"method": "cubic"}, r"TaylorSeer.method='cubic': must be one of 'taylor', 'hermite', 'foca'"),
        ({"method": "hermite", "hermite_scale": 0}, r"TaylorSeer.hermite_scale=0: must be a number in \(0, 1\]"),
        ({"method": "hermite", "hermite_scale": 1.5}, r"TaylorSeer.hermite_scale=1.5"),
        ({"method": "hermite", "hermite_scale": float("nan")}, r"TaylorSeer.hermite_scale=nan"),
        ({"method": "hermite", "hermite_scale": True}, r"TaylorSeer.hermite_scale=True"),
        ({"hermite_scale": 0.7}, r"TaylorSeer.hermite_scale=0.7: applies to method='hermite' only"),
        ({"method": "foca", "order": 1}, r"TaylorSeer.order=1: must be 2 with method='foca'"),
    ],
)
def test_config_refuses_bad_forecast_fields(fields: dict, message: str) -> None:
    with pytest.raises(FieldError, match=message):
        TaylorSeer(**fields)


def test_cache_files_and_the_cli_grammar_carry_the_method() -> None:
    forecast = TaylorSeer(order=2, variable="timestep", method="hermite", hermite_scale=0.6)
    config = DBCache(fn=1, bn=0, threshold=0.3, taylorseer=forecast)
    data = config_to_dict(config)
    assert data["fields"]["taylorseer"]["fields"]["method"] == "hermite"
    assert config_from_dict(data) == config
    data["fields"]["taylorseer"]["fields"]["method"] = "spline"
    with pytest.raises(FieldError, match=r"TaylorSeer.method='spline'"):
        config_from_dict(data)
    built = cache_from_spec("fast,taylorseer_method=hermite,taylorseer_hermite_scale=0.6", 28)
    assert built.taylorseer == forecast
    assert cache_from_spec("ultra,taylorseer_method=foca", 28).taylorseer.method == "foca"
    with pytest.raises(fastdit.cli.CLIError, match="hermite_scale"):
        cache_from_spec("fast,taylorseer_hermite_scale=0.6", 28)  # the preset forecasts with Taylor


# --- runs ---


METHODS = [
    TaylorSeer(order=2, variable="timestep"),
    TaylorSeer(order=2, variable="timestep", method="hermite", hermite_scale=0.6),
    TaylorSeer(order=2, variable="timestep", method="foca"),
]


def _sampled(model: ToyDiT, config, cfg: bool = False) -> tuple[torch.Tensor, int]:
    fastdit.accelerate(model, cache=config, adapter=TOY_ADAPTER)
    try:
        return sample(model, steps=12, cfg=cfg), fastdit.summary(model).num_cached_steps
    finally:
        fastdit.disable(model)


@pytest.fixture(scope="module")
def toy() -> tuple[ToyDiT, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = ToyDiT(depth=4)
    return model, sample(model, steps=12), sample(model, steps=12, cfg=True)


@pytest.mark.parametrize("forecast", METHODS[1:], ids=["hermite", "foca"])
def test_threshold_zero_stays_bit_identical(toy, forecast: TaylorSeer) -> None:
    model, baseline, baseline_cfg = toy
    for config in (
        DBCache(fn=1, bn=0, threshold=0.0, warmup_steps=0, taylorseer=forecast),
        MagCache(threshold=0.0, taylorseer=forecast),  # threshold 0 needs no calibration
    ):
        assert torch.equal(_sampled(model, config)[0], baseline)
        assert torch.equal(_sampled(model, config, cfg=True)[0], baseline_cfg)


def test_every_method_forecasts_in_dbcache_and_magcache_with_cfg_branches(toy) -> None:
    model = toy[0]
    calibration = fastdit.MagCalibration(
        branches=("default", "default/1"), ratios=((1.0,) * 12, (1.0,) * 12), num_steps=12
    )
    for make in (
        lambda f: DBCache(fn=1, bn=0, threshold=10.0, warmup_steps=3, max_continuous_cached_steps=2, taylorseer=f),
        lambda f: MagCache(
            threshold=10.0, max_skip_steps=2, retention_ratio=0.25, taylorseer=f, calibration=calibration
        ),
    ):
        outputs, cached = [], []
        for forecast in (None, *METHODS):
            out, steps = _sampled(model, make(forecast), cfg=True)
            outputs.append(out)
            cached.append(steps)
        assert len(set(cached)) == 1 and cached[0] > 0  # as many steps skip, whatever the forecast
        for i in range(len(outputs)):
            assert torch.isfinite(outputs[i]).all()
            for j in range(i):
                assert not torch.equal(outputs[i], outputs[j])  # each method's forecast is the one replayed


def test_presets_forecast_as_documented() -> None:
    from fastdit.cache.magcache import magcache_preset, reference_calibration
    from fastdit.cache.presets import cache_config

    # FoCa where it won on the calibration and held-out seeds and held on the confirmation seeds (docs/cache.md).
    assert {name: cache_config(name).taylorseer.method for name in ("balanced", "fast", "ultra")} == {
        "balanced": "taylor",
        "fast": "foca",
        "ultra": "taylor",
    }
    calibration = reference_calibration()
    assert {name: magcache_preset(name, calibration).taylorseer.method for name in ("balanced", "fast", "ultra")} == {
        "balanced": "taylor",
        "fast": "foca",
        "ultra": "taylor",
    }
