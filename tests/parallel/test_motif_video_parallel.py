"""Motif-Video's transformer split over gloo ranks, on the inputs and variants its tiny pipelines do not reach.

The pipelines always pass a padded text mask and (I2V) image embeddings, and the tiny model has no decoder blocks;
the model also accepts no mask, no image embeddings, a batch of two with different padding, and decoder blocks
(``num_decoder_layers``: the last single blocks run on a copy of the patch embeddings). Each is checked against one
process under Ulysses, ring, uneven Ulysses over 3 ranks and tensor parallelism.
"""

from __future__ import annotations

import pytest
import torch

import fastdit
from fastdit.testing.distributed import WorkerPool

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-5

CASES = {
    "plain-no-mask": ({}, {"mask": False, "image": False, "batch": 1}),
    "i2v-batch2-masks": ({}, {"mask": True, "image": True, "batch": 2}),
    "decoder-cross-attention": (
        {"num_decoder_layers": 1, "enable_text_cross_attention_dual": True, "enable_text_cross_attention_single": True},
        {"mask": True, "image": True, "batch": 1},
    ),
}
LAYOUTS = {"ulysses2": {"ulysses": 2}, "ring2": {"ring": 2}, "ulysses3-uneven": {"ulysses": 3}, "tp2": {"tp": 2}}


def _call(mask: bool, image: bool, batch: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    kwargs = {
        "hidden_states": torch.randn(batch, 9, 2, 4, 6, generator=generator),  # 2 x 2 x 3 = 12 video tokens
        "timestep": torch.tensor([500.0] * batch),
        "encoder_hidden_states": torch.randn(batch, 7, 32, generator=generator),
        "return_dict": False,
    }
    if mask:
        padding = torch.ones(batch, 7, dtype=torch.long)
        padding[0, 5:] = 0
        padding[-1, 3:] = 0  # the second sample is padded differently
        kwargs["encoder_attention_mask"] = padding
    if image:
        kwargs["image_embeds"] = torch.randn(batch, 5, 16, generator=generator)
    return kwargs


def _run(rank: int, world_size: int, case: str, parallel: dict[str, int] | None) -> torch.Tensor:
    from diffusers import MotifVideoTransformer3DModel

    from fastdit.testing.components.encoders import build

    config, call = CASES[case]
    model = build(
        MotifVideoTransformer3DModel,
        seed=0,
        in_channels=9,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=1,
        num_single_layers=3,
        mlp_ratio=2.0,
        text_embed_dim=32,
        image_embed_dim=16 if call["image"] else None,
        rope_axes_dim=(4, 6, 6),
        **config,
    )
    if parallel is not None:
        fastdit.accelerate(model, parallel=fastdit.Parallel(**parallel))
    try:
        with torch.no_grad():
            return model(**_call(**call))[0]
    finally:
        if parallel is not None:
            fastdit.disable(model)


# The default run takes one layout per case (every layout meets a case); the rest of the matrix is slow.
DEFAULT = {("plain-no-mask", "ulysses2"), ("i2v-batch2-masks", "ring2"), ("decoder-cross-attention", "ulysses3-uneven"),
           ("decoder-cross-attention", "tp2")}  # fmt: skip
MATRIX = [
    pytest.param(case, layout, id=f"{case}-{name}", marks=() if (case, name) in DEFAULT else pytest.mark.slow)
    for case in CASES
    for name, layout in LAYOUTS.items()
]


@pytest.mark.parametrize(("case", "parallel"), MATRIX)
def test_matches_single_process(dist2: WorkerPool, dist3: WorkerPool, case: str, parallel: dict[str, int]) -> None:
    expected = _run(0, 1, case, None)
    pool = dist3 if fastdit.Parallel(**parallel).world_size == 3 else dist2
    for out in pool.run(_run, case, parallel, timeout=180):
        assert out.shape == expected.shape and torch.isfinite(out).all()
        assert (out - expected).abs().max() < TOLERANCE, f"max abs error {(out - expected).abs().max():.2e}"
