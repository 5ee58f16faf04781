"""Attention dispatch: local backends, removable pass-through routing of dispatch_attention_fn, processor marks."""

from __future__ import annotations

import importlib.util
import threading

import pytest
import torch

from fastdit.config import Attention
from fastdit.parallel.attention.dispatch import (
    ContextParallelAttention,
    attention_processors,
    local_attention,
    mark_processors,
    route_modules,
)
from fastdit.parallel.attention.ulysses import sdpa_bshd
from fastdit.testing.distributed import WorkerPool

FLUX_MODULE = "diffusers.models.transformers.transformer_flux"


def _qkv(kv_heads: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 12, 4, 8, generator=g), *(torch.randn(2, 12, kv_heads, 8, generator=g) for _ in range(2))


def _flux_transformer(seed: int = 0) -> torch.nn.Module:
    from fastdit.models.flux import tiny_transformer

    return tiny_transformer(seed)


def _flux_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "hidden_states": torch.randn(1, 16, 16, generator=g),
        "encoder_hidden_states": torch.randn(1, 6, 32, generator=g),
        "pooled_projections": torch.randn(1, 32, generator=g),
        "timestep": torch.tensor([0.5]),
        "img_ids": torch.randn(16, 3, generator=g),
        "txt_ids": torch.zeros(6, 3),
        "guidance": None,
    }


def _flux_module():
    return importlib.import_module(FLUX_MODULE)


# --- local backends ---


