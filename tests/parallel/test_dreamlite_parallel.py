"""DreamLite's tensor-parallel plan on the bare ``DreamLiteTransformer2DModel`` over 2 gloo ranks against one process:
with two KV heads the full plan splits attention (q and k/v in whole heads), with DreamLite's single KV head the
no-attention fallback keeps attention whole; a cross-attention mask over the text rides along."""

from __future__ import annotations

import pytest
import torch

import fastdit
from fastdit.testing.distributed import WorkerPool

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-4


def _run(rank: int, world_size: int, kv_heads: int, tp: int) -> tuple[torch.Tensor, str | None]:
    from diffusers.models.transformers.transformer_2d_dreamlite import DreamLiteTransformer2DModel
    from diffusers.models.unets.unet_dreamlite import DreamLiteAttnProcessor2_0

    from fastdit.testing.components.encoders import build

    model = build(
        DreamLiteTransformer2DModel,
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=16,
        num_layers=2,
        norm_num_groups=4,
        cross_attention_dim=8,
        qk_norm="rms_norm",
        num_kv_heads=kv_heads,
        ff_mult=2,
    )
    for module in model.modules():  # the GQA-aware processor the UNet installs
        if hasattr(module, "set_processor"):
            module.set_processor(DreamLiteAttnProcessor2_0())
    generator = torch.Generator().manual_seed(0)
    sample = torch.randn(1, 16, 4, 4, generator=generator)
    text = torch.randn(1, 5, 8, generator=generator)
    mask = torch.tensor([[1, 1, 1, 0, 0]])
    plan = None
    if tp > 1:
        fastdit.accelerate(model, parallel=fastdit.Parallel(tp=tp))
    try:
        with torch.no_grad():
            out = model(sample, text, torch.tensor([500.0]), encoder_attention_mask=mask, return_dict=False)[0]
        if tp > 1:
            (info,) = fastdit.summary(model).transformers.values()
            plan = info["tensor_parallel"]["plan"]
        return out, plan
    finally:
        if tp > 1:
            fastdit.disable(model)


@pytest.mark.parametrize(("kv_heads", "plan"), [(2, "full"), (1, "no-attention")])
def test_tp2_matches_single_process(dist2: WorkerPool, kv_heads: int, plan: str) -> None:
    expected, _ = _run(0, 1, kv_heads, 1)
    for out, used in dist2.run(_run, kv_heads, 2, timeout=180):
        assert used == plan
        assert out.shape == expected.shape and torch.isfinite(out).all()
        assert (out - expected).abs().max() < TOLERANCE, f"max abs error {(out - expected).abs().max():.2e}"
