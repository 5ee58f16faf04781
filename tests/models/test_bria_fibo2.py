"""Bria FIBO 2.0: the family suite, and context parallelism with a padded gist (the key-padding mask's path)."""

from __future__ import annotations

import functools

import pytest
import torch

import fastdit
from fastdit.testing.distributed import get_pool
from tests.models.family_suite import FamilySuite, pytest_generate_tests  # noqa: F401 - pytest hook


class TestBriaFibo2(FamilySuite):
    family = "bria_fibo2"


@functools.lru_cache(maxsize=1)
def _padded_gist_call() -> tuple[torch.nn.Module, dict]:
    """Two prompts of 8 and 64 text tokens: 4 and 8 gist tokens, so the batch pads the first prompt's gist and the
    main layers get a (B, S) key-padding mask over [image, gist]."""
    from fastdit.models.bria_fibo2 import tiny_transformer

    transformer = tiny_transformer(seed=0)
    g = torch.Generator().manual_seed(0)
    text = torch.randn(2, 6, 64, transformer.config.cap_feat_dim, generator=g)
    mask = torch.arange(64)[None] < torch.tensor([[8], [64]])
    kwargs = {
        "hidden_states": torch.randn(2, 4, 8, 8, generator=g),
        "timestep": torch.tensor([0.7, 0.7]),
        "encoder_hidden_states": text,
        "encoder_attention_mask": mask,
        "return_dict": False,
    }
    return transformer, kwargs


def _run_padded_gist(rank: int, world_size: int, parallel: dict | None) -> torch.Tensor:
    transformer, kwargs = _padded_gist_call()
    if parallel is not None:
        fastdit.accelerate(transformer, parallel=fastdit.Parallel(**parallel))
    try:
        with torch.no_grad():
            return transformer(**kwargs)[0]
    finally:
        if parallel is not None:
            fastdit.disable(transformer)


@pytest.mark.distributed
@pytest.mark.parametrize("parallel", [{"ulysses": 2}, {"ring": 2}], ids=["ulysses2", "ring2"])
def test_padded_gist_under_context_parallelism_matches_one_process(parallel: dict) -> None:
    from diffusers.models.transformers.transformer_bria_fibo2 import compute_gist_count

    transformer, kwargs = _padded_gist_call()
    config = transformer.config
    counts = compute_gist_count(
        kwargs["encoder_attention_mask"].sum(dim=1).tolist(),
        config.min_num_gist_tokens,
        config.max_num_gist_tokens,
        config.gist_step,
        config.gist_min_text_len,
        config.gist_max_text_len,
    )
    assert counts == [4, 8]  # the first prompt's gist is padded: the model builds its key-padding mask
    expected = _run_padded_gist(0, 1, None)
    for out in get_pool(2).run(_run_padded_gist, parallel, timeout=120):
        assert (out - expected).abs().max() < 1e-5, f"max abs error {(out - expected).abs().max():.2e}"
