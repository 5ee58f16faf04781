"""An attention backend on one device: routing of the transformer's SDPA calls, refusals, FP8 numerics, composition."""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fastdit
from fastdit.api import context_of
from fastdit.parallel.attention.cudnn_fp8 import E4M3, cudnn_fp8_attention, quantize_per_tensor
from fastdit.parallel.attention.single import SingleDeviceAttention, apply_attention_backend
from fastdit.testing.pipelines import build_tiny, run_tiny
from tests.parallel.attention.fp8_host import host_fp8_kernel as host_fp8_kernel_registered
from tests.parallel.attention.fp8_host import math_attention as _math

HAS_FRONTEND = importlib.util.find_spec("cudnn") is not None


def _qkv(heads: int = 4, tokens: int = 64, dim: int = 32) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    return tuple(torch.randn(2, heads, tokens, dim) for _ in range(3))


def test_calls_the_backend_cannot_take_run_sdpa_and_are_counted() -> None:
    marker = SingleDeviceAttention(backend="flash-attn", route="sdpa calls", local=_math, takes_masks=False)
    q, k, v = _qkv()
    mask = torch.rand(2, 1, 64, 64) > 0.2
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(marker.sdpa(q, k, v, attn_mask=mask), expected)
    torch.testing.assert_close(
        marker.sdpa(q, k, v, is_causal=True), F.scaled_dot_product_attention(q, k, v, is_causal=True)
    )
    torch.testing.assert_close(marker.sdpa(q, k, v), F.scaled_dot_product_attention(q, k, v), rtol=1e-5, atol=1e-5)
    assert marker.stats() == {
        "backend": "flash-attn",
        "route": "sdpa calls",
        "served_calls": 1,
        "sdpa_calls": {"mask": 1, "causal": 1},
    }


def test_routing_covers_only_the_transformer_and_is_undone() -> None:
    """SDPA calls inside the transformer's forward reach the backend; calls elsewhere and after the undo do not."""
    seen: list[tuple[int, ...]] = []

    def local(q_BSHD, k_BSHD, v_BSHD, attn_mask=None, scale=None):  # noqa: N803
        seen.append(tuple(q_BSHD.shape))
        return _math(q_BSHD, k_BSHD, v_BSHD, attn_mask, scale)

    class Attend(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(x, x, x)

    module = Attend()
    applied = apply_attention_backend(module, fastdit.Attention(backend="math"))
    applied.state.local = local
    x = torch.randn(1, 2, 8, 4)
    module(x)
    F.scaled_dot_product_attention(x, x, x)  # outside the forward: untouched
    assert seen == [(1, 8, 2, 4)]
    applied.undo()
    module(x)
    assert seen == [(1, 8, 2, 4)]


def test_fp8_backend_without_the_package_is_refused_before_anything_changes() -> None:
    if HAS_FRONTEND:
        pytest.skip("nvidia-cudnn-frontend is installed here")
    pipe, _ = build_tiny("flux")
    with pytest.raises(ImportError, match="nvidia-cudnn-frontend"):
        fastdit.accelerate(pipe, attention=fastdit.Attention(backend="cudnn-fp8"))
    assert context_of(pipe) is None


def test_unknown_backend_names_the_field() -> None:
    with pytest.raises(ValueError, match="backend"):
        fastdit.Attention(backend="fp8")


# --- the FP8 path's arithmetic, with a host stand-in for cuDNN's kernel ---


@pytest.fixture(scope="module")
def host_fp8_kernel():
    with host_fp8_kernel_registered():  # scoped to this module's tests
        yield


def test_per_tensor_quantization_round_trips() -> None:
    x = torch.randn(3, 5, 7) * 40
    x8, descale = quantize_per_tensor(x)
    assert x8.dtype == E4M3 and descale.shape == (1, 1, 1, 1)
    assert x8.float().abs().max().item() == pytest.approx(float(torch.finfo(E4M3).max))
    back = x8.float() * descale.reshape(())
    assert (back - x).abs().max() <= x.abs().max() / 16  # e4m3 keeps 3 mantissa bits


def test_fp8_attention_arithmetic(host_fp8_kernel) -> None:
    """Scales stay on the device and the output scale from max |V| never overflows: PSNR against float32 attention
    well above what e4m3 inputs allow to lose (the kernel itself adds its probability rounding on the GPU)."""
    q, k, v = (x.transpose(1, 2) for x in _qkv())  # BSHD
    v = v * 30  # values far from 1: the output scale must follow them
    out = cudnn_fp8_attention(q, k, v)
    ref = _math(q, k, v)
    assert out.dtype == q.dtype and out.shape == ref.shape
    mse = (out - ref).pow(2).mean().item()
    psnr = 10 * math.log10((ref.max() - ref.min()).item() ** 2 / mse)
    assert psnr > 30, psnr


def test_fp8_attention_compiles_in_one_graph(host_fp8_kernel) -> None:
    q, k, v = (x.transpose(1, 2) for x in _qkv())
    compiled = torch.compile(cudnn_fp8_attention, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), cudnn_fp8_attention(q, k, v))


