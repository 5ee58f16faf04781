import dataclasses

import numpy as np

import fastdit
from fastdit.models.latte import ADAPTER
from fastdit.testing.pipelines import build_tiny, run_tiny
from tests.models.family_suite import FamilySuite, pytest_generate_tests  # noqa: F401 - pytest hook


class TestLatte(FamilySuite):
    family = "latte"


def _cached_run(pipe, tiny, adapter) -> tuple[np.ndarray, list[int]]:
    """A run whose steps after the first reuse the residual of spatial blocks 1-2; temporal block computes counted."""
    counts = [0] * len(pipe.transformer.temporal_transformer_blocks)
    handles = [
        block.attn1.register_forward_hook(lambda *_, i=i: counts.__setitem__(i, counts[i] + 1))
        for i, block in enumerate(pipe.transformer.temporal_transformer_blocks)
    ]
    mask = fastdit.StepMask(compute_steps=(0,), policy="static")
    fastdit.accelerate(pipe, cache=fastdit.DBCache(fn=1, bn=0, warmup_steps=0, step_mask=mask), adapter=adapter)
    try:
        out = run_tiny(pipe, tiny)
    finally:
        fastdit.disable(pipe)
        for handle in handles:
            handle.remove()
    return out, counts


def test_interleaved_temporal_blocks_skipped_when_discarded_without_changing_outputs() -> None:
    pipe, tiny = build_tiny("latte")
    baseline = run_tiny(pipe, tiny)
    patched, patched_counts = _cached_run(pipe, tiny, ADAPTER)
    (group,) = ADAPTER.block_groups
    fused = {path: groups for path, groups in ADAPTER.fused_projections.items() if path == group.path}
    undeclared = dataclasses.replace(
        ADAPTER, block_groups=(dataclasses.replace(group, interleaved=None),), fused_projections=fused
    )
    plain, plain_counts = _cached_run(pipe, tiny, undeclared)
    np.testing.assert_array_equal(patched, plain)
    # 2 steps, one CFG-batched call each: the cached step skips temporal block 1 only (its output is replaced by
    # the segment residual at spatial block 2); temporal block 2 follows the segment and runs.
    assert plain_counts == [2, 2, 2]
    assert patched_counts == [2, 1, 2]
    assert not np.array_equal(patched, baseline)  # the cached step did reuse the residual
    np.testing.assert_array_equal(run_tiny(pipe, tiny), baseline)  # disable removes the interleaved hooks
