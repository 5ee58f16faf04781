"""Static FP8 attention scales: recorded per attention module by a calibration, used by the ``cudnn-fp8`` backend.

The FP8 kernel runs on CPU here through a host stand-in (``fp8_host``): everything around it — the per-module
sites, the scales' arithmetic, compiled blocks taking the scales as graph inputs, the refusals — is fastdit's own.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

import fastdit
from fastdit.api import context_of
from fastdit.calibration import calibrate_scales
from fastdit.config import ActivationScales
from fastdit.errors import FieldError
from fastdit.metrics.quality import compare
from fastdit.parallel.attention.cudnn_fp8 import (
    E4M3,
    E4M3_MAX,
    StaticScales,
    cudnn_fp8_attention,
    quantize_static,
)
from fastdit.parallel.attention.dispatch import processor_sites
from fastdit.parallel.attention.single import attention_sites
from fastdit.quantize import load_scales, save_scales
from fastdit.testing.pipelines import build_tiny, run_tiny
from tests.parallel.attention.fp8_host import fp8_backend_on_host, host_fp8_kernel, math_attention

pytest.importorskip("torchao")  # the calibration records the Linear layers' inputs through the quantize technique

_PIPES: dict[str, tuple[Any, Any]] = {}
_SCALES: dict[str, ActivationScales] = {}


def _built(family: str) -> tuple[Any, Any]:
    if family not in _PIPES:
        _PIPES[family] = build_tiny(family)
    return _PIPES[family]


def _scales(family: str) -> ActivationScales:
    if family not in _SCALES:
        pipe, tiny = _built(family)
        _SCALES[family] = calibrate_scales(pipe, lambda: run_tiny(pipe, tiny))
    return _SCALES[family]


def _run(family: str, steps: int | None = None, **options: Any) -> tuple[np.ndarray, dict[str, Any]]:
    pipe, tiny = _built(family)
    fastdit.accelerate(pipe, **options)
    try:
        call = {} if steps is None else {"num_inference_steps": steps}
        return run_tiny(pipe, tiny, **call), fastdit.summary(pipe).transformers["transformer"]
    finally:
        fastdit.disable(pipe)


def _quality(a: np.ndarray, b: np.ndarray) -> Any:
    shape = a.shape[-3:]
    return compare(list(a.reshape(-1, *shape)), list(b.reshape(-1, *shape)))


def _qkv_BSHD() -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 64, 4, 32) for _ in range(3))
    return q, k, v * 30  # values far from 1: the output scale must follow them


# --- the scales' arithmetic ---


def test_a_static_scale_maps_the_recorded_maximum_times_headroom_to_e4m3s_largest_value() -> None:
    scales = StaticScales.of([2.0, 4.0, 0.0], headroom=2.0, device=torch.device("cpu"))
    assert [d.shape for d in scales.descale] == [(1, 1, 1, 1)] * 3
    assert scales.descale[0].item() == pytest.approx(2.0 * 2.0 / E4M3_MAX)
    assert scales.descale[1].item() == pytest.approx(4.0 * 2.0 / E4M3_MAX)
    assert scales.descale[2].item() == torch.finfo(torch.float32).tiny  # all zeros on the calibration
    for descale, inverse in zip(scales.descale, scales.inverse, strict=True):
        assert (descale * inverse).item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="three maxima"):
        StaticScales.of([1.0, 2.0], headroom=1.0, device=torch.device("cpu"))


def test_inputs_beyond_the_recorded_maximum_are_clipped_not_overflowed() -> None:
    scales = StaticScales.of([1.0, 1.0, 1.0], headroom=1.0, device=torch.device("cpu"))
    x = torch.tensor([0.5, -1.0, 3.0, -1e6]).reshape(1, 4, 1, 1)
    x8, descale = quantize_static(x, scales.descale[0], scales.inverse[0])
    assert x8.dtype == E4M3 and torch.isfinite(x8.float()).all()
    back = (x8.float() * descale.reshape(())).flatten().tolist()
    assert back == pytest.approx([0.5, -1.0, 1.0, -1.0])


def test_static_attention_at_each_tensors_own_maximum_is_the_dynamic_attention() -> None:
    """Scales equal to each call's absmax give what the dynamic path gives (the same e4m3 values up to the last
    bit of the scale's rounding), and both are close to float32 attention."""
    q, k, v = _qkv_BSHD()
    maxima = [x.abs().amax().item() for x in (q, k, v)]
    static = StaticScales.of(maxima, headroom=1.0, device=torch.device("cpu"))
    with host_fp8_kernel():
        dynamic_out = cudnn_fp8_attention(q, k, v)
        static_out = cudnn_fp8_attention(q, k, v, static=static)
        doubled = cudnn_fp8_attention(q, k, v, static=StaticScales.of(maxima, headroom=2.0, device=q.device))
    reference = math_attention(q, k, v)
    torch.testing.assert_close(static_out, dynamic_out, atol=0.05 * v.abs().max().item() / 30, rtol=0)
    for out in (static_out, doubled):  # headroom 2: one bit fewer in use, still close
        err = (out - reference).pow(2).mean().sqrt() / reference.std()
        assert err < 0.06, err


