"""JoyImage-Edit-Plus: the family suite over the multi-reference edit and text-to-image tiny pipelines."""

from __future__ import annotations

import pytest
import torch

import fastdit
from fastdit.testing.distributed import get_pool
from tests.models.family_suite import FamilySuite, pytest_generate_tests  # noqa: F401 - pytest hook


class TestJoyImageEditPlus(FamilySuite):
    family = "joyimage_edit_plus"


def _padded_call(masked: bool) -> tuple[torch.nn.Module, dict]:
    """Two samples of different lengths (target + one 8 x 8 or one 4 x 4 reference): the shorter one is padded,
    and with the text mask the model masks its padded patches and the padded text; without it, nothing."""
    from fastdit.models.joyimage_edit_plus import tiny_transformer

    transformer = tiny_transformer(seed=0)
    g = torch.Generator().manual_seed(0)
    shapes = [[(1, 4, 4), (1, 4, 4)], [(1, 4, 4), (1, 2, 2)]]  # 32 and 20 patches
    kwargs = {
        "hidden_states": torch.randn(2, 32, 16, 1, 2, 2, generator=g),
        "timestep": torch.tensor([500.0, 500.0]),
        "encoder_hidden_states": torch.randn(2, 7, 32, generator=g),
        "encoder_hidden_states_mask": torch.tensor([[1] * 7, [1] * 5 + [0] * 2]) if masked else None,
        "shape_list": shapes,
        "return_dict": False,
    }
    return transformer, kwargs


def _run_padded(rank: int, world_size: int, parallel: dict | None, masked: bool) -> torch.Tensor:
    transformer, kwargs = _padded_call(masked)
    if parallel is not None:
        fastdit.accelerate(transformer, parallel=fastdit.Parallel(**parallel))
    try:
        with torch.no_grad():
            return transformer(**kwargs)[0]
    finally:
        if parallel is not None:
            fastdit.disable(transformer)


_LAYOUTS = [({"ulysses": 2}, 2, True), ({"ring": 2}, 2, True), ({"ulysses": 3}, 3, True), ({"ulysses": 2}, 2, False)]


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("parallel", "world", "masked"), _LAYOUTS, ids=["ulysses2-mask", "ring2-mask", "ulysses3-mask", "ulysses2-no-mask"]
)
def test_padded_batch_under_context_parallelism_matches_one_process(parallel: dict, world: int, masked: bool) -> None:
    """The global [image, text] key-padding mask is reordered into shard order (unevenly on 3 ranks); without a mask
    the per-sample RoPE tables alone are split."""
    expected = _run_padded(0, 1, None, masked)
    for out in get_pool(world).run(_run_padded, parallel, masked, timeout=120):
        assert (out - expected).abs().max() < 1e-5, f"max abs error {(out - expected).abs().max():.2e}"
