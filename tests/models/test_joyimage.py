"""JoyImage-Edit: the family suite over the edit (reference image) and text-to-image tiny pipelines."""

from __future__ import annotations

import pytest
import torch

import fastdit
from fastdit.testing.distributed import get_pool
from tests.models.family_suite import FamilySuite, pytest_generate_tests  # noqa: F401 - pytest hook


class TestJoyImage(FamilySuite):
    family = "joyimage"


def _mrope_call() -> tuple[torch.nn.Module, dict]:
    """rope_type='mrope' (text RoPE too) on an edit call: two items, 2 x 16 image tokens and 7 text tokens."""
    from fastdit.models.joyimage import tiny_transformer

    transformer = tiny_transformer(seed=0, rope_type="mrope")
    g = torch.Generator().manual_seed(0)
    kwargs = {
        "hidden_states": torch.randn(1, 2, 16, 1, 8, 8, generator=g),
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": torch.randn(1, 7, 32, generator=g),
        "return_dict": False,
    }
    return transformer, kwargs


def _run_mrope(rank: int, world_size: int, parallel: dict | None) -> torch.Tensor:
    transformer, kwargs = _mrope_call()
    if parallel is not None:
        fastdit.accelerate(transformer, parallel=fastdit.Parallel(**parallel))
    try:
        with torch.no_grad():
            return transformer(**kwargs)[0]
    finally:
        if parallel is not None:
            fastdit.disable(transformer)


@pytest.mark.distributed
@pytest.mark.parametrize(("parallel", "world"), [({"ulysses": 2}, 2), ({"ring": 2}, 2), ({"ulysses": 3}, 3)])
def test_text_rope_under_context_parallelism_matches_one_process(parallel: dict, world: int) -> None:
    """The nested (image, text) RoPE pairs split each with its own stream, unevenly on 3 ranks."""
    expected = _run_mrope(0, 1, None)
    for out in get_pool(world).run(_run_mrope, parallel, timeout=120):
        assert (out - expected).abs().max() < 1e-5, f"max abs error {(out - expected).abs().max():.2e}"
