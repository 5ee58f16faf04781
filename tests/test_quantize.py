"""Quantization on CPU: the layer choice, int8 weight-only end to end on tiny pipelines of several families against
the unquantized output (PSNR / SSIM), exact undo, the report, and composition with the cache and compiled blocks.

FP8 dynamic modes need a CUDA GPU (torchao refuses the CPU): here they are checked to be refused up front; their
numerics are tested on the GPU (``gpu`` marker).
"""

from __future__ import annotations

import functools
import re
import sys
from typing import Any

import numpy as np
import pytest
import torch

import fastdit
from fastdit.config import Quantize
from fastdit.errors import ArgumentError, FieldError
from fastdit.metrics import compare
from fastdit.quantize import apply_quantize, check_quantize, plan_layers, tensor_bytes
from fastdit.testing.pipelines import build_tiny, run_tiny

pytest.importorskip("torchao")

FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
NO_FP8_GPU = "FP8 dynamic modes need a CUDA GPU of compute capability >= 8.9"


class Toy(torch.nn.Module):
    """An embedder, a block list (attention-like and MLP-like linears, one of odd width) and a final projection."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(64, 64)
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleDict({"qkv": torch.nn.Linear(64, 192), "out": torch.nn.Linear(64, 64)}) for _ in range(2)
        )
        self.odd = torch.nn.ModuleList([torch.nn.Linear(64, 40)])
        self.proj_out = torch.nn.Linear(64, 64)


def _reasons(config: Quantize, paths: tuple[str, ...] = ("blocks", "odd")) -> dict[str, str | None]:
    return {c.name: c.reason for c in plan_layers(Toy(), config, paths)}


def test_default_scope_is_the_blocks() -> None:
    reasons = _reasons(Quantize(mode="int8_weight"))
    assert [n for n, r in reasons.items() if r is None] == [
        "blocks.0.qkv",
        "blocks.0.out",
        "blocks.1.qkv",
        "blocks.1.out",
        "odd.0",
    ]
    assert "outside the transformer blocks" in reasons["embed"] and "outside" in reasons["proj_out"]


def test_include_exclude_and_min_size() -> None:
    reasons = _reasons(Quantize(mode="int8_weight", include=("*",), exclude=("*.out",), min_size=64 * 40 + 1))
    assert reasons["embed"] is None and reasons["proj_out"] is None  # include reaches outside the blocks
    assert reasons["blocks.0.out"] == "excluded by '*.out'"
    assert reasons["odd.0"] == f"{64 * 40} weight elements < min_size={64 * 40 + 1}"
    assert reasons["blocks.1.qkv"] is None
    assert _reasons(Quantize(mode="int8_weight", include="blocks.1.*"))["blocks.0.qkv"] == "not matched by include"


def test_fp8_skips_widths_its_matmul_cannot_take() -> None:
    reasons = _reasons(Quantize(mode="fp8"))
    assert "divisible by 16" in reasons["odd.0"]  # 40 output features
    assert reasons["blocks.0.qkv"] is None
    assert _reasons(Quantize(mode="int8_weight"))["odd.0"] is None


@pytest.mark.parametrize("mode", ["fp8_tensor", "fp8_static"])
def test_per_tensor_fp8_skips_a_128x128_weight(mode: str) -> None:
    """torchao 0.18 takes the one per-tensor scale of a 128x128 weight for 128x128 blockwise scaling."""
    toy = torch.nn.Module()
    toy.blocks = torch.nn.ModuleList([torch.nn.Linear(128, 128), torch.nn.Linear(128, 256)])
    calibrate = {"calibrate": True} if mode == "fp8_static" else {}
    recording = {c.name: c.reason for c in plan_layers(toy, Quantize(mode=mode, **calibrate), ("blocks",))}
    scales = fastdit.ActivationScales(layers=("transformer.blocks.0",), amax=(1.0,), ndims=(2,))
    config = Quantize(mode=mode, scales=scales) if mode == "fp8_static" else Quantize(mode=mode)
    reasons = {c.name: c.reason for c in plan_layers(toy, config, ("blocks",))}
    assert "128x128 blockwise" in reasons["blocks.0"] and reasons["blocks.1"] is None
    if mode == "fp8_static":  # recording watches every candidate, whatever its shape
        assert recording["blocks.0"] is None
    assert {c.name: c.reason for c in plan_layers(toy, Quantize(mode="fp8"), ("blocks",))}["blocks.0"] is None


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"mode": "fp4"}, "mode"),
        ({"mode": "FP8"}, "mode"),
        ({"include": ("",)}, "include"),
        ({"exclude": (3,)}, "exclude"),
        ({"min_size": -1}, "min_size"),
        ({"min_size": True}, "min_size"),
    ],
)
def test_config_refuses_bad_values(kwargs: dict, field: str) -> None:
    with pytest.raises(FieldError) as info:
        Quantize(**kwargs)
    assert info.value.owner == "Quantize" and info.value.field == field


def test_config_keeps_patterns_as_tuples() -> None:
    assert Quantize(include=["a.*", "b"], exclude="c").include == ("a.*", "b")
    assert Quantize(exclude="c").exclude == ("c",)
    assert hash(Quantize(include=["a"]))  # frozen and hashable, like every config


@pytest.mark.parametrize("mode", ["int8_weight", "fp8_weight", "int8"])
def test_cpu_modes_are_close_and_undo_exactly(mode: str) -> None:
    torch.manual_seed(0)
    toy = Toy()
    originals = {n: (p, p.detach().clone()) for n, p in toy.named_parameters()}
    x = torch.randn(3, 64)
    expected = toy.blocks[0]["qkv"](x)
    applied = apply_quantize(toy, Quantize(mode=mode), ("blocks",))
    out = toy.blocks[0]["qkv"](x)
    error = ((out - expected).norm() / expected.norm()).item()
    assert 0 < error < 0.05, error  # quantized (not the float weights), and close
    state = applied.state
    assert len(state.quantized) == 4 and state.bytes_after < state.bytes_before / 1.8
    assert state.bytes_before == sum(tensor_bytes(originals[f"{n}.weight"][0]) for n in state.quantized)
    applied.undo()
    for name, param in toy.named_parameters():
        assert param is originals[name][0] and torch.equal(param, originals[name][1]), name
        assert type(param.data) is torch.Tensor
    assert "weight=" not in repr(toy)  # torchao's extra_repr removed with its weights


@pytest.mark.parametrize("mode", ["int8_weight", "fp8_weight", "int8"])
def test_quantizing_leaves_inductor_settings_alone(mode: str) -> None:
    """torchao's default rewrites process-wide inductor settings (coordinate-descent tuning: minutes of compile)."""
    import torch._inductor.config as inductor_config

    from fastdit.quantize import torchao_config

    shared = [m for m in fastdit.config.QUANTIZE_MODES if m not in fastdit.config.STATIC_FP8_MODES]
    assert all(torchao_config(m).set_inductor_config is False for m in shared)  # static: one config per layer
    names = ("coordinate_descent_tuning", "coordinate_descent_check_all_directions", "force_fuse_int_mm_with_mul")
    before = {name: getattr(inductor_config, name) for name in names}
    applied = apply_quantize(Toy(), Quantize(mode=mode), ("blocks",))
    try:
        assert {name: getattr(inductor_config, name) for name in names} == before
    finally:
        applied.undo()