# --- recording ---


def test_the_calibration_records_every_attention_modules_inputs() -> None:
    """One entry per processor site and input (Q, K, V) beside the Linear layers'; the value maxima equal what the
    value projections produced (FLUX's V is their output unchanged: joint blocks concatenate text and image)."""
    pipe, tiny = _built("flux")
    seen: dict[str, float] = {}
    handles = []
    for path in processor_sites(pipe.transformer):
        attn = pipe.transformer.get_submodule(path)
        for projection in ("to_v", "add_v_proj"):
            module = getattr(attn, projection, None)
            if module is None:
                continue

            def hook(_m: Any, _args: Any, out: torch.Tensor, path: str = path) -> None:
                seen[path] = max(seen.get(path, 0.0), float(out.abs().max()))

            handles.append(module.register_forward_hook(hook))
    try:
        run_tiny(pipe, tiny)
    finally:
        for handle in handles:
            handle.remove()
    table = _scales("flux").lookup()
    names = attention_sites(pipe.transformer)
    assert {n for n in table if ":" in n} == set(names) and len(names) == 3 * len(seen)
    for path, amax in seen.items():
        assert table[f"transformer.{path}:v"] == (pytest.approx(amax, rel=1e-6), 4)
        assert table[f"transformer.{path}:q"][0] > 0 and table[f"transformer.{path}:k"][0] > 0


def test_families_not_routed_through_dispatch_record_no_attention_inputs() -> None:
    pipe, tiny = _built("cogvideox")
    scales = calibrate_scales(pipe, lambda: run_tiny(pipe, tiny))
    assert scales.layers and not [name for name in scales.layers if ":" in name]
    with pytest.raises(ValueError, match="not routed through diffusers' dispatch"):
        fastdit.accelerate(pipe, attention=fastdit.Attention(calibrate=True))
    assert context_of(pipe) is None


def test_attention_scales_survive_the_scales_file(tmp_path: Any) -> None:
    path = tmp_path / "flux.json"
    save_scales(path, _scales("flux"))
    assert load_scales(path) == _scales("flux")


# --- running with them ---


def test_static_scales_run_close_to_dynamic_ones_and_undo(monkeypatch: pytest.MonkeyPatch) -> None:
    pipe, _ = _built("flux")
    baseline, _ = _run("flux")
    scales = _scales("flux")
    sites = processor_sites(pipe.transformer)
    with fp8_backend_on_host(monkeypatch):
        dynamic, dynamic_info = _run("flux", attention=fastdit.Attention(backend="cudnn-fp8"))
        static, info = _run("flux", attention=fastdit.Attention(backend="cudnn-fp8", scales=scales))
    assert info["attention"]["static_scale_sites"] == len(sites) and info["attention"]["dynamic_scale_sites"] == 0
    assert info["attention"]["served_calls"] == dynamic_info["attention"]["served_calls"] > 0
    for out in (dynamic, static):
        quality = _quality(baseline, out)
        assert quality.psnr_min > 30 and quality.ssim_min > 0.9, quality
    assert _quality(dynamic, static).psnr_min > 30
    assert all("_parallel_config" not in vars(p) for p in sites.values()), "the undo left a site in place"


def test_modules_without_a_recorded_scale_keep_dynamic_scales(monkeypatch: pytest.MonkeyPatch) -> None:
    scales = _scales("flux")
    dropped = "transformer.single_transformer_blocks.0.attn:k"
    kept = [i for i, name in enumerate(scales.layers) if name != dropped]
    partial = dataclasses.replace(
        scales,
        layers=tuple(scales.layers[i] for i in kept),
        amax=tuple(scales.amax[i] for i in kept),
        ndims=tuple(scales.ndims[i] for i in kept),
    )
    with fp8_backend_on_host(monkeypatch):
        _, info = _run("flux", attention=fastdit.Attention(backend="cudnn-fp8", scales=partial))
    assert info["attention"]["dynamic_scale_sites"] == 1


