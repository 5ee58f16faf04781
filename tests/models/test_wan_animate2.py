"""Wan-Animate-2: the family suite through its tiny ModularPipeline (``WanAnimate2ModularPipeline``), and the same
checks on the bare transformer, driven as the modular loop drives it (a reference pass, then conditional and
unconditional calls per step). Its tensor-parallel check on the bare transformer is in
``tests/parallel/test_wan_animate2_parallel.py``."""

from __future__ import annotations

import functools

import pytest
import torch

import fastdit
from fastdit.models.registry import get_family
from fastdit.models.validate import check_adapter, probe_patterns
from fastdit.models.wan_animate2 import tiny_animate, tiny_transformer
from tests.models.family_suite import FamilySuite, pytest_generate_tests  # noqa: F401

STEPS = 3


class TestWanAnimate2(FamilySuite):
    family = "wan_animate2"


@functools.cache
def _model() -> torch.nn.Module:
    # One instance for the module: it keeps the flex BlockMasks its first call builds.
    return tiny_transformer()


@functools.cache
def _baseline() -> torch.Tensor:
    return tiny_animate(_model(), STEPS)


def _counted(model: torch.nn.Module) -> tuple[torch.Tensor, list[int]]:
    calls: list[int] = []
    handles = [block.register_forward_pre_hook(lambda *_, i=i: calls.append(i)) for i, block in enumerate(model.blocks)]
    try:
        return tiny_animate(model, STEPS), calls
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.slow
def test_tiny_block_mask_equals_the_compiled_one() -> None:
    """The tiny transformer builds its BlockMask eagerly (the class compiles the same mask function with inductor,
    seconds per process): the mask must be the class's own, tensor for tensor."""
    from diffusers import WanAnimate2Transformer3DModel

    model = _model()
    for frames, hw in ((3, 16), (2, 1)):  # the bare transformer's geometry and the tiny pipeline's
        eager = model.create_mask(frames, hw, "cpu")
        compiled = WanAnimate2Transformer3DModel.create_mask(model, frames, hw, "cpu")
        assert eager.shape == compiled.shape
        for name in (
            "kv_num_blocks",
            "kv_indices",
            "full_kv_num_blocks",
            "full_kv_indices",
            "q_num_blocks",
            "q_indices",
        ):
            assert torch.equal(getattr(eager, name), getattr(compiled, name)), name


def test_adapter_matches_transformer() -> None:
    check_adapter(_model(), get_family("wan_animate2"))


def test_block_patterns_probe() -> None:
    model = _model()
    probe_patterns(model, get_family("wan_animate2"), lambda: tiny_animate(model, 1)).raise_if_failed()


def test_runs_and_depends_on_the_noise() -> None:
    out = _baseline()
    assert torch.isfinite(out).all()
    assert not torch.equal(out, tiny_animate(_model(), STEPS, seed=1))


def test_cache_threshold_zero_is_bit_identical() -> None:
    model = _model()
    fastdit.accelerate(model, cache=fastdit.DBCache(fn=1, bn=1, threshold=0.0, warmup_steps=0))
    try:
        cached = tiny_animate(model, STEPS)
        stats = fastdit.summary(model)
    finally:
        fastdit.disable(model)
    assert stats.num_cached_steps == 0
    assert torch.equal(cached, _baseline())
    assert torch.equal(tiny_animate(model, STEPS), _baseline())  # disable restores the original
    assert not [name for name, module in model.named_modules() if "forward" in vars(module)]


def test_cache_forced_schedule_skips_expected_steps_and_never_the_reference_pass() -> None:
    """Both branches cache steps 1 and 2; the reference pass (12 blocks) and every step's first and last block run;
    the unconditional calls skip block 9 whether cached or not."""
    model = _model()
    mask = fastdit.StepMask(compute_steps=(0,), policy="static")
    fastdit.accelerate(model, cache=fastdit.DBCache(fn=1, bn=1, warmup_steps=0, step_mask=mask))
    try:
        out, calls = _counted(model)
        stats = fastdit.summary(model)
    finally:
        fastdit.disable(model)
    assert torch.isfinite(out).all()
    branches = [b for info in stats.transformers.values() for b in info["cache"]["branches"].values()]
    assert [(b["steps"], b["cached_steps"]) for b in branches] == [(STEPS, [1, 2])] * 2, branches
    blocks = list(range(12))
    unconditional = [i for i in blocks if i != 9]
    assert calls == blocks + (blocks + unconditional) * STEPS  # the model's loop calls every block it runs
