"""Routing of processors that call ``F.scaled_dot_product_attention`` themselves (``AttentionRouting.sdpa_modules``).

The proxy that replaces a module's ``F`` must send SDPA to context-parallel attention only while a marked attention
module runs in this thread; everything else (other models, local modules, other threads, other functions) is the
real ``torch.nn.functional``.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fastdit
from fastdit.parallel.attention import dispatch
from fastdit.parallel.attention.dispatch import FunctionalProxy, mark_attention_modules, route_sdpa_modules
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, validate_plan
from fastdit.testing.distributed import WorkerPool

MODULE = "diffusers.models.attention_processor"


class _Recorder:
    """Stands in for ContextParallelAttention: plain attention on (B, S, H, D), counting its calls."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
        self.calls.append({"shape": tuple(query.shape), "dropout_p": dropout_p, "is_causal": is_causal, **kwargs})
        out = F.scaled_dot_product_attention(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=attn_mask, scale=scale
        )
        return out.transpose(1, 2)


class _Model(torch.nn.Module):
    """Self-attention then cross-attention, both with processors that call F.scaled_dot_product_attention."""

    def __init__(self) -> None:
        super().__init__()
        from diffusers.models.attention_processor import Attention, AttnProcessor2_0

        torch.manual_seed(0)
        self.attn1 = Attention(8, heads=2, dim_head=4, processor=AttnProcessor2_0())
        self.attn2 = Attention(8, cross_attention_dim=8, heads=2, dim_head=4, processor=AttnProcessor2_0())
        self.proj_out = torch.nn.Linear(8, 8)

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self.attn1(hidden_states)
        return self.proj_out(self.attn2(hidden_states, encoder_hidden_states))


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(1, 6, 8, generator=generator), torch.randn(1, 4, 8, generator=generator)


def _module() -> Any:
    import diffusers.models.attention_processor as module

    return module


def test_proxy_forwards_everything_but_sdpa() -> None:
    undo = route_sdpa_modules([MODULE])
    try:
        proxy = _module().F
        assert isinstance(proxy, FunctionalProxy)
        assert proxy.gelu is F.gelu and proxy.linear is F.linear
        q = torch.randn(1, 2, 5, 4)
        torch.testing.assert_close(proxy.scaled_dot_product_attention(q, q, q), F.scaled_dot_product_attention(q, q, q))
    finally:
        undo()
    assert _module().F is F


def test_routing_on_off_local_modules_and_other_models() -> None:
    model, other = _Model(), _Model()
    inputs = _inputs()
    with torch.no_grad():
        expected = model(*inputs)
    recorder = _Recorder()
    undo_route = route_sdpa_modules([MODULE])
    undo_mark = mark_attention_modules(model, recorder, local={"attn2"})  # type: ignore[arg-type]
    try:
        with torch.no_grad():
            routed = model(*inputs)
            other(*inputs)  # same processor module, not marked: real SDPA
        torch.testing.assert_close(routed, expected)
        # attn1 only (attn2 is local); (B, S, H, D) reached the marker; nothing is active after the forward.
        assert recorder.calls == [{"shape": (1, 6, 2, 4), "dropout_p": 0.0, "is_causal": False, "enable_gqa": False}]
        assert dispatch._ACTIVE.get() is None
    finally:
        undo_mark()
        undo_route()
    with torch.no_grad():
        model(*inputs)
    assert len(recorder.calls) == 1
    assert _module().F is F


def test_other_threads_and_failing_forwards_are_not_routed() -> None:
    model = _Model()
    recorder = _Recorder()
    undo_route = route_sdpa_modules([MODULE])
    undo_mark = mark_attention_modules(model, recorder)  # type: ignore[arg-type]
    seen: list[Any] = []
    q = torch.randn(1, 2, 5, 4)

    def pre_hook(module: torch.nn.Module, args: tuple) -> None:
        # Runs inside the marked forward: another thread calling the proxy meanwhile gets the real SDPA.
        thread = threading.Thread(target=lambda: seen.append(_module().F.scaled_dot_product_attention(q, q, q)))
        thread.start()
        thread.join()

    handle = model.attn1.register_forward_pre_hook(pre_hook)
    try:
        with torch.no_grad():
            model(*_inputs())
        with pytest.raises(RuntimeError), torch.no_grad():
            model(torch.randn(1, 6, 3), torch.randn(1, 4, 8))  # wrong width: attn1 raises
        assert dispatch._ACTIVE.get() is None  # the post-hook ran although forward raised
    finally:
        handle.remove()
        undo_mark()
        undo_route()
    assert len(recorder.calls) == 2
    torch.testing.assert_close(seen[0], F.scaled_dot_product_attention(q, q, q))


