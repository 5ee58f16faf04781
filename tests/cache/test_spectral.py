"""TeaCache's spectral signal: the filter, the noise level, the config, the decision, and runs on tiny pipelines."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import fastdit
from fastdit.cache.files import config_from_dict, config_to_dict
from fastdit.cache.spectral import (
    noise_to_signal,
    scheduled_sigma,
    spectral_estimate,
    spectral_gain,
    timestep_sigma,
)
from fastdit.cache.teacache import TeaAccumulator, fit_calibration, load_calibration, save_calibration, tea_decide
from fastdit.calibration import calibration_of
from fastdit.errors import FieldError, FieldsError
from fastdit.models.base import LatentLayout
from fastdit.testing.pipelines import build_tiny, run_tiny
from tests.cache.toy_dit import TOY_ADAPTER, ToyDiT, sample

SPECTRAL = {"signal": "spectral"}


# --- the filter and the noise level ---


def _direct_estimate(latent: torch.Tensor, rho: float, exponent: float) -> torch.Tensor:
    """The same filter through a full complex FFT, written out: the gain on the frequency norm of every axis."""
    grid = latent.shape[2:]
    norms = torch.meshgrid(*(torch.fft.fftfreq(n) for n in grid), indexing="ij")
    radius = torch.sqrt(sum(f * f for f in norms))
    gain = 1.0 / (1.0 + rho**2 * radius**exponent)
    dims = tuple(range(2, latent.ndim))
    return torch.fft.ifftn(torch.fft.fftn(latent, dim=dims) * gain, dim=dims).real


def test_estimate_is_the_wiener_gain_on_the_frequency_norm() -> None:
    latent = torch.randn(2, 4, 3, 8, 6, generator=torch.Generator().manual_seed(0))
    for rho in (0.1, 1.0, 20.0):
        expected = _direct_estimate(latent, rho, 3.0)
        torch.testing.assert_close(spectral_estimate(latent, rho, 3.0), expected, atol=1e-5, rtol=1e-5)
        # Channels last: the same filter over the other axes.
        channels_last = spectral_estimate(latent.movedim(1, -1), rho, 3.0, channel_dim=-1)
        torch.testing.assert_close(channels_last, expected, atol=1e-5, rtol=1e-5)
    # The zero frequency passes whole: a constant latent is its own estimate at any noise level.
    constant = torch.full((1, 2, 4, 4), 0.7)
    torch.testing.assert_close(spectral_estimate(constant, 50.0, 3.0), constant)
    # A clean step (ρ = 0) keeps the latent exactly, as a copy.
    estimate = spectral_estimate(latent, 0.0, 3.0)
    assert torch.equal(estimate, latent) and estimate.data_ptr() != latent.data_ptr()


def test_gain_damps_high_frequencies_more_at_high_noise() -> None:
    cpu = torch.device("cpu")
    low, high = spectral_gain((8, 8), 0.5, 3.0, cpu), spectral_gain((8, 8), 5.0, 3.0, cpu)
    assert low.shape == (8, 5) and low[0, 0] == 1.0 and high[0, 0] == 1.0
    assert (high[1:, 1:] < low[1:, 1:]).all()
    assert high[4, 4] < high[1, 1]  # the highest frequency is damped most


def test_latent_without_grid_is_refused() -> None:
    with pytest.raises(ValueError, match="no grid axis"):
        spectral_estimate(torch.zeros(2, 16), 1.0, 3.0)


def test_noise_to_signal_ratio_of_flow_and_variance_exploding_sigmas() -> None:
    assert noise_to_signal(0.5) == 1.0 and noise_to_signal(0.0) == 0.0
    assert noise_to_signal(0.8) == pytest.approx(4.0)
    assert np.isfinite(noise_to_signal(1.0))  # pure noise: large, finite
    assert noise_to_signal(3.0, flow=False) == 3.0
    assert timestep_sigma(800.0) == 0.8 and timestep_sigma(0.8) == 0.8


def test_scheduled_sigma_reads_the_current_step() -> None:
    from diffusers import EulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    assert scheduled_sigma(scheduler) is not None  # the training sigmas before any run
    scheduler.set_timesteps(4)
    sigma, flow = scheduled_sigma(scheduler)
    assert flow and sigma == pytest.approx(float(scheduler.sigmas[0]))
    sample_ = torch.zeros(1, 2)
    scheduler.step(torch.zeros_like(sample_), scheduler.timesteps[0], sample_)
    assert scheduled_sigma(scheduler)[0] == pytest.approx(float(scheduler.sigmas[1]))
    ve = EulerDiscreteScheduler()
    ve.set_timesteps(4)
    sigma, flow = scheduled_sigma(ve)
    assert not flow and sigma > 1.0
    assert scheduled_sigma(object()) is None


def test_variance_preserving_scheduler_gives_its_sigma_at_the_call_timestep() -> None:
    """DDIM keeps no sigmas: the noise-to-signal ratio comes from alphas_cumprod at the timestep received."""
    from diffusers import DDIMScheduler

    scheduler = DDIMScheduler()
    scheduler.set_timesteps(4)
    assert scheduled_sigma(scheduler) is None  # no timestep: unknown
    alpha = float(scheduler.alphas_cumprod[751])
    sigma, flow = scheduled_sigma(scheduler, 751.0)
    assert not flow and sigma == pytest.approx(((1 - alpha) / alpha) ** 0.5)
    assert noise_to_signal(sigma, flow=flow) == sigma
    # Out of range timesteps clamp to the schedule's ends; the noise falls with the timestep.
    assert scheduled_sigma(scheduler, 5000.0) == scheduled_sigma(scheduler, 999.0)
    assert (
        scheduled_sigma(scheduler, 0.0)[0] < scheduled_sigma(scheduler, 500.0)[0] < scheduled_sigma(scheduler, 999.0)[0]
    )


# --- config ---


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"signal": "latent"}, "signal"),
        ({"signal": 1}, "signal"),
        ({"spectral_exponent": 0.0}, "spectral_exponent"),
        ({"spectral_exponent": -2.0}, "spectral_exponent"),
        ({"spectral_exponent": float("nan")}, "spectral_exponent"),
        ({"spectral_exponent": True}, "spectral_exponent"),
    ],
)
def test_config_refuses_bad_fields(fields: dict, field: str) -> None:
    with pytest.raises(FieldError) as caught:
        fastdit.TeaCache(**fields)
    assert caught.value.owner == "TeaCache" and caught.value.field == field


def test_calibration_must_measure_the_same_signal() -> None:
    with pytest.raises(FieldError) as caught:
        fastdit.TeaCalibration(signal="spectrum")
    assert caught.value.owner == "TeaCalibration" and caught.value.field == "signal"
    with pytest.raises(FieldsError) as both:
        fastdit.TeaCache(threshold=0.2, signal="spectral", calibration=fastdit.TeaCalibration())
    assert both.value.owner == "TeaCache" and set(both.value.fields) == {"signal", "calibration"}
    # Without a calibration the spectral change accumulates as it is; the block input's still needs one.
    assert fastdit.TeaCache(threshold=0.2, **SPECTRAL).calibration is None
    fastdit.TeaCache(threshold=0.2, calibration=fastdit.TeaCalibration(signal="spectral"), **SPECTRAL)


def test_calibration_and_cache_files_keep_the_signal(tmp_path) -> None:
    calibration = fit_calibration([(0.1, 0.2), (0.2, 0.35), (0.4, 0.6)], 1, num_steps=4, signal="spectral")
    assert calibration.signal == "spectral"
    assert load_calibration(save_calibration(calibration, tmp_path / "tea.json")) == calibration
    config = fastdit.TeaCache(threshold=0.3, spectral_exponent=2.5, calibration=calibration, **SPECTRAL)
    assert config_from_dict(config_to_dict(config)) == config


# --- the decision ---


def test_decision_accumulates_the_raw_change_without_a_calibration() -> None:
    config = fastdit.TeaCache(threshold=0.25, max_skip_steps=5, retention_ratio=0.0, final_steps=1, **SPECTRAL)
    acc = TeaAccumulator(num_steps=8)
    distances = [None, 0.1, 0.1, 0.1, 0.3, 0.05, 0.05, 0.05]
    cached = [s for s, d in enumerate(distances) if not tea_decide(config, acc, s, d, s > 0)]
    # 0.1, 0.2 skip; 0.3 computes; 0.3 alone computes; 0.05, 0.1 skip; step 7 is the final one.
    assert cached == [1, 2, 5, 6]
    # A calibration of the signal rescales it: p(x) = 4x puts every 0.1 over the threshold.
    steep = dataclasses.replace(config, calibration=fastdit.TeaCalibration(coefficients=(4.0, 0.0), signal="spectral"))
    acc = TeaAccumulator(num_steps=8)
    assert [s for s, d in enumerate(distances) if not tea_decide(steep, acc, s, d, s > 0)] == [5]


# --- runs ---


@pytest.fixture(scope="module")
def wan():
    return build_tiny("wan")


def _forced(**fields) -> fastdit.TeaCache:
    settings = {"threshold": 1e6, "max_skip_steps": 100, "retention_ratio": 0.0, "final_steps": 0}
    return fastdit.TeaCache(**{**settings, **SPECTRAL, **fields})


def _branches(pipe) -> dict:
    return fastdit.summary(pipe).transformers["transformer"]["cache"]["branches"]


def test_threshold_zero_and_calibration_runs_are_bit_identical(wan) -> None:
    pipe, tiny = wan
    kwargs = {"num_inference_steps": 4}
    baseline = run_tiny(pipe, tiny, **kwargs)
    for config in (fastdit.TeaCache(threshold=0.0, **SPECTRAL), fastdit.TeaCache(calibrate=True, **SPECTRAL)):
        fastdit.accelerate(pipe, cache=config)
        try:
            out = run_tiny(pipe, tiny, **kwargs)
            assert fastdit.summary(pipe).num_cached_steps == 0
            if config.calibrate:
                calibration = calibration_of(pipe, degree=1)
        finally:
            fastdit.disable(pipe)
        np.testing.assert_array_equal(out, baseline)
    # Both CFG branches recorded their 3 pairs of spectral changes.
    assert calibration.signal == "spectral" and calibration.num_steps == 4


def test_cfg_branches_keep_separate_state_and_skip_every_later_step(wan) -> None:
    pipe, tiny = wan
    kwargs = {"num_inference_steps": 6}
    baseline = run_tiny(pipe, tiny, **kwargs)
    for config, cached in ((_forced(), [1, 2, 3, 4, 5]), (_forced(max_skip_steps=2), [1, 2, 4, 5])):
        fastdit.accelerate(pipe, cache=config)
        try:
            out = run_tiny(pipe, tiny, **kwargs)
            branches = _branches(pipe)
        finally:
            fastdit.disable(pipe)
        # Each branch counts its own 6 steps (one state for both would count 12 calls).
        assert {name: b["cached_steps"] for name, b in branches.items()} == {"cond": cached, "uncond": cached}
        assert all(b["blocks_computed"] == (6 - len(cached)) * 3 for b in branches.values())  # fn=0: no block
        assert np.isfinite(out).all() and not np.array_equal(out, baseline)
    np.testing.assert_array_equal(run_tiny(pipe, tiny, **kwargs), baseline)


def test_a_threshold_between_the_changes_skips_some_steps(wan) -> None:
    pipe, tiny = wan
    fastdit.accelerate(pipe, cache=fastdit.TeaCache(calibrate=True, **SPECTRAL))
    try:
        run_tiny(pipe, tiny, num_inference_steps=6)
        changes = [x for x, _ in fastdit.api.context_of(pipe).state("cache", "transformer").pairs()["cond"]]
    finally:
        fastdit.disable(pipe)
    assert all(x > 0 for x in changes)
    # Just over the largest change: no single step reaches it, two in a row do or the cap of 2 stops them.
    config = fastdit.TeaCache(threshold=1.01 * max(changes), max_skip_steps=2, retention_ratio=0.0, **SPECTRAL)
    fastdit.accelerate(pipe, cache=config)
    try:
        run_tiny(pipe, tiny, num_inference_steps=6)
        cached = _branches(pipe)["cond"]["cached_steps"]
    finally:
        fastdit.disable(pipe)
    assert 0 < len(cached) < 5


def test_cfg_branches_measure_one_change_and_decide_alike(wan) -> None:
    """True CFG calls both branches on the same noisy latent: each branch keeps its own accumulator, yet both read
    the same spectral change, so per-branch and shared decisions coincide (the CFG path's misses are not a split
    decision)."""
    pipe, tiny = wan
    fastdit.accelerate(pipe, cache=fastdit.TeaCache(calibrate=True, **SPECTRAL))
    try:
        run_tiny(pipe, tiny, num_inference_steps=6)
        pairs = fastdit.api.context_of(pipe).state("cache", "transformer").pairs()
    finally:
        fastdit.disable(pipe)
    # The input change of each step is the same float in both branches (their residual changes differ).
    assert [x for x, _ in pairs["cond"]] == [x for x, _ in pairs["uncond"]]
    changes = [x for x, _ in pairs["cond"]]
    config = fastdit.TeaCache(threshold=1.01 * max(changes), max_skip_steps=2, retention_ratio=0.0, **SPECTRAL)
    fastdit.accelerate(pipe, cache=config)
    try:
        run_tiny(pipe, tiny, num_inference_steps=6)
        branches = _branches(pipe)
    finally:
        fastdit.disable(pipe)
    cond, uncond = branches["cond"], branches["uncond"]
    assert 0 < len(cond["cached_steps"]) < 5
    assert cond["cached_steps"] == uncond["cached_steps"] and cond["residual_diffs"] == uncond["residual_diffs"]


def test_family_without_a_latent_grid_is_refused() -> None:
    pipe, _ = build_tiny("flux")  # packed tokens: no grid declared
    with pytest.raises(FieldError) as caught:
        fastdit.accelerate(pipe, cache=fastdit.TeaCache(threshold=0.0, **SPECTRAL))
    assert caught.value.owner == "TeaCache" and caught.value.field == "signal"
    assert fastdit.api.context_of(pipe) is None


def test_one_block_model_skips_its_only_block_on_the_timestep_noise_level() -> None:
    """No pipeline, no scheduler: the noise level is the timestep (flow matching from 1 to 0)."""
    torch.manual_seed(0)
    model = ToyDiT(depth=1)
    adapter = dataclasses.replace(TOY_ADAPTER, latent=LatentLayout(arg="sample", channel_dim=-1))
    baseline = sample(model, steps=10)
    config = fastdit.TeaCache(threshold=1e6, max_skip_steps=1, retention_ratio=0.2, final_steps=1, **SPECTRAL)
    fastdit.accelerate(model, cache=config, adapter=adapter)
    try:
        cached = sample(model, steps=10)
        stats = fastdit.summary(model)
    finally:
        fastdit.disable(model)
    # No run length known: neither the retained nor the final steps apply; the cap of 1 alternates.
    assert stats.transformers["transformer"]["cache"]["branches"]["default"]["cached_steps"] == [1, 3, 5, 7, 9]
    assert torch.isfinite(cached).all() and not torch.equal(cached, baseline)
    assert torch.equal(sample(model, steps=10), baseline)


def test_the_video_preset_is_the_frontier_pick_and_needs_a_latent_grid() -> None:
    """``--cache video``: the configuration the video frontier chose; a family without a latent grid refuses it by
    name before anything is installed, one that declares one caches steps."""
    from fastdit.api import context_of
    from fastdit.cache.presets import cache_config
    from fastdit.errors import FieldError
    from fastdit.testing.pipelines import build_tiny, run_tiny, scaled_steps

    config = cache_config("video")
    assert isinstance(config, fastdit.TeaCache) and config.signal == "spectral" and config.calibration is None
    assert (config.threshold, config.max_skip_steps, config.retention_ratio, config.final_steps) == (0.35, 4, 0.07, 1)
    assert config.taylorseer == fastdit.TaylorSeer(order=2, variable="timestep")
    flux, _ = build_tiny("flux")
    with pytest.raises(FieldError, match="flux"):
        fastdit.accelerate(flux, cache=config)
    assert context_of(flux) is None
    pipe, tiny = build_tiny("wan")
    fastdit.accelerate(pipe, cache=cache_config("video", threshold=10.0))  # every skippable step skipped
    try:
        out = run_tiny(pipe, tiny, **scaled_steps(tiny, 5))
        stats = fastdit.summary(pipe).transformers["transformer"]["cache"]
    finally:
        fastdit.disable(pipe)
    assert np.isfinite(out).all() and stats["num_cached_steps"] > 0
