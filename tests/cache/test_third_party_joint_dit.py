"""A third-party dual-stream DiT declared by a user: what a wrong declaration does (a clear error), what a right one
does (bit-identical at threshold 0, cached steps that stay close), with only the public API."""

from __future__ import annotations

import pytest
import torch

import fastdit
from fastdit.errors import FastditWarning
from fastdit.models.base import BlockGroup, ForwardPattern, ModelAdapter
from fastdit.models.validate import AdapterError

from .toy_joint_dit import ToyJointDiT, sample

CLASS = f"{ToyJointDiT.__module__}.ToyJointDiT"
STREAMS = {"hidden_arg": "img", "encoder_arg": "txt"}


def _adapter(group: BlockGroup, timestep_arg: str = "sigma") -> ModelAdapter:
    return ModelAdapter(
        family="toy_joint_dit", transformer_classes=(CLASS,), block_groups=(group,), timestep_arg=timestep_arg
    )


RIGHT = _adapter(
    BlockGroup(path="stages", pattern=ForwardPattern.P1, pattern_overrides={-1: ForwardPattern.P2}, **STREAMS)
)


@pytest.fixture
def model() -> ToyJointDiT:
    torch.manual_seed(0)
    return ToyJointDiT().eval()


def _forced(fn: int = 1, bn: int = 0) -> fastdit.DBCache:
    return fastdit.DBCache(
        fn=fn, bn=bn, warmup_steps=0, step_mask=fastdit.StepMask(compute_steps=(0, 3, 6), policy="static")
    )


def test_a_last_block_with_its_own_pattern_caches_and_is_exact_at_threshold_zero(model: ToyJointDiT) -> None:
    baseline = sample(model)
    fastdit.accelerate(model, adapter=RIGHT, cache=fastdit.DBCache(fn=1, bn=1, threshold=0.0, warmup_steps=0))
    try:
        assert torch.equal(sample(model), baseline)
    finally:
        fastdit.disable(model)
    for bn in (0, 1):  # the last block in the cached middle, then computing as the back block
        fastdit.accelerate(model, adapter=RIGHT, cache=_forced(bn=bn))
        try:
            cached = sample(model)
            assert fastdit.summary(model).num_cached_steps == 5
        finally:
            fastdit.disable(model)
        assert torch.isfinite(cached).all() and (cached - baseline).abs().max() < 0.5
    assert torch.equal(sample(model), baseline)


def test_without_the_override_the_first_call_names_the_block(model: ToyJointDiT) -> None:
    adapter = _adapter(BlockGroup(path="stages", pattern=ForwardPattern.P1, **STREAMS))
    fastdit.accelerate(model, adapter=adapter, cache=_forced())
    try:
        with pytest.raises(AdapterError, match=r"block stages\.4 .*declared pattern 1.*returned Tensor"):
            sample(model)
    finally:
        fastdit.disable(model)


def test_swapped_streams_of_equal_shape_are_refused_at_the_first_call(model: ToyJointDiT) -> None:
    wrong = _adapter(BlockGroup(path="stages", pattern=ForwardPattern.P0, pattern_overrides={-1: 2}, **STREAMS))
    fastdit.accelerate(model, adapter=wrong, cache=_forced())
    try:
        with pytest.raises(AdapterError, match=r"block stages\.0 .*look swapped"):
            sample(model)
    finally:
        fastdit.disable(model)


def test_an_override_outside_the_list_is_refused_before_anything_is_touched(model: ToyJointDiT) -> None:
    wrong = _adapter(BlockGroup(path="stages", pattern=ForwardPattern.P1, pattern_overrides={7: 2}, **STREAMS))
    with pytest.raises(ValueError, match="index 7 is outside the list of 5 blocks"):
        fastdit.accelerate(model, adapter=wrong, cache=_forced())
    assert "forward" not in vars(model)
    with pytest.raises(ValueError, match="not a ForwardPattern"):
        BlockGroup(path="stages", pattern=1, pattern_overrides={-1: 9})


def test_a_timestep_arg_the_forward_does_not_take_is_refused(model: ToyJointDiT) -> None:
    with pytest.raises(AdapterError, match=r"timestep_arg='t' is not a parameter of ToyJointDiT\.forward"):
        fastdit.accelerate(model, adapter=_adapter(RIGHT.block_groups[0], timestep_arg="t"), cache=_forced())


def test_a_timestep_arg_that_does_not_follow_the_schedule_warns(model: ToyJointDiT) -> None:
    # ``context`` is a tensor that never changes: every call would read as one more branch of one step.
    adapter = _adapter(RIGHT.block_groups[0], timestep_arg="context")
    fastdit.accelerate(model, adapter=adapter, cache=fastdit.DBCache(fn=1, bn=0, threshold=0.0))
    try:
        with pytest.warns(FastditWarning, match="timestep_arg='context' read the same value"):
            sample(model, steps=12)
    finally:
        fastdit.disable(model)