@pytest.mark.parametrize("backend", ["sdpa", "math", "flash"])
@pytest.mark.parametrize("gqa", ["auto", "native", "repeat"])
def test_local_backends_match_sdpa(backend: str, gqa: str) -> None:
    q, k, v = _qkv(kv_heads=2)
    mask = torch.ones(2, 1, 1, 12, dtype=torch.bool)
    mask[..., -3:] = False
    expected = sdpa_bshd(q, k, v, mask, 0.3)
    attend = local_attention(Attention(backend=backend, gqa=gqa))
    use_mask = None if backend == "flash" else mask  # SDPA's flash kernel takes no mask
    if use_mask is None:
        expected = sdpa_bshd(q, k, v, None, 0.3)
    torch.testing.assert_close(attend(q, k, v, use_mask, 0.3), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cudnn", "efficient", "flash"])
def test_local_cuda_backends(backend: str) -> None:
    q, k, v = (t.cuda().half() for t in _qkv())
    out = local_attention(Attention(backend=backend))(q, k, v, None, None)
    torch.testing.assert_close(out.float(), sdpa_bshd(q.float(), k.float(), v.float()), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize(("backend", "package"), [("flash-attn", "flash-attn"), ("sage", "sageattention")])
def test_missing_external_backend_names_the_package(backend: str, package: str) -> None:
    module = {"flash-attn": "flash_attn", "sage": "sageattention"}[backend]
    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{package} is installed")
    with pytest.raises(ImportError, match=package):
        local_attention(Attention(backend=backend))


# --- routing ---


def test_route_modules_rebinds_and_restores() -> None:
    module = _flux_module()
    original = module.dispatch_attention_fn
    undo_a = route_modules([FLUX_MODULE])
    routed = module.dispatch_attention_fn
    assert routed is not original and routed.__wrapped__ is original
    undo_b = route_modules([FLUX_MODULE, FLUX_MODULE])  # a second transformer of the family: reference counted
    assert module.dispatch_attention_fn is routed
    undo_a()
    assert module.dispatch_attention_fn is routed
    undo_b()
    assert module.dispatch_attention_fn is original


def test_route_modules_rejects_modules_without_entry_point() -> None:
    with pytest.raises(ValueError, match=r"torch\.nn\.functional"):
        route_modules(["torch.nn.functional"])


def test_unmarked_calls_pass_through_unchanged() -> None:
    transformer = _flux_transformer()
    inputs = _flux_inputs()
    with torch.no_grad():
        before = transformer(**inputs).sample
    undo = route_modules([FLUX_MODULE])
    try:
        with torch.no_grad():
            assert torch.equal(transformer(**inputs).sample, before)
    finally:
        undo()


def test_routing_is_per_transformer_across_threads() -> None:
    """One transformer's processors are marked; another of the same class, in another thread, is untouched."""
    marked, other = _flux_transformer(), _flux_transformer(1)
    inputs = _flux_inputs()
    with torch.no_grad():
        expected = other(**inputs).sample
    calls: list[int] = []

    class Recording(ContextParallelAttention):
        def __call__(self, query, key, value, attn_mask=None, scale=None, **kwargs):
            calls.append(query.shape[1])
            return sdpa_bshd(query, key, value, attn_mask, scale)

    undo = [route_modules([FLUX_MODULE]), mark_processors(marked, Recording(cp_group=None))]
    results: dict[str, torch.Tensor] = {}

    def run_other() -> None:
        with torch.no_grad():
            results["other"] = other(**inputs).sample

    try:
        thread = threading.Thread(target=run_other)
        thread.start()
        with torch.no_grad():
            marked(**inputs)
        thread.join()
    finally:
        for fn in reversed(undo):
            fn()
    assert torch.equal(results["other"], expected)
    assert calls == [22] * 3  # the marked transformer's three attention calls (1 double + 2 single blocks)


def test_mark_processors_sets_and_restores() -> None:
    transformer = _flux_transformer()
    processors = list(attention_processors(transformer).values())
    assert len(processors) == 3
    marker = ContextParallelAttention(cp_group=None)
    undo = mark_processors(transformer, marker)
    assert all(p._parallel_config is marker for p in processors)
    undo()
    assert all(p._parallel_config is None and "_parallel_config" not in vars(p) for p in processors)


def test_mark_processors_refuses_diffusers_parallel_config() -> None:
    transformer = _flux_transformer()
    processor = next(iter(attention_processors(transformer).values()))
    processor._parallel_config = object()
    with pytest.raises(ValueError, match="diffusers' own parallelism"):
        mark_processors(transformer, ContextParallelAttention(cp_group=None))


def test_context_parallel_attention_rejects_dropout_and_causal() -> None:
    marker = ContextParallelAttention(cp_group=None)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="dropout"):
        marker(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match="causal"):
        marker(q, k, v, is_causal=True)


# --- the routed entry point on ranks ---


def _routed_processor(rank: int, world_size: int) -> float:
    """A Flux attention module, called on sequence shards through the routed entry point, equals the full call."""
    import torch.distributed as dist

    transformer = _flux_transformer()
    attn = transformer.transformer_blocks[0].attn
    g = torch.Generator().manual_seed(5)
    hidden, encoder = torch.randn(1, 12, 32, generator=g), torch.randn(1, 6, 32, generator=g)
    with torch.no_grad():
        full_hidden, full_encoder = attn(hidden_states=hidden, encoder_hidden_states=encoder)
    marker = ContextParallelAttention(cp_group=dist.group.WORLD, ulysses_group=dist.group.WORLD, ulysses_degree=2)
    undo = [route_modules([FLUX_MODULE]), mark_processors(transformer, marker)]
    try:
        img, txt = slice(rank * 6, rank * 6 + 6), slice(rank * 3, rank * 3 + 3)
        with torch.no_grad():
            out_hidden, out_encoder = attn(hidden_states=hidden[:, img], encoder_hidden_states=encoder[:, txt])
    finally:
        for fn in reversed(undo):
            fn()
    return max(
        (out_hidden - full_hidden[:, img]).abs().max().item(), (out_encoder - full_encoder[:, txt]).abs().max().item()
    )


@pytest.mark.distributed
def test_routed_processor_on_two_ranks(dist2: WorkerPool) -> None:
    for err in dist2.run(_routed_processor):
        assert err < 1e-5
