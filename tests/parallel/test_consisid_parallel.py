"""ConsisID's context-parallel plan on inputs its tiny pipeline does not make, on the bare transformer over gloo
ranks against one process: a model without the face modules and without RoPE (sin-cos positions added in the patch
embedding, image_rotary_emb None), and the face path with per-sample face inputs (batch 2, not broadcast)."""

from __future__ import annotations

import pytest
import torch

import fastdit
from fastdit.testing.distributed import WorkerPool

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-4


def _model_and_inputs(case: str) -> tuple[torch.nn.Module, dict]:
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    from fastdit.models import consisid

    generator = torch.Generator().manual_seed(0)
    batch, frames = 2, 2
    kwargs = {
        "hidden_states": torch.randn(batch, frames, 8, 4, 4, generator=generator),  # 2 x 2 tokens per frame
        "encoder_hidden_states": torch.randn(batch, 16, 32, generator=generator),
    }
    if case == "sincos-no-face":
        return consisid.tiny_transformer(face=False, rope=False), {**kwargs, "image_rotary_emb": None}
    model = consisid.tiny_transformer(face=True)
    cos, sin = get_3d_rotary_pos_embed(
        embed_dim=32, crops_coords=((0, 0), (2, 2)), grid_size=(2, 2), temporal_size=frames
    )
    kwargs["image_rotary_emb"] = (cos, sin)
    kwargs["id_cond"] = torch.randn(batch, 16, generator=generator)
    kwargs["id_vit_hidden"] = [torch.randn(batch, 5, 16, generator=generator) for _ in range(2)]
    return model, kwargs


def _run(rank: int, world_size: int, parallel: dict[str, int] | None, case: str) -> torch.Tensor:
    model, kwargs = _model_and_inputs(case)
    if parallel is not None:
        fastdit.accelerate(model, parallel=fastdit.Parallel(**parallel))
    try:
        with torch.no_grad():
            hidden = kwargs.pop("hidden_states")
            sample = hidden[:, :, :4]
            for t in (900, 500):
                x = torch.cat([sample, hidden[:, :, 4:]], dim=2)
                out = model(x, timestep=torch.full((x.shape[0],), t), **kwargs, return_dict=False)[0]
                sample = sample - 0.5 * out
        return sample
    finally:
        if parallel is not None:
            fastdit.disable(model)


LAYOUTS = {"ulysses2": {"ulysses": 2}, "ring2": {"ring": 2}, "ulysses3-uneven": {"ulysses": 3}}


@pytest.mark.parametrize("case", ["sincos-no-face", "face-batch-2"])
@pytest.mark.parametrize("parallel", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_matches_single_process(dist2: WorkerPool, dist3: WorkerPool, parallel: dict[str, int], case: str) -> None:
    expected = _run(0, 1, None, case)
    pool = dist3 if fastdit.Parallel(**parallel).world_size == 3 else dist2
    for out in pool.run(_run, parallel, case, timeout=180):
        assert out.shape == expected.shape and torch.isfinite(out).all()
        assert (out - expected).abs().max() < TOLERANCE, f"max abs error {(out - expected).abs().max():.2e}"
