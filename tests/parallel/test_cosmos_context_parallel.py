"""Cosmos under context parallelism: how its processors' ``dispatch_attention_fn`` calls are routed.

``tests/parallel/test_family_plans.py`` compares every tiny Cosmos pipeline on gloo ranks against one process; these
tests pin the family's routing wrapper itself: unchanged behaviour without context parallelism, self-attention
routed and cross-attention local with it.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.nn.functional as F

from fastdit.models import cosmos
from fastdit.parallel.attention.dispatch import mark_attention_modules, route_sdpa_modules
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


def test_wrapper_is_installed_once_and_idempotent() -> None:
    module = _module()
    wrapper = module.dispatch_attention_fn
    assert wrapper._fastdit_cosmos
    assert module.F is F
    cosmos.route_cosmos_attention()
    assert module.dispatch_attention_fn is wrapper


def test_without_context_parallel_the_original_function_runs() -> None:
    module = _module()
    transformer = cosmos.tiny_transformer()
    with torch.no_grad():
        wrapped = transformer(**_inputs(), return_dict=False)[0]
    wrapper = module.dispatch_attention_fn
    module.dispatch_attention_fn = wrapper.__wrapped__
    try:
        with torch.no_grad():
            original = transformer(**_inputs(), return_dict=False)[0]
    finally:
        module.dispatch_attention_fn = wrapper
    assert torch.equal(wrapped, original)


def test_self_attention_is_routed_and_cross_attention_stays_local() -> None:
    transformer = cosmos.tiny_transformer()
    plan = cosmos.CP_PLAN
    validate_plan(transformer, plan, 2)
    with torch.no_grad():
        expected = transformer(**_inputs(2), return_dict=False)[0]
    recorder = _Recorder()
    local = local_attention_paths(transformer, plan.attention)
    assert local == {f"transformer_blocks.{i}.attn2" for i in range(3)}
    undo_route = route_sdpa_modules(plan.attention.sdpa_modules)
    undo_mark = mark_attention_modules(transformer, recorder, local)  # type: ignore[arg-type]
    try:
        with torch.no_grad():
            routed = transformer(**_inputs(2), return_dict=False)[0]
    finally:
        undo_mark()
        undo_route()
    assert _module().F is F
    torch.testing.assert_close(routed, expected)
    # One self-attention per block, 2 x 2 x 2 = 8 tokens, 2 heads of 16; the text cross-attention never reached it.
    assert recorder.calls == [((2, 8, 2, 16), (2, 8, 2, 16))] * 3