def test_compiled_blocks_take_the_scales_as_graph_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each block's attention has its own scales, yet one compiled graph serves every block of a kind (as many
    graphs as with dynamic scales, none new on a second run), with the eager result."""
    from torch._dynamo.utils import counters

    compile_ = fastdit.Compile(backend="eager", fullgraph=True)
    static = fastdit.Attention(backend="cudnn-fp8", scales=_scales("flux"))
    with fp8_backend_on_host(monkeypatch):
        eager, _ = _run("flux", attention=static)
        graphs = {}
        for name, attention in (("dynamic", fastdit.Attention(backend="cudnn-fp8")), ("static", static)):
            torch._dynamo.reset()
            counters.clear()
            out, _ = _run("flux", attention=attention, compile=compile_)
            graphs[name] = counters["stats"]["unique_graphs"]
        again, _ = _run("flux", attention=static, compile=compile_)
    assert graphs["static"] == graphs["dynamic"] > 0
    assert counters["stats"]["unique_graphs"] == graphs["static"]
    np.testing.assert_allclose(out, eager, atol=2e-3, rtol=0)
    np.testing.assert_array_equal(again, out)


def test_static_scales_compose_with_a_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    mask = fastdit.StepMask(compute_steps=(0, 2), policy="static")
    cache = fastdit.DBCache(fn=1, bn=0, warmup_steps=0, step_mask=mask)
    static = fastdit.Attention(backend="cudnn-fp8", scales=_scales("flux"))
    with fp8_backend_on_host(monkeypatch):
        cached, info = _run("flux", steps=4, attention=static, cache=cache)
    plain, _ = _run("flux", steps=4, cache=cache)
    assert info["techniques"] == ["attention", "cache"] and info["cache"]["num_cached_steps"] > 0
    assert _quality(plain, cached).psnr_min > 30


def test_static_scales_with_offload_equal_the_resident_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Offload streams the blocks' weights, not the scales: each site holds its scales on the device the pipeline
    computes on. On the CPU a transfer is the host tensor itself, so the run is bit-identical to the resident one."""
    static = fastdit.Attention(backend="cudnn-fp8", scales=_scales("flux"))
    pipe, _ = _built("flux")
    with fp8_backend_on_host(monkeypatch):
        resident, _ = _run("flux", attention=static)
        offloaded, info = _run("flux", attention=static, offload=fastdit.Offload())
    assert info["offload"]["transfers"] > 0 and info["attention"]["served_calls"] > 0
    sites = len(processor_sites(pipe.transformer))
    assert info["attention"]["static_scale_sites"] == sites and info["attention"]["dynamic_scale_sites"] == 0
    np.testing.assert_array_equal(offloaded, resident)


