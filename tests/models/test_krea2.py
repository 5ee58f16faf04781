from __future__ import annotations

import pytest
import torch

import fastdit
from fastdit.models.krea2 import TP_PLAN
from fastdit.parallel.tp_plan import resolve_tp_plan
from fastdit.testing.distributed import get_pool
from tests.models.family_suite import FamilySuite, pytest_generate_tests  # noqa: F401 - pytest hook


class TestKrea2(FamilySuite):
    family = "krea2"


# --- tensor parallelism: the tiny pipelines have one KV head, so the family matrix only reaches the FFN-only
# fallback; a transformer with 2 KV heads (4 query heads, GQA 2:1) takes the full plan, KV heads split. ---


def _gqa_transformer(num_key_value_heads: int) -> torch.nn.Module:
    from diffusers import Krea2Transformer2DModel

    from fastdit.testing.components.encoders import build

    return build(
        Krea2Transformer2DModel,
        seed=0,
        in_channels=16,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        num_key_value_heads=num_key_value_heads,
        intermediate_size=128,
        timestep_embed_dim=32,
        text_hidden_dim=32,
        num_text_layers=3,
        text_num_attention_heads=2,
        text_num_key_value_heads=2,
        text_intermediate_size=64,
        num_layerwise_text_blocks=1,
        num_refiner_text_blocks=1,
        axes_dims_rope=(4, 6, 6),
    )


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


def _run_tp(rank: int, world_size: int, num_key_value_heads: int, tp: int) -> tuple[torch.Tensor, str | None]:
    transformer = _gqa_transformer(num_key_value_heads)
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
    # 2 KV heads: tp=2 splits them (full plan); 1 KV head or tp=4 over 2 KV heads: FFN only.
    for kv_heads, degree, name in ((2, 2, "full"), (2, 4, "ffn-only"), (1, 2, "ffn-only")):
        meta = _gqa_transformer(kv_heads).to("meta")
        assert resolve_tp_plan(meta, TP_PLAN, degree, "krea2").name == name, (kv_heads, degree)


@pytest.mark.distributed
def test_tp2_full_plan_splits_kv_heads() -> None:
    expected, _ = _run_tp(0, 1, 2, 1)
    for out, plan in get_pool(2).run(_run_tp, 2, 2, timeout=180):
        assert plan == "full"
        assert torch.isfinite(out).all()
        assert (out - expected).abs().max() < 1e-4