def test_reference_counting() -> None:
    first = route_sdpa_modules([MODULE])
    proxy = _module().F
    second = route_sdpa_modules([MODULE, MODULE])
    assert _module().F is proxy
    first()
    assert _module().F is proxy
    second()
    assert _module().F is F


def test_dropout_and_causal_are_refused() -> None:
    from fastdit.parallel.attention.dispatch import ContextParallelAttention

    marker = ContextParallelAttention(cp_group=None)
    q = torch.randn(1, 2, 4, 4)
    for kwargs in ({"dropout_p": 0.1}, {"is_causal": True}):
        with pytest.raises(ValueError, match="neither dropout, causal"):
            dispatch._routed_sdpa(marker, q, q, q, **kwargs)


def _plan(routing: AttentionRouting) -> ContextParallelPlan:
    return ContextParallelPlan(gather={"proj_out": GatherOutput(dim=1)}, attention=routing)


def test_validate_plan_accepts_sdpa_modules_only() -> None:
    validate_plan(_Model(), _plan(AttentionRouting(sdpa_modules=(MODULE,))), 2)
    with pytest.raises(
        ValueError, match=r"AttnProcessor2_0.*does not pass a parallel_config.*sdpa_modules nor dispatch_modules"
    ):
        validate_plan(_Model(), _plan(AttentionRouting(sdpa_modules=("diffusers.models.attention",))), 2)
    with pytest.raises(ValueError, match="has no F"):
        validate_plan(_Model(), _plan(AttentionRouting(sdpa_modules=(MODULE, "json"))), 2)
    with pytest.raises(ValueError, match="name a module"):
        AttentionRouting()
    with pytest.raises(ValueError, match="expected a tuple"):
        AttentionRouting(sdpa_modules=MODULE)  # type: ignore[arg-type]


# --- end to end on gloo ranks: two routed transformers of one family, disable restores F ---


def _two_pipelines(rank: int, world_size: int) -> dict[str, Any]:
    import diffusers.models.attention_processor as module

    from fastdit.testing.pipelines import build_tiny, run_tiny

    (first, tiny), (second, _) = build_tiny("sd3", "sd3"), build_tiny("sd3", "sd3")
    expected = run_tiny(second, tiny)
    fastdit.accelerate(first, parallel=fastdit.Parallel(ulysses=world_size))
    fastdit.accelerate(second, parallel=fastdit.Parallel(ring=world_size))
    routed = isinstance(module.F, FunctionalProxy)
    outputs = [run_tiny(first, tiny), run_tiny(second, tiny)]
    fastdit.disable(first)
    still_routed = isinstance(module.F, FunctionalProxy)
    outputs.append(run_tiny(second, tiny))
    fastdit.disable(second)
    outputs.append(run_tiny(first, tiny))  # after disable: the plain model again
    modules = [m for pipe in (first, second) for m in pipe.transformer.modules()]
    return {
        "errors": [float(np.abs(out - expected).max()) for out in outputs],
        "routed": routed,
        "still_routed_after_one_disable": still_routed,
        "restored": module.F is F,
        "hooks_left": sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in modules),
    }


@pytest.mark.distributed
def test_two_transformers_routed_then_restored(dist2: WorkerPool) -> None:
    for result in dist2.run(_two_pipelines, timeout=180):
        assert result["routed"] and result["still_routed_after_one_disable"] and result["restored"]
        assert result["hooks_left"] == 0
        assert max(result["errors"]) < 1e-4, result["errors"]