def test_the_fp8_backend_is_checked_on_the_device_offload_computes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pipeline loaded on the CPU and offloaded to a GPU computes on the GPU: the FP8 kernel's requirement is
    checked against (and the static scales are placed on) the offload device, not the CPU the weights wait on. Here,
    without a GPU, the offload then refuses its device before anything is applied."""
    from fastdit.parallel.attention import single

    pipe, _ = _built("flux")
    asked: list[torch.device] = []
    static = fastdit.Attention(backend="cudnn-fp8", scales=_scales("flux"))
    with fp8_backend_on_host(monkeypatch):
        monkeypatch.setattr(single, "require_cuda_capability", lambda device, *_args, **_kw: asked.append(device))
        with pytest.raises(ValueError, match="no CUDA device here"):
            fastdit.accelerate(pipe, attention=static, offload=fastdit.Offload(device="cuda:0"))
    assert asked == [torch.device("cuda:0")]
    assert context_of(pipe) is None


# --- refusals ---


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"backend": "sdpa", "headroom": 2.0}, "belong to backend='cudnn-fp8'"),
        ({"backend": "cudnn-fp8", "calibrate": True}, "calibrate records in the model's dtype"),
        ({"backend": "cudnn-fp8", "headroom": 0.5}, "headroom"),
    ],
)
def test_the_config_refuses_fields_that_do_not_go_together(kwargs: dict, needle: str) -> None:
    with pytest.raises(FieldError, match=needle):
        fastdit.Attention(**kwargs)


def test_scales_of_another_model_are_refused_before_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    pipe, _ = _built("qwenimage")
    with fp8_backend_on_host(monkeypatch), pytest.raises(ValueError, match="record them on this model"):
        fastdit.accelerate(pipe, attention=fastdit.Attention(backend="cudnn-fp8", scales=_scales("flux")))
    assert context_of(pipe) is None


def test_recording_refuses_compiled_blocks_and_context_parallelism() -> None:
    pipe, _ = _built("flux")
    recording = fastdit.Attention(calibrate=True)
    with pytest.raises(ValueError, match="plain eager calls"):
        fastdit.accelerate(pipe, attention=recording, compile=fastdit.Compile(backend="eager"))
    for attention in (recording, fastdit.Attention(backend="cudnn-fp8", scales=_scales("flux"))):
        with pytest.raises(ValueError, match="under context parallelism"):
            fastdit.accelerate(pipe, attention=attention, parallel=fastdit.Parallel(ulysses=2))
    assert context_of(pipe) is None


# --- the real kernel (a CUDA GPU of compute capability 9.0+ with nvidia-cudnn-frontend; skipped elsewhere) ---


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)),
    reason="needs a CUDA GPU of compute capability 9.0+",
)
def test_cudnn_fp8_kernel_with_static_scales_against_bf16_sdpa() -> None:
    """Static scales recorded on other inputs of the same distribution (headroom 1.25): as close to bf16 SDPA as
    the dynamic scales, also for inputs above the recorded maximum (clipped), and the same inside a CUDA graph."""
    pytest.importorskip("cudnn")
    from fastdit.parallel.attention.dispatch import local_attention

    def qkv(seed: int) -> list[torch.Tensor]:
        generator = torch.Generator(device="cuda").manual_seed(seed)
        shape = (1, 1024, 24, 128)
        return [torch.randn(shape, device="cuda", generator=generator).to(torch.bfloat16) * 3 for _ in range(3)]

    maxima = [x.float().abs().amax().item() for x in qkv(1)]
    static = StaticScales.of(maxima, headroom=1.25, device=torch.device("cuda"))
    q, k, v = qkv(0)
    local = local_attention(fastdit.Attention(backend="cudnn-fp8"))
    ref = math_attention(q.float(), k.float(), v.float())

    def psnr(out: torch.Tensor) -> float:
        mse = (out.float() - ref).pow(2).mean().item()
        return 10 * np.log10((ref.max() - ref.min()).item() ** 2 / mse)

    dynamic_out, static_out = local(q, k, v), local(q, k, v, static=static)
    assert psnr(static_out) > 35 and psnr(static_out) > psnr(dynamic_out) - 1.5
    assert psnr(local(q * 2, k, v, static=static)) > 25  # Q beyond the scale: clipped, finite
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = local(q, k, v, static=static)
    graph.replay()
    torch.testing.assert_close(captured, static_out)


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)),
    reason="needs a CUDA GPU of compute capability 9.0+",
)
def test_static_scales_on_a_cpu_loaded_transformer_offloaded_to_the_gpu() -> None:
    """The real kernel on the case the offload device check exists for: a transformer loaded on the CPU and streamed
    to the GPU serves its attention from static scales on the GPU, as the same transformer resident there does."""
    pytest.importorskip("cudnn")
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=2,
        attention_head_dim=128,  # a head size the FP8 kernel takes
        num_attention_heads=2,
        joint_attention_dim=64,
        pooled_projection_dim=32,
        guidance_embeds=False,
        axes_dims_rope=(16, 56, 56),
    ).eval()
    model = model.to("cuda", torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(1)
    inputs = {
        "hidden_states": torch.randn(1, 256, 16, device="cuda", generator=g).bfloat16(),
        "encoder_hidden_states": torch.randn(1, 32, 64, device="cuda", generator=g).bfloat16(),
        "pooled_projections": torch.randn(1, 32, device="cuda", generator=g).bfloat16(),
        "img_ids": torch.rand(256, 3, device="cuda", generator=g) * 16,
        "txt_ids": torch.zeros(32, 3, device="cuda"),
        "timestep": torch.full((1,), 0.5, device="cuda"),
        "return_dict": False,
    }

    def call() -> torch.Tensor:
        with torch.no_grad():
            return model(**inputs)[0]

    plain = call()
    scales = calibrate_scales(model, call)
    static = fastdit.Attention(backend="cudnn-fp8", scales=scales)

    def run(**options: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        fastdit.accelerate(model, attention=static, **options)
        try:
            return call(), fastdit.summary(model).transformers["transformer"]
        finally:
            fastdit.disable(model)

    resident, _ = run()
    model.to("cpu")
    offloaded, info = run(offload=fastdit.Offload(device="cuda"))
    assert next(model.parameters()).device.type == "cpu"  # streamed, not moved
    assert info["offload"]["transfers"] > 0 and info["attention"]["served_calls"] > 0
    assert info["attention"]["dynamic_scale_sites"] == 0
    torch.testing.assert_close(offloaded, resident, atol=1e-2, rtol=1e-2)
    err = (resident.float() - plain.float()).abs().max().item()
    assert 0 < err < 0.1 * plain.float().abs().max().item()  # FP8 attention: changed, and close to bf16
