"""Krea 2 under context parallelism with a padded text: the key-padding mask over the joint [text | image] sequence.

The tiny pipeline's prompts fill their text, so this drives the bare transformer with a padded second sample; the
text-fusion blocks (local attention) see the mask too.
"""

from __future__ import annotations

import pytest
import torch

import fastdit
from fastdit.testing.distributed import WorkerPool

pytestmark = pytest.mark.distributed


def _inputs() -> dict[str, torch.Tensor]:
    """Two samples, 7 text tokens (the second with 4 padding tokens), a 6 x 4 grid of image tokens."""
    g = torch.Generator().manual_seed(3)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, 3:] = False
    ids = torch.zeros(7 + 24, 3)
    ids[7:, 1] = torch.arange(24) // 4
    ids[7:, 2] = torch.arange(24) % 4
    return {
        "hidden_states": torch.randn(2, 24, 16, generator=g),
        "encoder_hidden_states": torch.randn(2, 7, 3, 32, generator=g),
        "timestep": torch.tensor([0.6, 0.6]),
        "position_ids": ids,
        "encoder_attention_mask": mask,
    }


def _run(rank: int, world_size: int, parallel: dict[str, int] | None) -> torch.Tensor:
    from fastdit.models.krea2 import tiny_transformer

    transformer = tiny_transformer(0)
    if parallel is not None:
        fastdit.accelerate(transformer, parallel=fastdit.Parallel(**parallel))
    try:
        with torch.no_grad():
            return transformer(**_inputs()).sample
    finally:
        if parallel is not None:
            fastdit.disable(transformer)


@pytest.mark.parametrize(
    "parallel", [{"ulysses": 2}, {"ring": 2}, {"ulysses": 3}, {"ring": 3}], ids=["u2", "r2", "u3", "r3"]
)
def test_padded_text_matches_single_process(dist2: WorkerPool, dist3: WorkerPool, parallel: dict[str, int]) -> None:
    expected = _run(0, 1, None)
    pool = dist2 if fastdit.Parallel(**parallel).world_size == 2 else dist3
    for out in pool.run(_run, parallel, timeout=180):
        assert torch.isfinite(out).all()
        assert (out - expected).abs().max() < 1e-5
