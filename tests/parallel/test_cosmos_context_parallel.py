"""Cosmos under context parallelism: its processors' ``dispatch_attention_fn`` calls (no ``parallel_config``) are
routed through ``AttentionRouting.dispatch_modules``.

``tests/parallel/test_family_plans.py`` compares every tiny Cosmos pipeline on gloo ranks against one process; these
tests pin the routing itself: self-attention routed, cross-attention local, everything restored afterwards.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from fastdit.models import cosmos
from fastdit.parallel.attention.dispatch import mark_attention_modules, route_marked_dispatch, route_modules
from fastdit.parallel.plan import local_attention_paths, validate_plan


def _module() -> Any:
    return importlib.import_module(cosmos._MODULE)


class _Recorder:
    """Stands in for ContextParallelAttention: plain attention on (B, S, H, D), recording each call's shapes."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
        self.calls.append((tuple(query.shape), tuple(key.shape)))
        out = F.scaled_dot_product_attention(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=attn_mask, scale=scale
        )
        return out.transpose(1, 2)


def _inputs(batch: int = 1) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "hidden_states": torch.randn(batch, cosmos._LATENT, 2, 4, 4, generator=generator),
        "timestep": torch.full((batch,), 0.5),
        "encoder_hidden_states": torch.randn(batch, 5, cosmos._TEXT_DIM, generator=generator),
    }


def test_self_attention_is_routed_and_cross_attention_stays_local() -> None:
    transformer = cosmos.tiny_transformer()
    plan = cosmos.CP_PLAN
    validate_plan(transformer, plan, 2)
    with torch.no_grad():
        expected = transformer(**_inputs(2), return_dict=False)[0]
    recorder = _Recorder()
    local = local_attention_paths(transformer, plan.attention)
    assert local == {f"transformer_blocks.{i}.attn2" for i in range(3)}
    original = _module().dispatch_attention_fn
    undo_route = route_marked_dispatch(plan.attention.dispatch_modules)
    undo_mark = mark_attention_modules(transformer, recorder, local)  # type: ignore[arg-type]
    try:
        with torch.no_grad():
            routed = transformer(**_inputs(2), return_dict=False)[0]
            outside = _module().dispatch_attention_fn(*(torch.ones(1, 3, 2, 4),) * 3)  # no marked module runs
    finally:
        undo_mark()
        undo_route()
    assert _module().dispatch_attention_fn is original
    torch.testing.assert_close(routed, expected)
    torch.testing.assert_close(outside, torch.ones(1, 3, 2, 4))
    # One self-attention per block, 2 x 2 x 2 = 8 tokens, 2 heads of 16; the text cross-attention never reached it.
    assert recorder.calls == [((2, 8, 2, 16), (2, 8, 2, 16))] * 3


def test_one_module_cannot_take_both_routers() -> None:
    undo = route_marked_dispatch(cosmos.CP_PLAN.attention.dispatch_modules)
    try:
        with pytest.raises(ValueError, match="already routed"):
            route_modules(cosmos.CP_PLAN.attention.dispatch_modules)
    finally:
        undo()
    assert not getattr(_module().dispatch_attention_fn, "_fastdit_router", False)
