"""Qwen-Image 2.1: the shared family suite, plus the pipeline's default prefix KV cache under step caching."""

from __future__ import annotations

import numpy as np
import pytest

import fastdit
from fastdit.testing.pipelines import build_tiny, run_tiny
from tests.models.family_suite import FamilySuite, pytest_generate_tests  # noqa: F401 - pytest hook

# The tiny variants run with use_kv_cache=False; these runs use the pipeline default. Step 1 is the first step fed
# only the target tokens, so its residuals cannot be compared with step 0's: 3 steps give one cacheable step.
_KV = {"use_kv_cache": True, "num_inference_steps": 3}


class TestQwenImage21(FamilySuite):
    family = "qwenimage21"


@pytest.fixture(scope="module")
def t2i():
    return build_tiny("qwenimage21", "t2i")


def test_kv_cache_threshold_zero_is_bit_identical(t2i) -> None:
    pipe, tiny = t2i
    baseline = run_tiny(pipe, tiny, **_KV)
    fastdit.accelerate(pipe, cache=fastdit.DBCache(fn=1, bn=1, threshold=0.0, warmup_steps=0))
    try:
        cached = run_tiny(pipe, tiny, **_KV)
        stats = fastdit.summary(pipe)
    finally:
        fastdit.disable(pipe)
    assert stats.num_cached_steps == 0
    np.testing.assert_array_equal(cached, baseline)
    np.testing.assert_array_equal(run_tiny(pipe, tiny, **_KV), baseline)


def test_kv_cache_forced_schedule_recomputes_the_first_target_only_step(t2i) -> None:
    pipe, tiny = t2i
    mask = fastdit.StepMask(compute_steps=(0,), policy="static")
    fastdit.accelerate(pipe, cache=fastdit.DBCache(fn=1, bn=1, warmup_steps=0, step_mask=mask))
    try:
        out = run_tiny(pipe, tiny, **_KV)
        stats = fastdit.summary(pipe)
    finally:
        fastdit.disable(pipe)
    assert np.isfinite(out).all()
    branches = stats.transformers["transformer"]["cache"]["branches"]
    assert set(branches) == {"cond", "uncond"}
    for name, branch in branches.items():
        # Step 1's joint stream is shorter than step 0's (prefix keys come from the KV cache): always computed.
        assert branch["steps"] == 3, name
        assert branch["cached_steps"] == [2], name
