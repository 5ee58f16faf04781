"""Static FP8 (``Quantize(mode="fp8_static")``): recording the activation scales, quantizing with them, the scales
file, and the refusals. torchao's static FP8 matmul runs on the CPU (``torch._scaled_mm``), so the numerics are
tested here in float32; the GPU test checks bf16 on a CUDA GPU of compute capability 8.9 or newer.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import fastdit
from fastdit.calibration import calibrate_scales
from fastdit.config import FP8_MAX, ActivationScales, Quantize
from fastdit.errors import ArgumentError, FieldError, FieldsError
from fastdit.metrics import compare
from fastdit.quantize import load_scales, save_scales, static_config
from fastdit.testing.pipelines import build_tiny, run_tiny

pytest.importorskip("torchao")

FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@functools.lru_cache(maxsize=3)
def _built(family: str) -> tuple[Any, Any]:
    return build_tiny(family)


@functools.lru_cache(maxsize=3)
def _scales(family: str) -> ActivationScales:
    pipe, tiny = _built(family)
    return calibrate_scales(pipe, lambda: run_tiny(pipe, tiny))


def _quality(a: np.ndarray, b: np.ndarray) -> Any:
    shape = a.shape[-3:]
    return compare(list(a.reshape(-1, *shape)), list(b.reshape(-1, *shape)))


def _run(family: str, **options: Any) -> tuple[np.ndarray, dict[str, Any]]:
    pipe, tiny = _built(family)
    fastdit.accelerate(pipe, **options)
    try:
        return run_tiny(pipe, tiny), fastdit.summary(pipe).transformers["transformer"]
    finally:
        fastdit.disable(pipe)


def _static(family: str, **fields: Any) -> Quantize:
    return Quantize(mode="fp8_static", scales=_scales(family), **fields)


# --- recording ---


def test_records_the_largest_input_of_every_block_linear() -> None:
    pipe, tiny = _built("flux")
    seen: dict[str, float] = {}
    handles = []
    for name, module in pipe.transformer.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith(("transformer_blocks.", "single_transformer")):

            def hook(_m: Any, args: tuple[Any, ...], name: str = name) -> None:
                seen[name] = max(seen.get(name, 0.0), float(args[0].abs().max()))

            handles.append(module.register_forward_pre_hook(hook))
    try:
        run_tiny(pipe, tiny)
    finally:
        for handle in handles:
            handle.remove()
    scales = _scales("flux")
    table = {name: entry for name, entry in scales.lookup().items() if ":" not in name}  # attention inputs aside
    assert set(table) == {f"transformer.{name}" for name in seen}  # the blocks' Linears, no embedder
    for name, amax in seen.items():
        assert table[f"transformer.{name}"][0] == pytest.approx(amax, rel=1e-6), name
    assert table["transformer.transformer_blocks.0.attn.to_q"][1] == 3  # (batch, tokens, features)
    assert table["transformer.transformer_blocks.0.norm1.linear"][1] == 2  # AdaLN: (batch, features)
    assert "FluxTransformer2DModel" in scales.model and "layers" in repr(scales)
    assert not fastdit.api.context_of(pipe), "the calibration left the pipeline accelerated"


def test_recording_leaves_the_outputs_and_weights_alone() -> None:
    pipe, tiny = _built("flux")
    expected = run_tiny(pipe, tiny)
    outputs: list[np.ndarray] = []
    calibrate_scales(pipe, lambda: outputs.append(run_tiny(pipe, tiny)))
    assert np.array_equal(outputs[0], expected)


def test_recording_refuses_compile_graphs_and_cache() -> None:
    pipe, _ = _built("flux")
    recording = Quantize(mode="fp8_static", calibrate=True)
    for option in ({"compile": fastdit.Compile(backend="eager")}, {"cache": fastdit.DBCache(fn=1)}):
        with pytest.raises(ArgumentError, match="calibrate=True records every layer") as info:
            fastdit.accelerate(pipe, quantize=recording, **option)
        assert info.value.field == "quantize" and next(iter(option)) in str(info.value)


# --- quantizing ---


@pytest.mark.parametrize("family", ["flux", "sd3", "ltx"])  # widths FP8 matmuls take (tiny Wan's are 24)
def test_static_fp8_is_close_and_undoes_exactly(family: str) -> None:
    pipe, tiny = _built(family)
    state = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    expected = run_tiny(pipe, tiny)
    out, info = _run(family, quantize=_static(family))
    report = info["quantize"]
    assert report["mode"] == "fp8_static" and report["num_quantized"] > 0
    assert report["bytes_after"] < report["bytes_before"] / 3.5  # FP8 weights of float32 ones, and one scale each
    assert not np.array_equal(out, expected), "quantization changed nothing"
    quality = _quality(expected, out)
    assert quality.psnr >= 35 and quality.ssim >= 0.98, (quality.psnr, quality.ssim)
    assert all(torch.equal(pipe.transformer.state_dict()[k], v) for k, v in state.items())
    assert np.array_equal(run_tiny(pipe, tiny), expected), "disable is not bit-identical"


def test_the_scale_maps_the_recorded_maximum_to_e4m3s_largest_value() -> None:
    config = static_config(3.5, 3, 2.0, torch.device("cpu"))
    scale = config.act_quant_scale
    assert scale.shape == (1, 1, 1) and scale.dtype == torch.float32
    assert scale.item() == pytest.approx(3.5 * 2.0 / FP8_MAX)
    assert config.set_inductor_config is False  # torchao's default rewrites process-wide inductor settings
    assert static_config(0.0, 2, 1.0, torch.device("cpu")).act_quant_scale.item() > 0  # an all-zero input


def test_headroom_changes_the_scales_not_the_quality() -> None:
    one, _ = _run("flux", quantize=_static("flux"))
    four, _ = _run("flux", quantize=_static("flux", headroom=4.0))
    pipe, tiny = _built("flux")
    expected = run_tiny(pipe, tiny)
    assert not np.array_equal(one, four)
    assert _quality(expected, four).psnr >= 35  # e4m3's relative precision does not depend on the scale


def test_clipping_without_headroom_costs_quality() -> None:
    pipe, tiny = _built("flux")
    expected = run_tiny(pipe, tiny)
    scales = _scales("flux")
    tenth = ActivationScales(
        layers=scales.layers, amax=tuple(a / 10 for a in scales.amax), ndims=scales.ndims, model=scales.model
    )
    clipped, _ = _run("flux", quantize=Quantize(mode="fp8_static", scales=tenth))
    good, _ = _run("flux", quantize=_static("flux"))
    assert _quality(expected, clipped).psnr < _quality(expected, good).psnr - 10  # the scales are what is used


def test_layers_without_a_recorded_scale_stay_unquantized() -> None:
    scales = _scales("flux")
    keep = [i for i, name in enumerate(scales.layers) if not name.endswith("proj_out")]
    partial = ActivationScales(
        layers=tuple(scales.layers[i] for i in keep),
        amax=tuple(scales.amax[i] for i in keep),
        ndims=tuple(scales.ndims[i] for i in keep),
        model=scales.model,
    )
    _, info = _run("flux", quantize=Quantize(mode="fp8_static", scales=partial))
    skipped = info["quantize"]["skipped"]
    assert skipped["single_transformer_blocks.0.proj_out"].startswith("no recorded activation scale")
    assert "single_transformer_blocks.0.proj_mlp" in info["quantize"]["quantized"]


def test_scales_of_another_model_are_refused_before_anything() -> None:
    pipe, _ = _built("flux")
    before = {n: p for n, p in pipe.transformer.named_parameters()}
    with pytest.raises(ArgumentError, match="the scales were recorded on LTX") as info:
        fastdit.accelerate(pipe, quantize=_static("ltx"))
    assert info.value.field == "quantize" and "LTXVideoTransformer3DModel" in str(info.value)
    assert all(p is before[n] for n, p in pipe.transformer.named_parameters())


def test_composes_with_a_cache_and_compiled_blocks() -> None:
    quantized, _ = _run("flux", quantize=_static("flux"))
    never = fastdit.DBCache(fn=1, bn=0, threshold=0.0, warmup_steps=0)
    both, info = _run("flux", quantize=_static("flux"), cache=never)
    assert info["techniques"][:2] == ["quantize", "cache"] and np.array_equal(both, quantized)
    compiled, info = _run("flux", quantize=_static("flux"), compile=fastdit.Compile(backend="eager", fullgraph=True))
    assert info["techniques"] == ["quantize", "compile"]
    np.testing.assert_allclose(compiled, quantized, atol=1e-5)
    caching = fastdit.DBCache(fn=1, bn=0, threshold=10.0, warmup_steps=1)
    plain_cached, _ = _run("flux", cache=caching)
    cached, info = _run("flux", quantize=_static("flux"), cache=caching)
    assert info["cache"]["num_cached_steps"] > 0 and _quality(plain_cached, cached).psnr >= 35


# --- the config and the file ---


@pytest.mark.parametrize(
    ("kwargs", "fields"),
    [
        ({"mode": "fp8_static"}, ("mode", "scales")),
        ({"mode": "fp8", "calibrate": True}, ("mode", "scales", "headroom", "calibrate", "weight_scales")),
        ({"mode": "int8_weight", "headroom": 2.0}, ("mode", "scales", "headroom", "calibrate", "weight_scales")),
    ],
)
def test_config_refuses_fields_that_do_not_go_together(kwargs: dict, fields: tuple[str, ...]) -> None:
    with pytest.raises(FieldsError) as info:
        Quantize(**kwargs)
    assert info.value.owner == "Quantize" and tuple(info.value.fields) == fields


def test_config_refuses_bad_values() -> None:
    with pytest.raises(FieldError) as info:
        Quantize(mode="fp8_static", calibrate=True, headroom=0.5)
    assert info.value.field == "headroom"
    with pytest.raises(FieldError) as info:
        Quantize(mode="fp8_static", scales={"a": 1.0})
    assert info.value.field == "scales"
    with pytest.raises(FieldError) as info:
        ActivationScales(layers=("a", "a"), amax=(1.0, 2.0), ndims=(2, 2))
    assert info.value.field == "layers"
    with pytest.raises(FieldError) as info:
        ActivationScales(layers=("a",), amax=(float("nan"),), ndims=(2,))
    assert info.value.field == "amax"
    with pytest.raises(FieldsError, match="one amax and one input rank per layer"):
        ActivationScales(layers=("a", "b"), amax=(1.0,), ndims=(2, 2))
    assert hash(_static("flux"))  # frozen and hashable, like every config


def test_scales_file_round_trip(tmp_path: Path) -> None:
    scales = _scales("flux")
    path = tmp_path / "scales.json"
    save_scales(path, scales, provenance={"heldout": {"psnr_min": 41.0}})
    assert load_scales(path) == scales
    data = json.loads(path.read_text())
    assert data["format"] == "fastdit-scales/1" and data["provenance"] == {"heldout": {"psnr_min": 41.0}}
    assert not list(tmp_path.glob("*.tmp*")), "written atomically: no temporary file left"


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("not json", "not JSON"),
        ('{"format": "fastdit-cache/1"}', "format 'fastdit-cache/1', expected 'fastdit-scales/1'"),
        ('{"format": "fastdit-scales/1", "layers": []}', "'layers' must map layer names"),
        ('{"format": "fastdit-scales/1", "layers": {"a": {"amax": -1, "ndim": 2}}}', "ActivationScales.amax"),
    ],
)
def test_a_bad_scales_file_names_what_is_wrong(tmp_path: Path, content: str, needle: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")) as info:
        load_scales(path)
    assert str(path) in str(info.value)


# --- GPU ---


@pytest.mark.gpu
@pytest.mark.skipif(not FP8_GPU, reason="FP8 matmuls need a CUDA GPU of compute capability >= 8.9")
@pytest.mark.parametrize("weight_scales", ["tensor", "row"])
def test_gpu_static_fp8_on_flux_eager_compiled_and_graphed(weight_scales: str) -> None:
    pipe, tiny = build_tiny("flux")
    pipe.to("cuda", torch.bfloat16)
    expected = run_tiny(pipe, tiny)
    scales = calibrate_scales(pipe, lambda: run_tiny(pipe, tiny))
    config = Quantize(mode="fp8_static", scales=scales, weight_scales=weight_scales)
    outputs = {}
    for name, options in {
        "eager": {},
        "compiled": {"compile": fastdit.Compile()},
        "graphed": {"compile": fastdit.Compile(), "cuda_graph": fastdit.CudaGraph()},
    }.items():
        fastdit.accelerate(pipe, quantize=config, **options)
        try:
            run_tiny(pipe, tiny)  # warm-up (compile, capture)
            outputs[name] = run_tiny(pipe, tiny)
            report = fastdit.summary(pipe).transformers["transformer"]["quantize"]
        finally:
            fastdit.disable(pipe)
        assert report["weight_scales"] == weight_scales and report["num_quantized"] > 0
        assert _quality(expected, outputs[name]).psnr >= 30, name
    assert _quality(outputs["eager"], outputs["graphed"]).psnr >= 40
    assert np.array_equal(run_tiny(pipe, tiny), expected)