@pytest.mark.skipif(FP8_GPU, reason="this machine runs FP8")
@pytest.mark.parametrize("mode", ["fp8", "fp8_tensor"])
def test_fp8_dynamic_refused_on_cpu_before_anything(mode: str) -> None:
    pipe, _ = _built("flux")
    before = {n: p for n, p in pipe.transformer.named_parameters()}
    with pytest.raises(ArgumentError) as info:
        fastdit.accelerate(pipe, quantize=Quantize(mode=mode))
    assert info.value.field == "quantize" and "compute capability 8.9" in str(info.value)
    assert "int8_weight" in str(info.value)  # says what to use instead
    assert all(p is before[n] for n, p in pipe.transformer.named_parameters())


@pytest.mark.parametrize(
    ("capability", "dtype", "needle"),
    [
        ((8, 0), torch.bfloat16, "needs compute capability 8.9 or newer; A100 has 8.0"),
        ((9, 0), torch.float16, "bfloat16 weights only (torchao); the transformer's are float16"),
        ((9, 0), torch.bfloat16, None),
    ],
)
def test_fp8_device_and_dtype_checks(monkeypatch: pytest.MonkeyPatch, capability, dtype, needle) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "A100")
    if needle is None:
        check_quantize(Quantize(mode="fp8"), torch.device("cuda", 0), dtype)
        return
    with pytest.raises(ValueError, match=re.escape(needle)):
        check_quantize(Quantize(mode="fp8"), torch.device("cuda", 0), dtype)
    check_quantize(Quantize(mode="int8_weight"), torch.device("cuda", 0), dtype)  # weight-only: any GPU, any dtype


def test_missing_torchao_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)  # makes the import raise ImportError
    pipe, _ = _built("flux")
    with pytest.raises(ImportError, match=r"'torchao'.*fastdit\[quant\]"):
        fastdit.accelerate(pipe, quantize=Quantize(mode="int8_weight"))
    with pytest.raises(ValueError, match="not accelerated"):
        fastdit.summary(pipe)


def test_offload_is_refused_naming_both() -> None:
    pipe, _ = _built("flux")
    with pytest.raises(ArgumentError, match="offload streams plain weights") as info:
        fastdit.accelerate(pipe, quantize=Quantize(mode="int8_weight"), offload=fastdit.Offload())
    assert info.value.field == "quantize"
    with pytest.raises(ValueError, match="not accelerated"):
        fastdit.summary(pipe)


