from __future__ import annotations

import pytest
import torch

import fastdit
from fastdit.models.lumina2 import TP_PLAN
from fastdit.parallel.tp_plan import resolve_tp_plan
from fastdit.testing.distributed import get_pool
from tests.models.family_suite import FamilySuite, pytest_generate_tests  # noqa: F401 - pytest hook


class TestLumina2(FamilySuite):
    family = "lumina2"


# --- tensor parallelism: the tiny pipeline has one KV head, so the family matrix only reaches the no-attention
# fallback; a transformer with 2 KV heads (4 query heads, GQA 2:1) takes the full plan, KV heads split. ---


def _gqa_transformer(num_kv_heads: int) -> torch.nn.Module:
    from diffusers import Lumina2Transformer2DModel

    from fastdit.testing.components.encoders import build

    return build(
        Lumina2Transformer2DModel,
        seed=0,
        sample_size=16,
        patch_size=2,
        in_channels=4,
        hidden_size=64,
        num_layers=2,
        num_refiner_layers=1,
        num_attention_heads=4,
        num_kv_heads=num_kv_heads,
        multiple_of=16,
        axes_dim_rope=(4, 6, 6),
        cap_feat_dim=32,
    )


def _inputs() -> dict[str, torch.Tensor]:
    """Two samples, 7 caption tokens (the second with 4 padding tokens), an 8 x 8 latent (16 image tokens)."""
    g = torch.Generator().manual_seed(3)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, 3:] = False
    return {
        "hidden_states": torch.randn(2, 4, 8, 8, generator=g),
        "timestep": torch.tensor([0.6, 0.6]),
        "encoder_hidden_states": torch.randn(2, 7, 32, generator=g),
        "encoder_attention_mask": mask,
    }


def _run_tp(rank: int, world_size: int, num_kv_heads: int, tp: int) -> tuple[torch.Tensor, str | None]:
    transformer = _gqa_transformer(num_kv_heads)
    if tp > 1:
        fastdit.accelerate(transformer, parallel=fastdit.Parallel(tp=tp))
    try:
        with torch.no_grad():
            out = transformer(**_inputs()).sample
        if tp == 1:
            return out, None
        (info,) = fastdit.summary(transformer).transformers.values()
        return out, info["tensor_parallel"]["plan"]
    finally:
        if tp > 1:
            fastdit.disable(transformer)


def test_tp_plan_resolves_by_kv_heads() -> None:
    # 2 KV heads: tp=2 splits them (full plan); 1 KV head or tp=4 over 2 KV heads: attention stays whole.
    for kv_heads, degree, name in ((2, 2, "full"), (2, 4, "no-attention"), (1, 2, "no-attention")):
        meta = _gqa_transformer(kv_heads).to("meta")
        assert resolve_tp_plan(meta, TP_PLAN, degree, "lumina2").name == name, (kv_heads, degree)


@pytest.mark.distributed
def test_tp2_full_plan_splits_kv_heads() -> None:
    expected, _ = _run_tp(0, 1, 2, 1)
    for out, plan in get_pool(2).run(_run_tp, 2, 2, timeout=180):
        assert plan == "full"
        assert torch.isfinite(out).all()
        assert (out - expected).abs().max() < 1e-4
