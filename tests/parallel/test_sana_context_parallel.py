"""Sana and SANA-Video under context parallelism: what ``tests/parallel/test_family_plans.py`` does not cover.

The generic test runs the tiny pipelines (square grids, one timestep per sample) against one process. Here, on the
bare transformers: a non-square grid whose rows split unevenly, the plan vocabulary that makes it exact (a wrong
token sum or a missing halo is measurably wrong), the refusals, and SANA-Video's per-token timesteps (I2V).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import fastdit
from fastdit.models import sana, sana_video
from fastdit.parallel.plan import TokenSum, validate_plan
from fastdit.parallel.plan_shapes import linear_self_attention
from fastdit.testing.distributed import DistributedTestError, WorkerPool

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-4  # float32 on CPU


def _pool(dist2: WorkerPool, dist3: WorkerPool, parallel: dict[str, int]) -> WorkerPool:
    return dist3 if fastdit.Parallel(**parallel).world_size == 3 else dist2


def _with_plan(adapter: Any, **changes: Any) -> Any:
    return dataclasses.replace(adapter, cp_plan=dataclasses.replace(adapter.cp_plan, **changes))


def _sana_inputs(rows: int = 10) -> dict[str, Any]:
    """Two samples on a ``rows`` x 6 latent grid (10 rows: 5 + 5 on 2 ranks, 4 + 3 + 3 on 3)."""
    g = torch.Generator().manual_seed(3)
    return {
        "hidden_states": torch.randn(2, 4, rows, 6, generator=g),
        "encoder_hidden_states": torch.randn(2, 8, 32, generator=g),
        "timestep": torch.tensor([700, 300]),
    }


def _sana(rank: int, world_size: int, parallel: dict[str, int] | None, plan: str = "full", rows: int = 10):
    transformer = sana.tiny_transformer(0)
    adapter = {
        "full": sana.ADAPTER,
        "no-halo": _with_plan(sana.ADAPTER, halo={}),
        "wrong-sum": _with_plan(sana.ADAPTER, attention=linear_self_attention((TokenSum(torch.matmul, 1),))),
        "missing-sum": _with_plan(sana.ADAPTER, attention=linear_self_attention((TokenSum(torch.Tensor.sum),))),
    }[plan]
    if parallel is not None:
        fastdit.accelerate(transformer, parallel=fastdit.Parallel(**parallel), adapter=adapter)
    try:
        with torch.no_grad():
            return transformer(**_sana_inputs(rows)).sample
    finally:
        if parallel is not None:
            fastdit.disable(transformer)


@pytest.mark.parametrize("parallel", [{"ulysses": 2}, {"ring": 3}], ids=["ulysses2", "ring3-uneven"])
def test_sana_non_square_grid_matches_single_process(
    dist2: WorkerPool, dist3: WorkerPool, parallel: dict[str, int]
) -> None:
    expected = _sana(0, 1, None)
    for out in _pool(dist2, dist3, parallel).run(_sana, parallel, timeout=180):
        assert out.shape == expected.shape
        assert (out - expected).abs().max() < TOLERANCE, f"max abs error {(out - expected).abs().max():.2e}"


@pytest.mark.parametrize("plan", ["no-halo", "wrong-sum"])
def test_sana_is_wrong_without_the_halo_or_with_another_token_sum(dist2: WorkerPool, plan: str) -> None:
    """The halo and the choice of the summed matmul are what the exact results rest on (2 even shards)."""
    expected = _sana(0, 1, None)
    outs = dist2.run(_sana, {"ulysses": 2}, plan, timeout=180)
    assert max((out - expected).abs().max() for out in outs) > 1e-3


def test_sana_token_sum_the_processor_never_makes_raises_on_every_rank(dist2: WorkerPool) -> None:
    with pytest.raises(DistributedTestError) as info:
        dist2.run(_sana, {"ulysses": 2}, "missing-sum", timeout=180)
    assert set(info.value.exc_types.values()) == {"RuntimeError"}


def test_sana_fewer_rows_than_ranks_is_refused_on_every_rank(dist3: WorkerPool) -> None:
    with pytest.raises(DistributedTestError) as info:
        dist3.run(_sana, {"ulysses": 3}, "full", 2, timeout=180)
    assert set(info.value.exc_types.values()) == {"fastdit.errors.ShardError"}


def test_sana_plans_validate() -> None:
    validate_plan(sana.tiny_transformer(0), sana.CP_PLAN, 3)
    validate_plan(sana.tiny_transformer(0, sprint=True), sana.CP_PLAN, 3)
    validate_plan(sana_video.tiny_transformer(0), sana_video.CP_PLAN, 3)


# --- SANA-Video with one timestep per token (what the I2V pipeline passes for its conditioning frame) ---


def _video(rank: int, world_size: int, parallel: dict[str, int] | None) -> torch.Tensor:
    """3 latent frames of 4 x 6 (2 x 3 tokens each, patch 1x2x2); the first frame's tokens at timestep 0."""
    g = torch.Generator().manual_seed(4)
    timestep = torch.full((2, 18), 800.0)
    timestep[:, :6] = 0.0
    transformer = sana_video.tiny_transformer(0)
    if parallel is not None:
        fastdit.accelerate(transformer, parallel=fastdit.Parallel(**parallel))
    try:
        with torch.no_grad():
            return transformer(
                hidden_states=torch.randn(2, 4, 3, 4, 6, generator=g),
                encoder_hidden_states=torch.randn(2, 8, 32, generator=g),
                timestep=timestep,
            ).sample
    finally:
        if parallel is not None:
            fastdit.disable(transformer)


@pytest.mark.parametrize("parallel", [{"ulysses": 2}, {"ulysses": 3}], ids=["ulysses2-uneven", "ulysses3"])
def test_sana_video_per_token_timesteps_match_single_process(
    dist2: WorkerPool, dist3: WorkerPool, parallel: dict[str, int]
) -> None:
    expected = _video(0, 1, None)
    for out in _pool(dist2, dist3, parallel).run(_video, parallel, timeout=180):
        assert out.shape == expected.shape
        assert (out - expected).abs().max() < TOLERANCE, f"max abs error {(out - expected).abs().max():.2e}"


def _sana_compiled(rank: int, world_size: int) -> torch.Tensor:
    torch._dynamo.reset()
    transformer = sana.tiny_transformer(0)
    parallel = fastdit.Parallel(ulysses=world_size)
    fastdit.accelerate(transformer, parallel=parallel, compile=fastdit.Compile(backend="eager"), adapter=sana.ADAPTER)
    try:
        with torch.no_grad():
            return transformer(**_sana_inputs()).sample
    finally:
        fastdit.disable(transformer)
        torch._dynamo.reset()


@pytest.mark.slow
def test_sana_compiled_blocks_keep_the_token_sums_and_halo(dist2: WorkerPool) -> None:
    """Dynamo compiles the blocks; the token-sum mode and the halo hooks must still act inside them."""
    with torch.no_grad():
        expected = sana.tiny_transformer(0)(**_sana_inputs()).sample
    for out in dist2.run(_sana_compiled, timeout=240):
        torch.testing.assert_close(out, expected, atol=TOLERANCE, rtol=0)
