"""Context parallelism of a third-party model whose attention is inline ``torch.nn.functional`` SDPA (no
processor, no module-level ``F``), declared with ``AttentionRouting(sdpa_calls=...)`` through the public API."""

from __future__ import annotations

import pytest
import torch

import fastdit
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, validate_plan
from fastdit.testing.distributed import WorkerPool
from tests.cache.toy_joint_dit import ToyJointDiT, adapter, sample

pytestmark = pytest.mark.distributed

ADAPTER = adapter()
PLAN = ADAPTER.cp_plan


def _model() -> ToyJointDiT:
    torch.manual_seed(0)
    return ToyJointDiT().eval()


def _cache() -> fastdit.DBCache:
    mask = fastdit.StepMask(compute_steps=(0, 3, 6), policy="static")
    return fastdit.DBCache(fn=1, bn=1, warmup_steps=0, step_mask=mask)


def _run(
    rank: int, world_size: int, layout: dict[str, int], cached: bool, compiled: bool = False
) -> tuple[torch.Tensor, int]:
    model = _model()
    fastdit.accelerate(
        model,
        adapter=ADAPTER,
        parallel=fastdit.Parallel(**layout),
        cache=_cache() if cached else None,
        compile=fastdit.Compile(backend="eager") if compiled else None,
    )
    try:
        out = sample(model)
        return out, fastdit.summary(model).num_cached_steps
    finally:
        fastdit.disable(model)


@pytest.mark.parametrize("layout", [{"ulysses": 2}, {"ring": 2}], ids=["ulysses2", "ring2"])
def test_inline_sdpa_is_routed_and_matches_one_process(dist2: WorkerPool, layout: dict[str, int]) -> None:
    for cached in (False, True):
        expected, expected_cached = _run(0, 1, {}, cached)
        for out, num_cached in dist2.run(_run, layout, cached, timeout=120):
            assert num_cached == expected_cached
            assert (out - expected).abs().max() < 1e-5


def test_inline_sdpa_routing_under_compiled_blocks(dist2: WorkerPool) -> None:
    expected, expected_cached = _run(0, 1, {}, True)
    for out, num_cached in dist2.run(_run, {"ulysses": 2}, True, True, timeout=180):
        assert num_cached == expected_cached
        assert (out - expected).abs().max() < 1e-5


def test_without_the_routing_the_split_model_is_wrong(dist2: WorkerPool) -> None:
    # The same plan minus sdpa_calls (routing by a module-level F finds nothing here): local attention on shards.
    expected, _ = _run(0, 1, {}, False)
    outs = dist2.run(_unrouted, timeout=120)
    assert all((out - expected).abs().max() > 1e-3 for out in outs)


def _unrouted(rank: int, world_size: int) -> torch.Tensor:
    model = _model()
    fastdit.accelerate(model, adapter=ADAPTER, parallel=fastdit.Parallel(ulysses=2))
    try:
        # Remove the SDPA-call hooks (the only hooks on the blocks without a cache): what routing through a
        # module-global F would leave for this model, whose blocks spell torch.nn.functional in full.
        for module in model.stages:
            module._forward_pre_hooks.clear()
            module._forward_hooks.clear()
        return sample(model)
    finally:
        fastdit.disable(model)


def test_a_pattern_that_matches_nothing_is_refused_on_meta() -> None:
    with torch.device("meta"):
        model = ToyJointDiT()
    bad = ContextParallelPlan(
        inputs=PLAN.inputs, gather=PLAN.gather, attention=AttentionRouting(sdpa_calls=("blocks.*",))
    )
    with pytest.raises(ValueError, match=r"sdpa_calls path 'blocks\.\*' matches no module of ToyJointDiT"):
        validate_plan(model, bad, 2)
    validate_plan(model, PLAN, 2)
