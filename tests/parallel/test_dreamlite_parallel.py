"""DreamLite's parallel plans on the bare ``DreamLiteTransformer2DModel`` over gloo ranks against one process.

Tensor parallelism: with two KV heads the full plan splits attention (q and k/v in whole heads), with DreamLite's
single KV head the no-attention fallback keeps attention whole. Context parallelism (the UNet's stacks are covered by
the family matrix): the bare model's one stack, split at its first block and gathered after its last, with the GQA
processor the UNet installs and with diffusers' default one, over an odd token count (uneven shards) with a
self-attention key mask. A cross-attention mask over the text rides along in both."""

from __future__ import annotations

import pytest
import torch

import fastdit
from fastdit.testing.distributed import WorkerPool

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-4


def _run(
    rank: int, world_size: int, kv_heads: int, tp: int, cp: dict | None = None, gqa_processor: bool = True
) -> tuple[torch.Tensor, str | None]:
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
    if gqa_processor:
        for module in model.modules():  # the GQA-aware processor the UNet installs
            if hasattr(module, "set_processor"):
                module.set_processor(DreamLiteAttnProcessor2_0())
    generator = torch.Generator().manual_seed(0)
    # 3 x 5 = 15 tokens under context parallelism (uneven over 2 ranks), 4 x 4 otherwise.
    sample = torch.randn(1, 16, *((3, 5) if cp else (4, 4)), generator=generator)
    text = torch.randn(1, 5, 8, generator=generator)
    mask = torch.tensor([[1, 1, 1, 0, 0]])
    plan = None
    parallel = fastdit.Parallel(tp=tp, **(cp or {})) if world_size > 1 else None
    if parallel is not None:
        fastdit.accelerate(model, parallel=parallel)
    try:
        with torch.no_grad():
            # Under context parallelism a self-attention key mask too (the last tokens masked), split with the keys.
            keys = torch.arange(15).unsqueeze(0) < 12 if cp else None
            out = model(
                sample,
                text,
                torch.tensor([500.0]),
                attention_mask=keys,
                encoder_attention_mask=mask,
                return_dict=False,
            )[0]
        if parallel is not None:
            (info,) = fastdit.summary(model).transformers.values()
            plan = info["tensor_parallel"]["plan"] if tp > 1 else ",".join(info["techniques"])
        return out, plan
    finally:
        if parallel is not None:
            fastdit.disable(model)


@pytest.mark.parametrize(("kv_heads", "plan"), [(2, "full"), (1, "no-attention")])
def test_tp2_matches_single_process(dist2: WorkerPool, kv_heads: int, plan: str) -> None:
    expected, _ = _run(0, 1, kv_heads, 1)
    for out, used in dist2.run(_run, kv_heads, 2, timeout=180):
        assert used == plan
        assert out.shape == expected.shape and torch.isfinite(out).all()
        assert (out - expected).abs().max() < TOLERANCE, f"max abs error {(out - expected).abs().max():.2e}"


# Each processor under one layout (both layouts with both processors add time, not coverage: the routing is per
# processor module, the exchange per layout).
@pytest.mark.parametrize(
    ("layout", "gqa_processor"),
    [({"ulysses": 2}, True), ({"ring": 2}, False)],
    ids=["ulysses2-gqa-processor", "ring2-default-processor"],
)
def test_cp2_matches_single_process(dist2: WorkerPool, layout: dict, gqa_processor: bool) -> None:
    # Two KV heads: diffusers' default processor does not repeat fewer KV heads (nor does the model need it to).
    expected, _ = _run(0, 1, 2, 1, layout, gqa_processor)
    for out, techniques in dist2.run(_run, 2, 1, layout, gqa_processor, timeout=180):
        assert "context_parallel" in techniques.split(",")
        assert out.shape == expected.shape and torch.isfinite(out).all()
        assert (out - expected).abs().max() < TOLERANCE, f"max abs error {(out - expected).abs().max():.2e}"
