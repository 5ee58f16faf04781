"""Static FP8 with row-wise weight scales (``Quantize(mode="fp8_static", weight_scales="row")``): the matmul against
its definition, what row-wise scales keep that a per-tensor scale loses, the pipeline, and the refusals. The row-wise
``torch._scaled_mm`` runs on the CPU in bfloat16; the GPU test of static FP8 (``tests/test_quantize_static.py``) runs
both weight scalings on the CUDA kernels, eager, compiled and in CUDA graphs.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fastdit
from fastdit.calibration import calibrate_scales
from fastdit.config import FP8_MAX, ActivationScales, Quantize
from fastdit.errors import ArgumentError, FieldError, FieldsError
from fastdit.metrics import compare
from fastdit.quantize import rowwise_weight
from fastdit.quantize_rows import rowwise_linear
from fastdit.testing.pipelines import build_tiny, run_tiny

pytest.importorskip("torchao")

E4M3 = torch.float8_e4m3fn


@functools.lru_cache(maxsize=3)
def _built(family: str = "flux") -> tuple[Any, Any]:
    pipe, tiny = build_tiny(family)
    return pipe.to(torch.bfloat16), tiny


@functools.lru_cache(maxsize=3)
def _scales(family: str = "flux") -> ActivationScales:
    pipe, tiny = _built(family)
    return calibrate_scales(pipe, lambda: run_tiny(pipe, tiny))


def _run(family: str = "flux", **options: Any) -> tuple[np.ndarray, dict[str, Any]]:
    pipe, tiny = _built(family)
    fastdit.accelerate(pipe, **options)
    try:
        return run_tiny(pipe, tiny), fastdit.summary(pipe).transformers["transformer"]
    finally:
        fastdit.disable(pipe)


def _rows(family: str = "flux", **fields: Any) -> Quantize:
    return Quantize(mode="fp8_static", scales=_scales(family), weight_scales="row", **fields)


def _quality(a: np.ndarray, b: np.ndarray) -> Any:
    shape = a.shape[-3:]  # every image, and every frame of a video
    return compare(list(a.reshape(-1, *shape)), list(b.reshape(-1, *shape)))


# --- the matmul ---


def test_the_matmul_is_its_definition() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 24, 64, dtype=torch.bfloat16)
    weight = torch.randn(48, 64, dtype=torch.bfloat16)
    bias = torch.randn(48, dtype=torch.bfloat16)
    scale = 4.0 / FP8_MAX
    quantized = rowwise_weight(weight)
    assert quantized.qdata.dtype == E4M3 and quantized.scale.shape == (48, 1) and quantized.dtype == torch.bfloat16
    out = rowwise_linear(x, quantized, scale, bias)
    assert out.shape == (2, 24, 48) and out.dtype == torch.bfloat16
    # By definition: the activation cast at the fixed scale, each weight row at its own, products in float32.
    xq = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(E4M3).float() * scale
    wq = quantized.qdata.float() * quantized.scale
    expected = xq @ wq.T + bias.float()
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
    exact = F.linear(x.float(), weight.float(), bias.float())
    assert (out.float() - exact).abs().max() < 0.1 * exact.abs().max()


def test_row_scales_keep_small_output_channels_a_tensor_scale_loses() -> None:
    # Half the output channels 100,000x smaller than the others: one scale for the whole weight flushes them to
    # e4m3's subnormals and zero, one scale per channel keeps their relative precision.
    torch.manual_seed(0)
    weight = torch.randn(32, 64, dtype=torch.bfloat16)
    weight[16:] *= 1e-5
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    exact = F.linear(x.float(), weight.float())
    scale = x.abs().max().item() / FP8_MAX
    rows = rowwise_linear(x, rowwise_weight(weight), scale, None).float()
    tensor_scale = weight.abs().max().float() / FP8_MAX
    wq = (weight.float() / tensor_scale).to(E4M3).float() * tensor_scale
    xq = (x.float() / scale).to(E4M3).float() * scale
    per_tensor = xq @ wq.T

    def small_error(out: torch.Tensor) -> float:
        return ((out[:, 16:] - exact[:, 16:]).norm() / exact[:, 16:].norm()).item()

    assert small_error(rows) < 0.05
    assert small_error(per_tensor) > 4 * small_error(rows)


# --- the pipeline ---


@pytest.mark.parametrize("family", ["flux", "sd3", "ltx"])  # the families of the per-tensor test
def test_row_scales_are_close_and_undo_exactly(family: str) -> None:
    pipe, tiny = _built(family)
    state = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    expected = run_tiny(pipe, tiny)
    out, info = _run(family, quantize=_rows(family))
    report = info["quantize"]
    assert report["mode"] == "fp8_static" and report["weight_scales"] == "row" and report["num_quantized"] > 0
    # 128 x 128 weights too: only torchao's per-tensor matmul mistakes their one scale for a 128 x 128 block.
    assert not any("128x128" in reason for reason in report["skipped"].values())
    assert report["bytes_after"] < report["bytes_before"] / 1.8  # FP8 of bfloat16, and one scale per row
    assert not np.array_equal(out, expected), "quantization changed nothing"
    quality = _quality(expected, out)
    assert quality.psnr >= 30 and quality.ssim >= 0.95, (quality.psnr, quality.ssim)
    tensor, _ = _run(family, quantize=Quantize(mode="fp8_static", scales=_scales(family)))
    assert not np.array_equal(out, tensor), "the row scales were not used"
    assert all(torch.equal(pipe.transformer.state_dict()[k], v) for k, v in state.items())
    assert np.array_equal(run_tiny(pipe, tiny), expected), "disable is not bit-identical"


def test_the_recorded_scales_are_what_is_used() -> None:
    scales = _scales()
    tenth = ActivationScales(
        layers=scales.layers, amax=tuple(a / 10 for a in scales.amax), ndims=scales.ndims, model=scales.model
    )
    pipe, tiny = _built()
    expected = run_tiny(pipe, tiny)
    clipped, _ = _run(quantize=Quantize(mode="fp8_static", scales=tenth, weight_scales="row"))
    good, _ = _run(quantize=_rows())
    assert _quality(expected, clipped).psnr < _quality(expected, good).psnr - 10


def test_composes_with_a_cache_and_compiled_blocks() -> None:
    quantized, _ = _run(quantize=_rows())
    never = fastdit.DBCache(fn=1, bn=0, threshold=0.0, warmup_steps=0)
    both, info = _run(quantize=_rows(), cache=never)
    assert info["techniques"][:2] == ["quantize", "cache"] and np.array_equal(both, quantized)
    compiled, info = _run(quantize=_rows(), compile=fastdit.Compile(backend="aot_eager", fullgraph=True))
    assert info["techniques"] == ["quantize", "compile"]
    np.testing.assert_allclose(compiled, quantized, atol=2e-2)


# --- refusals ---


def test_weight_scales_belong_to_static_fp8() -> None:
    with pytest.raises(FieldsError) as info:
        Quantize(mode="fp8", weight_scales="row")
    assert info.value.owner == "Quantize" and "weight_scales" in info.value.fields
    with pytest.raises(FieldError) as info:
        Quantize(mode="fp8_static", calibrate=True, weight_scales="column")
    assert info.value.field == "weight_scales"


def test_float32_weights_are_refused_before_anything() -> None:
    pipe, _ = build_tiny("flux")  # float32
    before = {n: p for n, p in pipe.transformer.named_parameters()}
    scales = _scales()
    with pytest.raises(ArgumentError, match="weight_scales='row' quantizes bfloat16 weights only") as info:
        fastdit.accelerate(pipe, quantize=Quantize(mode="fp8_static", scales=scales, weight_scales="row"))
    assert info.value.field == "quantize" and "the transformer's are float32" in str(info.value)
    assert all(p is before[n] for n, p in pipe.transformer.named_parameters())
