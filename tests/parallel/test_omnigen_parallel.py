"""OmniGen's context-parallel plan on inputs the tiny pipelines do not make, on the bare transformer over gloo ranks
against one process: no condition tokens and no mask (the sequence is only [time | image]), and a batch of two
samples whose masks pad the text differently and whose position ids differ (RoPE follows the first sample's)."""

from __future__ import annotations

import pytest
import torch

import fastdit
from fastdit.testing.distributed import WorkerPool

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-4
_TEXT = 6


def _inputs(case: str) -> dict:
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(2 if case == "padded-batch" else 1, 4, 6, 6, generator=generator)  # 9 image tokens
    batch, image = latents.shape[0], (6 // 2) * (6 // 2)
    if case == "no-condition":
        seq = 1 + image
        return {
            "hidden_states": latents,
            "input_ids": None,
            "input_img_latents": [],
            "input_image_sizes": {},
            "attention_mask": None,
            "position_ids": torch.arange(seq)[None],
        }
    seq = _TEXT + 1 + image
    valid = [_TEXT, _TEXT - 2]  # the second sample's text is left-padded by two tokens
    mask = torch.zeros(batch, seq, seq)
    positions = torch.zeros(batch, seq, dtype=torch.long)
    for b, n in enumerate(valid):
        pad = _TEXT - n
        mask[b, pad:, pad:] = torch.tril(torch.ones(seq - pad, seq - pad))  # causal over condition and time
        mask[b, _TEXT + 1 :, pad:] = 1  # the image attends to everything valid, bidirectionally
        mask[b, :pad, :] = 1  # padded rows attend to all (as the collator makes them)
        positions[b, pad:] = torch.arange(seq - pad)
    ids = torch.randint(3, 200, (batch, _TEXT), generator=generator)
    return {
        "hidden_states": latents,
        "input_ids": ids,
        "input_img_latents": [],
        "input_image_sizes": {},
        "attention_mask": mask,
        "position_ids": positions,
    }


def _run(rank: int, world_size: int, parallel: dict[str, int] | None, case: str) -> torch.Tensor:
    from fastdit.models.omnigen import tiny_transformer

    transformer = tiny_transformer()
    kwargs = _inputs(case)
    if parallel is not None:
        fastdit.accelerate(transformer, parallel=fastdit.Parallel(**parallel))
    try:
        with torch.no_grad():
            sample = kwargs.pop("hidden_states")
            for t in (1.0, 0.5):
                timestep = torch.full((sample.shape[0],), t)
                out = transformer(sample, timestep, **kwargs, return_dict=False)[0]
                sample = sample - 0.5 * out
        return sample
    finally:
        if parallel is not None:
            fastdit.disable(transformer)


LAYOUTS = {"ulysses2": {"ulysses": 2}, "ring2": {"ring": 2}, "ulysses3-uneven": {"ulysses": 3}}


@pytest.mark.parametrize("case", ["no-condition", "padded-batch"])
@pytest.mark.parametrize("parallel", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_matches_single_process(dist2: WorkerPool, dist3: WorkerPool, parallel: dict[str, int], case: str) -> None:
    expected = _run(0, 1, None, case)
    pool = dist3 if fastdit.Parallel(**parallel).world_size == 3 else dist2
    for out in pool.run(_run, parallel, case, timeout=180):
        assert out.shape == expected.shape and torch.isfinite(out).all()
        assert (out - expected).abs().max() < TOLERANCE, f"max abs error {(out - expected).abs().max():.2e}"