def test_fp8_attention_refuses_masks() -> None:
    q, k, v = (x.transpose(1, 2) for x in _qkv())
    with pytest.raises(ValueError, match="no attention mask"):
        cudnn_fp8_attention(q, k, v, attn_mask=torch.ones(64, 64, dtype=torch.bool))


# --- composition with the other techniques (the math kernel: every one of them runs on CPU) ---


def test_with_a_cache_and_compiled_blocks_on_one_device() -> None:
    """Under DBCache and compiled blocks (``fullgraph``: routing adds no graph break), the math backend gives what
    the default backend gives under the same cache, with the same steps cached, and a second call compiles nothing
    new (nothing the backend does in traced code changes between calls)."""
    from torch._dynamo.utils import counters

    pipe, tiny = build_tiny("flux")
    mask = fastdit.StepMask(compute_steps=(0, 2), policy="static")
    cache = fastdit.DBCache(fn=1, bn=0, warmup_steps=0, step_mask=mask)
    compile_ = fastdit.Compile(backend="eager", fullgraph=True)
    steps = {"num_inference_steps": 4}
    fastdit.accelerate(pipe, cache=cache, compile=compile_)
    expected = run_tiny(pipe, tiny, **steps)
    expected_steps = fastdit.summary(pipe).transformers["transformer"]["cache"]["num_cached_steps"]
    fastdit.disable(pipe)
    torch._dynamo.reset()
    fastdit.accelerate(pipe, cache=cache, compile=compile_, attention=fastdit.Attention(backend="math"))
    try:
        out = run_tiny(pipe, tiny, **steps)
        graphs = counters["stats"]["unique_graphs"]
        again = run_tiny(pipe, tiny, **steps)
        info = fastdit.summary(pipe).transformers["transformer"]
    finally:
        fastdit.disable(pipe)
    np.testing.assert_allclose(out, expected, atol=5e-4, rtol=0)
    np.testing.assert_array_equal(again, out)
    assert counters["stats"]["unique_graphs"] == graphs > 0
    assert info["techniques"] == ["attention", "cache", "compile"]
    assert info["cache"]["num_cached_steps"] == expected_steps == 2
    assert info["attention"]["route"] == "dispatch"


def test_a_family_routed_by_sdpa_calls_is_refused_with_compiled_blocks() -> None:
    """CogVideoX's processors call ``F.scaled_dot_product_attention`` themselves: the backend takes them through a
    torch function mode, which compiled blocks cannot trace — refused before anything changes, and fine eagerly."""
    pipe, tiny = build_tiny("cogvideox")
    with pytest.raises(ValueError, match="torch function mode"):
        fastdit.accelerate(pipe, attention=fastdit.Attention(backend="math"), compile=fastdit.Compile(backend="eager"))
    assert context_of(pipe) is None
    fastdit.accelerate(pipe, attention=fastdit.Attention(backend="math"))
    try:
        run_tiny(pipe, tiny)
        assert fastdit.summary(pipe).transformers["transformer"]["attention"]["served_calls"] > 0
    finally:
        fastdit.disable(pipe)


# --- on a GPU with the frontend (skipped elsewhere) ---

needs_fp8_kernel = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0) and HAS_FRONTEND),
    reason="needs a CUDA GPU of compute capability 9.0+ and nvidia-cudnn-frontend",
)


@pytest.mark.gpu
@needs_fp8_kernel
@pytest.mark.parametrize("kv_heads", [24, 6], ids=["mha", "gqa"])
def test_cudnn_fp8_kernel_against_bf16_sdpa(kv_heads: int) -> None:
    """The real kernel: close to bf16 SDPA (grouped K/V repeated), and the same inside a CUDA graph."""
    from fastdit.parallel.attention.dispatch import local_attention

    torch.manual_seed(0)
    q = torch.randn(1, 1024, 24, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 1024, kv_heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    local = local_attention(fastdit.Attention(backend="cudnn-fp8"))
    ref = _math(
        q.float(), k.float().repeat_interleave(24 // kv_heads, 2), v.float().repeat_interleave(24 // kv_heads, 2)
    )
    out = local(q, k, v)
    mse = (out.float() - ref).pow(2).mean().item()
    assert 10 * math.log10((ref.max() - ref.min()).item() ** 2 / mse) > 35
    graph = torch.cuda.CUDAGraph()
    local(q, k, v)  # warm: the plan is built outside the capture
    with torch.cuda.graph(graph):
        captured = local(q, k, v)
    graph.replay()
    torch.testing.assert_close(captured, out)


def test_with_offloaded_blocks_on_one_device() -> None:
    """Streamed blocks (offload beneath the cache) see the backend as resident ones do."""
    pipe, tiny = build_tiny("flux")
    attention = fastdit.Attention(backend="math")
    fastdit.accelerate(pipe, attention=attention)
    expected = run_tiny(pipe, tiny)
    fastdit.disable(pipe)
    fastdit.accelerate(pipe, attention=attention, offload=fastdit.Offload(resident_blocks=1))
    try:
        out = run_tiny(pipe, tiny)
        info = fastdit.summary(pipe).transformers["transformer"]
    finally:
        fastdit.disable(pipe)
    np.testing.assert_array_equal(out, expected)
    assert info["techniques"] == ["attention", "offload"] and info["attention"]["served_calls"] > 0
