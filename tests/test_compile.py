"""Compile(vae=True): the VAE decoders compiled beside the blocks, undone by disable, refused where it cannot apply."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch._dynamo import register_backend

import fastdit
from fastdit.context import context_of
from fastdit.errors import ArgumentError, FieldError
from fastdit.testing.pipelines import build_tiny, run_tiny

_BACKEND = "fastdit_test_recording"
_TRACED: list[str] = []


@register_backend(name=_BACKEND)
def _recording_backend(graph: torch.fx.GraphModule, inputs: list) -> object:
    """Records the code of every graph dynamo hands over, and runs it as traced."""
    _TRACED.append(graph.code)
    return graph.forward


def _compiled(module: torch.nn.Module) -> bool:
    return getattr(module, "_compiled_call_impl", None) is not None


def test_vae_decoder_compiled_and_restored() -> None:
    """The decoder runs compiled code (dynamo traced it) with the eager result, and disable hands the eager one back."""
    torch._dynamo.reset()
    _TRACED.clear()
    pipe, tiny = build_tiny("flux")
    expected = run_tiny(pipe, tiny, num_inference_steps=2)
    fastdit.accelerate(pipe, compile=fastdit.Compile(backend=_BACKEND, vae=True))
    try:
        assert _compiled(pipe.vae.decoder)
        out = run_tiny(pipe, tiny, num_inference_steps=2)
        applied = [r.technique for r in context_of(pipe).applied("vae")]
    finally:
        fastdit.disable(pipe)
    torch._dynamo.reset()
    assert any("group_norm" in code for code in _TRACED), "the decoder was never traced (only the VAE has GroupNorms)"
    np.testing.assert_allclose(out, expected, atol=1e-6)
    assert not _compiled(pipe.vae.decoder)
    assert applied == ["compile.vae"]


def test_vae_compile_off_by_default() -> None:
    """Compile() alone leaves the VAE eager."""
    pipe, _ = build_tiny("flux")
    fastdit.accelerate(pipe, compile=fastdit.Compile(backend="eager"))
    try:
        assert not _compiled(pipe.vae.decoder)
    finally:
        fastdit.disable(pipe)


def test_vae_compile_refused_without_vae() -> None:
    """A bare transformer has no VAE: the field is named before anything is touched."""
    pipe, _ = build_tiny("flux")
    with pytest.raises(ArgumentError, match=r"vae=True.*no VAE"):
        fastdit.accelerate(pipe.transformer, compile=fastdit.Compile(backend="eager", vae=True))


def test_vae_compile_field_checked() -> None:
    with pytest.raises(FieldError, match="vae"):
        fastdit.Compile(vae="yes")


def test_vae_compile_refused_with_a_parallel_decode() -> None:
    """A parallel decode's halo exchanges run between the decoder's layers: the combination is refused by name."""
    from fastdit.components import walk
    from fastdit.context import Request
    from fastdit.techniques import _check_vae_compile

    pipe, _ = build_tiny("flux")
    request = Request(
        compile=fastdit.Compile(backend="eager", vae=True), parallel=fastdit.Parallel(ulysses=2, vae=True)
    )
    with pytest.raises(ArgumentError, match=r"Compile\(vae=True\) with Parallel\(vae=True\)"):
        _check_vae_compile(request, walk(pipe))


def _has_runner(module: torch.nn.Module) -> bool:
    from fastdit.hooks.blocks import runner_of

    return runner_of(module) is not None


def test_outer_modules_of_flux() -> None:
    """The transformer's children that hold no block, in order; block lists are left out."""
    from fastdit.compile import outer_modules

    pipe, _ = build_tiny("flux")
    names = [n for n, _ in pipe.transformer.named_children()]
    outer = [n for n, _ in outer_modules(pipe.transformer, ["transformer_blocks.0", "single_transformer_blocks.0"])]
    assert outer == [n for n in names if n not in ("transformer_blocks", "single_transformer_blocks")]
    assert {"pos_embed", "time_text_embed", "x_embedder", "norm_out", "proj_out"} <= set(outer)


def test_outer_modules_compiled_and_restored() -> None:
    """Compile(outer=True) traces the RoPE tables and the final norm too, with the eager result; disable removes
    every runner it set."""
    from fastdit.compile import outer_modules

    torch._dynamo.reset()
    _TRACED.clear()
    pipe, tiny = build_tiny("flux")
    expected = run_tiny(pipe, tiny, num_inference_steps=2)
    blocks = ["transformer_blocks.0", "single_transformer_blocks.0"]
    outer = [m for _, m in outer_modules(pipe.transformer, blocks)]
    fastdit.accelerate(pipe, compile=fastdit.Compile(backend=_BACKEND, outer=True))
    try:
        assert all(_has_runner(m) for m in outer)
        out = run_tiny(pipe, tiny, num_inference_steps=2)
    finally:
        fastdit.disable(pipe)
    torch._dynamo.reset()
    assert any("cos" in code for code in _TRACED), "the RoPE tables were never traced"
    assert any("layer_norm" in code for code in _TRACED), "norm_out was never traced"
    np.testing.assert_allclose(out, expected, atol=1e-6)
    assert not any(_has_runner(m) for m in outer)


def test_outer_modules_eager_by_default() -> None:
    pipe, _ = build_tiny("flux")
    fastdit.accelerate(pipe, compile=fastdit.Compile(backend="eager"))
    try:
        assert _has_runner(pipe.transformer.transformer_blocks[0])
        assert not _has_runner(pipe.transformer.pos_embed)
        assert not _has_runner(pipe.transformer.norm_out)
    finally:
        fastdit.disable(pipe)


def test_outer_field_checked() -> None:
    with pytest.raises(FieldError, match="outer"):
        fastdit.Compile(outer=1)
