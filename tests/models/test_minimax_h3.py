"""MiniMax-H3: the family suite through its tiny ModularPipeline (``MiniMaxH3ModularPipeline``), and the same checks on
the bare transformer driven by the family's sampler loop. Its parallel checks on the bare transformer are in
``tests/parallel/test_minimax_h3_parallel.py``."""

from __future__ import annotations

import torch

import fastdit
from fastdit.models.minimax_h3 import example, tiny_denoise, tiny_transformer
from fastdit.models.registry import get_family
from fastdit.models.validate import check_adapter, probe_patterns
from tests.models.family_suite import FamilySuite, pytest_generate_tests  # noqa: F401

STEPS = 3


class TestMiniMaxH3(FamilySuite):
    family = "minimax_h3"


def test_adapter_matches_transformer() -> None:
    check_adapter(tiny_transformer(), get_family("minimax_h3"))


def test_block_patterns_probe() -> None:
    transformer = tiny_transformer()
    probe_patterns(transformer, get_family("minimax_h3"), lambda: tiny_denoise(transformer, 1)).raise_if_failed()


def test_sampler_depends_on_the_noise() -> None:
    transformer = tiny_transformer()
    out = tiny_denoise(transformer, STEPS)
    assert torch.isfinite(out).all()
    assert not torch.equal(out, tiny_denoise(transformer, STEPS, seed=1))
    model, kwargs = example()
    video, audio = model(**kwargs)
    assert video.shape == kwargs["hidden_states"].shape and audio.shape == kwargs["audio_hidden_states"].shape


def test_cache_threshold_zero_is_bit_identical() -> None:
    transformer = tiny_transformer()
    baseline = tiny_denoise(transformer, STEPS)
    fastdit.accelerate(transformer, cache=fastdit.DBCache(fn=1, bn=1, threshold=0.0, warmup_steps=0))
    try:
        cached = tiny_denoise(transformer, STEPS)
        stats = fastdit.summary(transformer)
    finally:
        fastdit.disable(transformer)
    assert stats.num_cached_steps == 0
    assert torch.equal(cached, baseline)
    assert torch.equal(tiny_denoise(transformer, STEPS), baseline)  # disable restores the original
    assert not [name for name, module in transformer.named_modules() if "forward" in vars(module)]


def test_cache_forced_schedule_skips_expected_steps() -> None:
    transformer = tiny_transformer()
    baseline = tiny_denoise(transformer, STEPS)
    mask = fastdit.StepMask(compute_steps=(0,), policy="static")
    fastdit.accelerate(transformer, cache=fastdit.DBCache(fn=1, bn=1, warmup_steps=0, step_mask=mask))
    try:
        out = tiny_denoise(transformer, STEPS)
        stats = fastdit.summary(transformer)
    finally:
        fastdit.disable(transformer)
    assert torch.isfinite(out).all() and not torch.equal(out, baseline)
    branches = [b for info in stats.transformers.values() for b in info["cache"]["branches"].values()]
    assert [b["cached_steps"] for b in branches] == [list(range(1, STEPS))], branches


def test_timestep_reduce_names_the_field_and_value() -> None:
    import dataclasses

    import pytest

    with pytest.raises(ValueError, match=r"ModelAdapter.timestep_reduce='mean' for family 'minimax_h3'"):
        dataclasses.replace(get_family("minimax_h3"), timestep_reduce="mean")
