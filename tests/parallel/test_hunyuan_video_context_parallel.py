"""HunyuanVideo 1.0 under context parallelism: what ``tests/parallel/test_family_plans.py`` does not cover.

The generic test runs every tiny pipeline (T2V, both I2V kinds, SkyReels-V1, FramePack) against one process. Here:
the first-frame token count of token_replace I2V is what makes that variant exact (without it the plan is wrong),
and the key-padding mask both transformers build for a batch of differently padded prompts (the pipelines run one
sample per call, and FramePack builds no mask for one sample) is reordered with the shards.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np
import pytest
import torch

import fastdit
from fastdit.models.hunyuan_video import ADAPTER, CP_PLAN, tiny_framepack_transformer, tiny_transformer
from fastdit.parallel.plan import LeadingCount
from fastdit.testing.distributed import WorkerPool
from fastdit.testing.pipelines import build_tiny, run_tiny

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-4  # float32 on CPU
PARALLEL = [{"ulysses": 2}, {"ring": 2}, {"ulysses": 3}]
PARALLEL_IDS = ["ulysses2", "ring2", "ulysses3-uneven"]

# The plan without its per-rank first-frame counts: every rank would modulate the first n tokens of its own shard.
WITHOUT_COUNTS = dataclasses.replace(
    ADAPTER,
    cp_plan=dataclasses.replace(
        CP_PLAN,
        inputs={
            path: {name: spec for name, spec in args.items() if not isinstance(spec, LeadingCount)}
            for path, args in CP_PLAN.inputs.items()
        },
    ),
)


def _pool(dist2: WorkerPool, dist3: WorkerPool, parallel: dict[str, int]) -> WorkerPool:
    return dist3 if fastdit.Parallel(**parallel).world_size == 3 else dist2


@functools.lru_cache(maxsize=1)
def _token_replace() -> tuple[Any, Any]:
    return build_tiny("hunyuan_video", "i2v-token-replace")


def _token_replace_run(rank: int, world_size: int, parallel: dict[str, int] | None) -> np.ndarray:
    pipe, tiny = _token_replace()
    if parallel is None:
        return run_tiny(pipe, tiny)
    fastdit.accelerate(pipe, parallel=fastdit.Parallel(**parallel), adapter=WITHOUT_COUNTS)
    try:
        return run_tiny(pipe, tiny)
    finally:
        fastdit.disable(pipe)


@pytest.mark.parametrize("parallel", [{"ulysses": 2}, {"ulysses": 3}], ids=["ulysses2", "ulysses3-uneven"])
def test_token_replace_is_wrong_without_the_first_frame_count(
    dist2: WorkerPool, dist3: WorkerPool, parallel: dict[str, int]
) -> None:
    """The per-rank count is what the generic test's exact token_replace result rests on."""
    expected = _token_replace_run(0, 1, None)
    outs = _pool(dist2, dist3, parallel).run(_token_replace_run, parallel, timeout=180)
    assert max(np.abs(out - expected).max() for out in outs) > 1e-3


# --- a batch of two prompts with different padding: the [video | text] mask is reordered with the shards ---


def _inputs(framepack: bool) -> dict[str, Any]:
    """Two samples, 8 text tokens (the second with 5 padding tokens), 3 latent frames of 4 x 6 (2 x 3 tokens each).

    Sizes chosen so 2 and 3 ranks split the video and text tokens unevenly somewhere (FramePack: 18 + 2 x 3 clean,
    2 (2x) and 4 (4x) history tokens; 3 image + 8 text tokens).
    """
    g = torch.Generator().manual_seed(5)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 3:] = 0
    inputs: dict[str, Any] = {
        "hidden_states": torch.randn(2, 4, 3, 4, 6, generator=g),
        "timestep": torch.tensor([700, 700]),
        "encoder_hidden_states": torch.randn(2, 8, 32, generator=g),
        "encoder_attention_mask": mask,
        "pooled_projections": torch.randn(2, 32, generator=g),
        "guidance": torch.tensor([6000.0, 6000.0]),
    }
    if framepack:  # image tokens and the clean, 2x and 4x history, with the pipeline's frame counts
        inputs.update(
            image_embeds=torch.randn(2, 3, 16, generator=g),
            indices_latents=torch.arange(1, 4),
            latents_clean=torch.randn(2, 4, 2, 4, 6, generator=g),
            indices_latents_clean=torch.tensor([0, 4]),
            latents_history_2x=torch.randn(2, 4, 2, 4, 6, generator=g),
            indices_latents_history_2x=torch.tensor([5, 6]),
            latents_history_4x=torch.randn(2, 4, 16, 4, 6, generator=g),
            indices_latents_history_4x=torch.arange(7, 23),
        )
    return inputs


def _masked(rank: int, world_size: int, framepack: bool, parallel: dict[str, int] | None) -> torch.Tensor:
    transformer = tiny_framepack_transformer(0) if framepack else tiny_transformer(0)
    if parallel is not None:
        fastdit.accelerate(transformer, parallel=fastdit.Parallel(**parallel))
    try:
        with torch.no_grad():
            return transformer(**_inputs(framepack)).sample
    finally:
        if parallel is not None:
            fastdit.disable(transformer)


@pytest.mark.parametrize("parallel", PARALLEL, ids=PARALLEL_IDS)
@pytest.mark.parametrize("framepack", [False, True], ids=["plain", "framepack"])
def test_padded_batch_matches_single_process(
    dist2: WorkerPool, dist3: WorkerPool, framepack: bool, parallel: dict[str, int]
) -> None:
    expected = _masked(0, 1, framepack, None)
    for out in _pool(dist2, dist3, parallel).run(_masked, framepack, parallel, timeout=180):
        assert out.shape == expected.shape
        assert (out - expected).abs().max() < TOLERANCE, f"max abs error {(out - expected).abs().max():.2e}"
