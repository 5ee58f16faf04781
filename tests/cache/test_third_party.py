"""The cache on a DiT that is not a diffusers class, through the public API."""

from __future__ import annotations

import pytest
import torch

import fastdit
from tests.cache.toy_dit import TOY_ADAPTER, ToyDiT, sample


@pytest.fixture
def model() -> ToyDiT:
    torch.manual_seed(0)
    return ToyDiT().eval()


def test_unregistered_model_needs_an_adapter(model: ToyDiT) -> None:
    with pytest.raises(ValueError, match="no adapter is registered"):
        fastdit.accelerate(model, cache=fastdit.DBCache(fn=1))


def test_threshold_zero_and_disable_are_bit_identical(model: ToyDiT) -> None:
    baseline = sample(model)
    fastdit.accelerate(model, cache=fastdit.DBCache(fn=1, bn=1, threshold=0, warmup_steps=0), adapter=TOY_ADAPTER)
    assert torch.equal(sample(model), baseline)
    assert fastdit.summary(model).num_cached_steps == 0
    fastdit.disable(model)
    assert torch.equal(sample(model), baseline)


def test_static_mask_caches_exactly_the_unlisted_steps(model: ToyDiT) -> None:
    mask = fastdit.StepMask(compute_steps=(0, 1, 4, 9), policy="static")
    fastdit.accelerate(model, cache=fastdit.DBCache(fn=2, bn=1, warmup_steps=0, step_mask=mask), adapter=TOY_ADAPTER)
    out = sample(model)
    stats = fastdit.summary(model).transformers["transformer"]["cache"]
    fastdit.disable(model)
    (branch,) = stats["branches"].values()
    assert branch["cached_steps"] == [2, 3, 5, 6, 7, 8]
    # 4 computed steps run all 6 blocks, 6 cached steps run fn + bn = 3.
    assert (stats["blocks_computed"], stats["blocks_total"]) == (4 * 6 + 6 * 3, 60)
    assert torch.isfinite(out).all()


def test_true_cfg_without_context_keeps_branches_apart(model: ToyDiT) -> None:
    fastdit.accelerate(model, cache=fastdit.DBCache(fn=1, bn=0, threshold=10.0, warmup_steps=3), adapter=TOY_ADAPTER)
    sample(model, cfg=True)
    stats = fastdit.summary(model).transformers["transformer"]["cache"]
    fastdit.disable(model)
    assert sorted(stats["branches"]) == ["default", "default/1"]
    for branch in stats["branches"].values():
        assert branch["steps"] == 10
        assert branch["cached_steps"] == list(range(3, 10))


def test_new_run_resets_state(model: ToyDiT) -> None:
    mask = fastdit.StepMask(compute_steps=(0,), policy="static")
    fastdit.accelerate(model, cache=fastdit.DBCache(fn=1, warmup_steps=0, step_mask=mask), adapter=TOY_ADAPTER)
    first = sample(model, steps=6)
    second = sample(model, steps=6)  # timestep rises back to 1: a new run, nothing stale is reused
    stats = fastdit.summary(model).transformers["transformer"]["cache"]
    fastdit.disable(model)
    assert torch.equal(first, second)
    assert stats["runs"] == 2
    assert stats["branches"]["default"]["steps"] == 6


def test_taylorseer_extrapolates_better_than_reuse(model: ToyDiT) -> None:
    baseline = sample(model, steps=20)
    errors = {}
    for name, taylor in (
        ("reuse", None),
        ("order1", fastdit.TaylorSeer(order=1)),
        ("order2", fastdit.TaylorSeer(order=2)),
    ):
        mask = fastdit.StepMask(compute_steps=tuple(range(0, 20, 3)), policy="static")
        config = fastdit.DBCache(fn=1, bn=0, warmup_steps=0, step_mask=mask, taylorseer=taylor)
        fastdit.accelerate(model, cache=config, adapter=TOY_ADAPTER)
        errors[name] = (sample(model, steps=20) - baseline).abs().mean().item()
        fastdit.disable(model)
    assert errors["order1"] < errors["reuse"]
    assert errors["order2"] < errors["reuse"]


def test_taylorseer_over_timesteps_matches_steps_on_a_uniform_schedule(model: ToyDiT) -> None:
    """The toy sampler's timesteps are evenly spaced, an affine function of the step index: the forecast is the
    same polynomial either way (and a cached step still differs from the uncached run)."""
    baseline = sample(model, steps=12)
    outputs = {}
    for variable in ("step", "timestep"):
        mask = fastdit.StepMask(compute_steps=tuple(range(0, 12, 3)), policy="static")
        taylor = fastdit.TaylorSeer(order=2, variable=variable)
        fastdit.accelerate(model, cache=fastdit.DBCache(fn=1, step_mask=mask, taylorseer=taylor), adapter=TOY_ADAPTER)
        outputs[variable] = sample(model, steps=12)
        fastdit.disable(model)
    torch.testing.assert_close(outputs["timestep"], outputs["step"], rtol=1e-4, atol=1e-5)
    assert not torch.equal(outputs["step"], baseline)


def test_dbprune_skips_blocks_and_threshold_zero_is_identical(model: ToyDiT) -> None:
    baseline = sample(model)
    fastdit.accelerate(model, cache=fastdit.DBPrune(fn=1, bn=1, threshold=0, warmup_steps=0), adapter=TOY_ADAPTER)
    assert torch.equal(sample(model), baseline)
    fastdit.disable(model)
    fastdit.accelerate(
        model,
        cache=fastdit.DBPrune(fn=1, bn=1, threshold=1e9, warmup_steps=2, max_pruned_ratio=0.5),
        adapter=TOY_ADAPTER,
    )
    out = sample(model)
    stats = fastdit.summary(model).transformers["transformer"]["cache"]
    fastdit.disable(model)
    pruned = stats["branches"]["default"]["pruned_blocks_per_step"]
    assert pruned[:2] == [0, 0]  # warm-up
    assert all(p == 2 for p in pruned[2:])  # half of the 4 middle blocks
    assert torch.isfinite(out).all()
    assert not torch.equal(out, baseline)


def test_fn_plus_bn_must_leave_middle_blocks(model: ToyDiT) -> None:
    with pytest.raises(ValueError, match=r"DBCache\(fn=4, bn=2\)"):
        fastdit.accelerate(model, cache=fastdit.DBCache(fn=4, bn=2), adapter=TOY_ADAPTER)
    assert not hasattr(model, "_fastdit_state")


def test_accelerating_twice_is_an_error(model: ToyDiT) -> None:
    fastdit.accelerate(model, cache=fastdit.DBCache(fn=1), adapter=TOY_ADAPTER)
    with pytest.raises(ValueError, match="already accelerated"):
        fastdit.accelerate(model, cache=fastdit.DBCache(fn=1), adapter=TOY_ADAPTER)
    fastdit.disable(model)


def test_compiled_blocks_have_no_graph_break_and_match(model: ToyDiT) -> None:
    baseline = sample(model)
    fastdit.accelerate(
        model,
        cache=fastdit.DBCache(fn=1, bn=1, threshold=0, warmup_steps=0),
        compile=fastdit.Compile(backend="eager", fullgraph=True),
        adapter=TOY_ADAPTER,
    )
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=False):
        out = sample(model)
    fastdit.disable(model)
    torch.testing.assert_close(out, baseline, rtol=0, atol=1e-6)
