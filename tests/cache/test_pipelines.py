"""Cache behaviour on real (tiny) diffusers pipelines with unusual call structures."""

from __future__ import annotations

import numpy as np
import pytest

import fastdit
from fastdit.testing.pipelines import build_tiny, run_tiny


def _forced(steps: tuple[int, ...]) -> fastdit.DBCache:
    return fastdit.DBCache(fn=1, bn=1, warmup_steps=0, step_mask=fastdit.StepMask(compute_steps=steps, policy="static"))


def test_sd35_skip_layer_guidance_is_a_branch_not_a_new_run() -> None:
    # Skip-layer guidance adds a batch-1 forward after the batched CFG forward of each step, without a cache context.
    # The guidance forward also leaves block 1 out: the middle segment (blocks 1-2) is entered at block 2 there.
    pipe, tiny = build_tiny("sd3", "sd3.5-medium")
    kwargs = {"num_inference_steps": 4, "skip_guidance_layers": [1], "skip_layer_guidance_stop": 1.0}
    mask = fastdit.StepMask(compute_steps=(0,), policy="static")
    fastdit.accelerate(pipe, cache=fastdit.DBCache(fn=1, bn=0, warmup_steps=0, step_mask=mask))
    try:
        out = run_tiny(pipe, tiny, **kwargs)
        stats = fastdit.summary(pipe).transformers["transformer"]["cache"]
    finally:
        fastdit.disable(pipe)
    assert np.isfinite(out).all()
    assert stats["runs"] >= 1
    for branch in stats["branches"].values():
        assert branch["cached_steps"] == list(range(1, branch["steps"]))
    assert max(b["steps"] for b in stats["branches"].values()) == 4
    assert len(stats["branches"]) == 2 and stats["num_cached_steps"] > 3


def test_true_cfg_flux_caches_cond_and_uncond_separately() -> None:
    pipe, tiny = build_tiny("flux")
    fastdit.accelerate(pipe, cache=_forced((0, 2)))
    try:
        run_tiny(pipe, tiny, num_inference_steps=4, negative_prompt="", true_cfg_scale=2.0)
        stats = fastdit.summary(pipe).transformers["transformer"]["cache"]
    finally:
        fastdit.disable(pipe)
    assert sorted(stats["branches"]) == ["cond", "uncond"]
    assert all(b["cached_steps"] == [1, 3] for b in stats["branches"].values())


def test_each_pipeline_call_starts_a_fresh_run() -> None:
    pipe, tiny = build_tiny("flux")
    fastdit.accelerate(pipe, cache=_forced((0,)))
    try:
        first = run_tiny(pipe, tiny, num_inference_steps=3)
        second = run_tiny(pipe, tiny, num_inference_steps=3)
        third = run_tiny(pipe, tiny, num_inference_steps=5, height=48, width=48)
        stats = fastdit.summary(pipe).transformers["transformer"]["cache"]
    finally:
        fastdit.disable(pipe)
    np.testing.assert_array_equal(first, second)  # nothing stale from the first call
    assert third.shape[1:3] == (48, 48)
    assert stats["branches"]["cond"]["steps"] == 5


def test_an_interrupted_call_leaves_no_state_behind() -> None:
    """KeyboardInterrupt in a step callback: the next call equals a fresh run (no phantom branch, no stale residual)."""
    pipe, tiny = build_tiny("flux")
    mask = fastdit.StepMask(compute_steps=(0,), policy="static")
    fastdit.accelerate(pipe, cache=fastdit.DBCache(fn=1, bn=0, warmup_steps=0, step_mask=mask))
    try:
        fresh = run_tiny(pipe, tiny, num_inference_steps=3, seed=1)

        def interrupt(*args, **kwargs):
            raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            run_tiny(pipe, tiny, num_inference_steps=3, seed=0, callback_on_step_end=interrupt)
        again = run_tiny(pipe, tiny, num_inference_steps=3, seed=1)
        branches = fastdit.summary(pipe).transformers["transformer"]["cache"]["branches"]
    finally:
        fastdit.disable(pipe)
    np.testing.assert_array_equal(again, fresh)
    ((name, branch),) = branches.items()  # one branch, no phantom "cond/1"
    assert "/" not in name and branch["num_cached_steps"] == 2
    assert "set_timesteps" not in vars(pipe.scheduler)  # disable took the run boundary off the scheduler