def test_accelerate_refuses_a_wrong_type() -> None:
    pipe, _ = _built("flux")
    with pytest.raises(TypeError, match="expected Quantize"):
        fastdit.accelerate(pipe, quantize="fp8")


# --- tiny pipelines ---


@functools.lru_cache(maxsize=2)
def _built(family: str) -> tuple[Any, Any]:
    return build_tiny(family)


def _quality(a: np.ndarray, b: np.ndarray) -> Any:
    """PSNR and SSIM over every image (and every frame of a video) of two outputs."""
    shape = a.shape[-3:]
    return compare(list(a.reshape(-1, *shape)), list(b.reshape(-1, *shape)))


def _run(family: str, **options: Any) -> tuple[np.ndarray, dict[str, Any]]:
    pipe, tiny = _built(family)
    fastdit.accelerate(pipe, **options)
    try:
        out = run_tiny(pipe, tiny)
        info = fastdit.summary(pipe).transformers
    finally:
        fastdit.disable(pipe)
    return out, info


@pytest.mark.parametrize("family", ["flux", "sd3", "wan"])
def test_int8_weight_only_end_to_end(family: str) -> None:
    pipe, tiny = _built(family)
    transformer = pipe.transformer
    state = {k: v.clone() for k, v in transformer.state_dict().items()}
    expected = run_tiny(pipe, tiny)
    out, info = _run(family, quantize=Quantize(mode="int8_weight"))
    report = info["transformer"]["quantize"]
    assert report["num_quantized"] > 0 and report["bytes_after"] < report["bytes_before"] / 1.8
    assert all("outside the transformer blocks" in r for r in report["skipped"].values())
    assert any("embed" in name for name in report["skipped"])  # embedders keep their dtype
    assert "quantize" in info["transformer"]["techniques"]
    quality = _quality(expected, out)
    assert not np.array_equal(out, expected), "quantization changed nothing"
    assert quality.psnr >= 40 and quality.ssim >= 0.98, (quality.psnr, quality.ssim)
    assert all(torch.equal(transformer.state_dict()[k], v) for k, v in state.items())
    assert np.array_equal(run_tiny(pipe, tiny), expected), "disable is not bit-identical"


def test_composes_with_a_cache_that_never_caches() -> None:
    quantized, _ = _run("flux", quantize=Quantize(mode="int8_weight"))
    never = fastdit.DBCache(fn=1, bn=0, threshold=0.0, warmup_steps=0)
    both, info = _run("flux", quantize=Quantize(mode="int8_weight"), cache=never)
    assert info["transformer"]["techniques"][:2] == ["quantize", "cache"]
    assert np.array_equal(both, quantized)


def test_composes_with_a_cache_that_caches() -> None:
    cache = fastdit.DBCache(fn=1, bn=0, threshold=10.0, warmup_steps=1)
    plain_cached, _ = _run("flux", cache=cache)
    both, info = _run("flux", quantize=Quantize(mode="int8_weight"), cache=cache)
    assert info["transformer"]["cache"]["num_cached_steps"] > 0
    assert _quality(plain_cached, both).psnr >= 40


def test_composes_with_compiled_blocks() -> None:
    quantized, _ = _run("flux", quantize=Quantize(mode="int8_weight"))
    compiled, info = _run(
        "flux", quantize=Quantize(mode="int8_weight"), compile=fastdit.Compile(backend="eager", fullgraph=True)
    )
    assert info["transformer"]["techniques"] == ["quantize", "compile"]
    np.testing.assert_allclose(compiled, quantized, atol=1e-5)


@pytest.mark.slow
def test_composes_with_inductor() -> None:
    quantized, _ = _run("flux", quantize=Quantize(mode="int8_weight"))
    compiled, _ = _run("flux", quantize=Quantize(mode="int8_weight"), compile=fastdit.Compile())
    assert _quality(quantized, compiled).psnr >= 50


# --- GPU ---


@pytest.mark.gpu
@pytest.mark.skipif(not FP8_GPU, reason=NO_FP8_GPU)
@pytest.mark.parametrize("mode", ["fp8", "fp8_tensor", "fp8_weight", "int8_weight"])
def test_gpu_modes_on_flux(mode: str) -> None:
    pipe, tiny = build_tiny("flux")
    pipe.to("cuda", torch.bfloat16)
    expected = run_tiny(pipe, tiny)
    fastdit.accelerate(pipe, quantize=Quantize(mode=mode))
    try:
        out = run_tiny(pipe, tiny)
        report = fastdit.summary(pipe).transformers["transformer"]["quantize"]
    finally:
        fastdit.disable(pipe)
    assert report["num_quantized"] > 0
    assert _quality(expected, out).psnr >= 30
    assert np.array_equal(run_tiny(pipe, tiny), expected)
