"""Where one transformer call's time goes: the FLUX.1-dev-sized transformer at 1024², one call per step, per mode.

For every mode (one process, modes one after the other, each undone and dynamo reset before the next): the compile
(warm-up) time, the median time of ``--repeat`` calls measured with CUDA events (x 28 = the transformer's share of a
28-step run), and a ``torch.profiler`` trace of two calls summarised by kernel category — GEMM (cuBLAS / CUTLASS /
inductor templates), attention (flash, cuDNN, efficient), inductor's fused Triton kernels, other elementwise,
communication — with the GPU idle time between kernels and the top kernels by time. The GEMM and attention FLOPs of
one call are counted once with ``torch.utils.flop_counter`` on the eager model, so each category's achieved TFLOP/s
is printed beside its time. Modes are ``+``-joined options:

- ``eager`` | ``compile`` (fastdit's compiled blocks) | ``anchor`` (diffusers
  ``compile_repeated_blocks(fullgraph=True)``, no fastdit; ``anchor+fp8``: after torchao's ``quantize_`` with its FP8
  rowwise config and defaults). An anchor cannot be undone: anchors run last;
- ``cudnn`` / ``flash`` / ``efficient``: every call (compile included) inside ``sdpa_kernel`` of that backend;
- ``fuseqkv``: diffusers' ``fuse_qkv_projections()`` (one GEMM for Q, K and V); ``fuse``: fastdit's ``Fuse()``
  (each stream's Q/K/V and the single blocks' Q/K/V + ``proj_mlp`` as one GEMM per group, quantized as a group);
- ``autotune``: ``Compile(mode="max-autotune-no-cudagraphs")``; ``tma`` (with ``autotune``): inductor's persistent
  TMA matmul templates among the choices; ``cdt``: inductor coordinate-descent tuning;
- ``fp8`` / ``fp8_tensor``: ``fastdit.Quantize(mode=...)``; ``fp8_static``: static FP8, its scales recorded on one
  eager call with the profiled inputs first (``rows``: with one weight scale per output channel,
  ``weight_scales="row"``); ``cudnnfp8``: ``fastdit.Attention(backend="cudnn-fp8")``; ``attnfixed``
  (with ``cudnnfp8``, a speed probe, not a numerics one): Q, K and V cast with one fixed scale instead of their
  absmax, which bounds what calibrated attention scales would save; ``attnstatic`` (with ``fp8_static`` and
  ``cudnnfp8``): the attention's Q/K/V scales recorded per module in the same calibration
  (``Attention(scales=...)``); ``graph``: CUDA graphs of the calls; ``splitout`` (with ``fp8_static``, a speed probe):
  each single block's ``proj_out`` over ``cat([attention, GELU(MLP)])`` computed as two FP8 matmuls, one per part
  of the concatenation (its own per-tensor weight scale each, the layer's activation scale for both), summed — so no
  kernel casts the 15,360-wide concatenation; ``catfp8`` (the same probe, one matmul): the two parts cast apart and
  their FP8 results concatenated for one matmul over the whole weight; ``ndtile``: inductor's
  ``triton.prefer_nd_tiling`` (pointwise kernels tiled over rows and columns, so a concatenation's loads keep their
  alignment).

    python benchmarks/profile_flux.py --modes compile,compile+cudnn --out results/<date>_h200_profile/profile.json
    python benchmarks/profile_flux.py --tiny --modes eager,compile    # CPU smoke test
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from datetime import date
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from cp_flux import FLUX_DEV, TINY, build_pipeline

import fastdit
from fastdit.bench import device_name, json_ready, markdown_table
from fastdit.config import FP8_MAX
from fastdit.io import write_json

OPTIONS = ("eager", "compile", "anchor", "cudnn", "flash", "efficient", "fuseqkv", "fuse", "autotune", "cdt", "fp8",
           "fp8_tensor", "fp8_static", "rows", "cudnnfp8", "attnfixed", "attnstatic", "graph", "tma",
           "splitout", "catfp8", "ndtile")  # fmt: skip
CATEGORIES = (
    ("communication", r"nccl"),
    ("fp8 quantization", r"^triton_.*(amax|_scaled_mm__to_copy|clamp_div)"),
    ("attention prologue", r"^triton_.*(rms_norm|layer_norm).*attention"),
    ("attention", r"flash|fmha|sdpa|attention|attn"),
    ("gemm", r"gemm|nvjet|xmma|cutlass|scaled_mm|triton_tem|Kernel2|_mm_|splitK|matmul"),
    ("triton fused", r"^triton_"),
    ("copy / elementwise", r"elementwise|vectorized|reduce|copy|Memcpy|Memset|CatArray|index|fill"),
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model at 64x64 (CPU smoke test)")
    parser.add_argument("--size", type=int, default=None, help="image side (default 1024; 64 with --tiny)")
    parser.add_argument("--modes", default="eager,compile,compile+cudnn", help="comma-separated modes")
    parser.add_argument("--repeat", type=int, default=10, help="timed calls per mode (median reported)")
    parser.add_argument("--steps", type=int, default=28, help="calls per run for the per-run estimate")
    parser.add_argument("--top", type=int, default=12, help="kernels listed per mode")
    parser.add_argument("--out", type=Path, default=None, help="JSON path, rewritten after every mode")
    args = parser.parse_args()
    for mode in args.modes.split(","):
        unknown = [o for o in mode.split("+") if o not in OPTIONS]
        if unknown:
            parser.error(f"--modes: {mode!r} has unknown options {unknown}; known: {', '.join(OPTIONS)}")
    return args


def call_inputs(tiny: bool, size: int, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One FLUX transformer call's keyword arguments at ``size`` x ``size`` (512 text tokens; 16 when tiny)."""
    config = TINY if tiny else FLUX_DEV
    side = size // 16  # VAE factor 8, then 2 x 2 patches
    tokens = 16 if tiny else 512
    g = torch.Generator().manual_seed(0)
    ids = torch.zeros(side, side, 3)
    ids[..., 1] = torch.arange(side)[:, None]
    ids[..., 2] = torch.arange(side)[None, :]
    return {
        "hidden_states": torch.randn(1, side * side, config["in_channels"], generator=g).to(device, dtype),
        "encoder_hidden_states": torch.randn(1, tokens, config["joint_attention_dim"], generator=g).to(device, dtype),
        "pooled_projections": torch.randn(1, config["pooled_projection_dim"], generator=g).to(device, dtype),
        "timestep": torch.tensor([0.5], device=device, dtype=dtype),
        "img_ids": ids.reshape(-1, 3).to(device),
        "txt_ids": torch.zeros(tokens, 3, device=device),
        "guidance": torch.tensor([3.5], device=device, dtype=torch.float32) if config.get("guidance_embeds") else None,
        "return_dict": False,
    }


def count_flops(transformer: torch.nn.Module, inputs: dict[str, Any]) -> dict[str, float]:
    """GEMM and attention FLOPs of one eager call."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        transformer(**inputs)
    by_op = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    attention = sum(n for op, n in by_op.items() if "attention" in op)
    return {"gemm": float(sum(by_op.values()) - attention), "attention": float(attention)}


def apply_mode(pipe: Any, options: list[str], inputs: dict[str, Any] | None = None) -> Callable[[], None]:
    """Apply a mode's options to ``pipe``; return the undo (``inputs``: the call static FP8 records its scales on)."""
    transformer = pipe.transformer
    undo: list[Callable[[], None]] = []
    if "fuseqkv" in options:
        transformer.fuse_qkv_projections()
        undo.append(transformer.unfuse_qkv_projections)
    if "cdt" in options:
        import torch._inductor.config as inductor_config

        inductor_config.coordinate_descent_tuning = True
        undo.append(lambda: setattr(inductor_config, "coordinate_descent_tuning", False))
    if "tma" in options:
        import torch._inductor.config as inductor_config

        inductor_config.triton.enable_persistent_tma_matmul = True
        undo.append(lambda: setattr(inductor_config.triton, "enable_persistent_tma_matmul", False))
    if "ndtile" in options:
        import torch._inductor.config as inductor_config

        inductor_config.triton.prefer_nd_tiling = True
        undo.append(lambda: setattr(inductor_config.triton, "prefer_nd_tiling", False))
    if "attnfixed" in options:
        from fastdit.parallel.attention import cudnn_fp8

        measured = cudnn_fp8.quantize_per_tensor
        cudnn_fp8.quantize_per_tensor = _fixed_scale_quantize
        undo.append(lambda: setattr(cudnn_fp8, "quantize_per_tensor", measured))
    if "anchor" in options:
        if "fp8" in options:  # as a diffusers user quantizes: torchao's defaults (its inductor settings included)
            from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

            quantize_(transformer, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
        transformer.compile_repeated_blocks(fullgraph=True)
        undo.append(torch._dynamo.reset)
        return lambda: [fn() for fn in reversed(undo)]
    quantize = next((fastdit.Quantize(mode=o) for o in options if o in ("fp8", "fp8_tensor")), None)
    scales = None
    if "fp8_static" in options:
        from fastdit.calibration import calibrate_scales

        scales = calibrate_scales(pipe, _caller(transformer, inputs or {}, None))
        weights = "row" if "rows" in options else "tensor"
        quantize = fastdit.Quantize(mode="fp8_static", scales=scales, weight_scales=weights)
    compile_config = None
    if "compile" in options:
        compile_config = fastdit.Compile(mode="max-autotune-no-cudagraphs" if "autotune" in options else None)
    graphs = fastdit.CudaGraph() if "graph" in options else None
    attention = fastdit.Attention(backend="cudnn-fp8") if "cudnnfp8" in options else None
    if "attnstatic" in options:
        if scales is None or attention is None:
            raise SystemExit("attnstatic needs fp8_static (its calibration records the scales) and cudnnfp8")
        attention = fastdit.Attention(backend="cudnn-fp8", scales=scales)
    kept = _proj_out_weights(transformer) if "splitout" in options or "catfp8" in options else {}
    fuse = fastdit.Fuse() if "fuse" in options else None
    if compile_config or quantize or graphs or attention or fuse:
        fastdit.accelerate(
            pipe, compile=compile_config, quantize=quantize, cuda_graph=graphs, attention=attention, fuse=fuse
        )
        undo.append(lambda: fastdit.disable(pipe))
    if kept:
        if scales is None:
            raise SystemExit("splitout and catfp8 need fp8_static (the activation scale of each proj_out)")
        one = "catfp8" in options
        undo.append(_split_proj_out(transformer, kept, scales.lookup(), quantize.headroom, one))
    if compile_config:
        undo.append(torch._dynamo.reset)
    return lambda: [fn() for fn in reversed(undo)]


def _proj_out_weights(transformer: torch.nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Each single block's ``proj_out`` weight and bias, copied before quantization replaces them."""
    return {
        f"single_transformer_blocks.{i}.proj_out": (block.proj_out.weight.detach().clone(), block.proj_out.bias)
        for i, block in enumerate(transformer.single_transformer_blocks)
    }


def _fp8_per_tensor(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (weight.abs().amax().float() / FP8_MAX).clamp(min=1e-12)
    return _to_fp8(weight, scale), scale


def _split_proj_out(
    transformer: torch.nn.Module, kept: dict, table: dict, headroom: float, one_matmul: bool
) -> Callable[[], None]:
    """Replace each single block's ``proj_out`` forward by two FP8 matmuls over the parts of its concatenated input
    (attention: the first ``inner_dim`` features; the MLP: the rest), or with ``one_matmul`` by one over the parts
    cast apart and concatenated in FP8. Returns the undo."""
    from fastdit.config import static_fp8_scale

    patched = []
    for i, block in enumerate(transformer.single_transformer_blocks):
        name = f"single_transformer_blocks.{i}.proj_out"
        weight, bias = kept[name]
        split = block.attn.inner_dim
        scale = torch.tensor(static_fp8_scale(table[f"transformer.{name}"][0], headroom), device=weight.device)
        if one_matmul:
            block.proj_out.forward = _cast_parts_linear(split, _fp8_per_tensor(weight), scale, bias)
        else:
            parts = [
                (0, split, *_fp8_per_tensor(weight[:, :split])),
                (split, None, *_fp8_per_tensor(weight[:, split:])),
            ]
            block.proj_out.forward = _two_part_linear(parts, scale, bias)
        patched.append(block.proj_out)
    return lambda: [module.__dict__.pop("forward", None) for module in patched]


def _two_part_linear(
    parts: list, scale: torch.Tensor, bias: torch.Tensor | None
) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = None
        for start, end, weight, weight_scale in parts:
            q = _to_fp8(flat[:, start:end], scale)
            first_bias = bias if out is None else None
            y = torch._scaled_mm(
                q,
                weight.t(),
                scale_a=scale,
                scale_b=weight_scale,
                bias=first_bias,
                out_dtype=x.dtype,
                use_fast_accum=True,
            )
            out = y if out is None else out + y
        return out.reshape(*x.shape[:-1], out.shape[-1])

    return forward


def _cast_parts_linear(
    split: int, weight: tuple[torch.Tensor, torch.Tensor], scale: torch.Tensor, bias: torch.Tensor | None
) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        parts = [flat[:, :split], flat[:, split:]]
        q = torch.cat([_to_fp8(part, scale) for part in parts], dim=-1)
        y = torch._scaled_mm(
            q, weight[0].t(), scale_a=scale, scale_b=weight[1], bias=bias, out_dtype=x.dtype, use_fast_accum=True
        )
        return y.reshape(*x.shape[:-1], y.shape[-1])

    return forward


def _fixed_scale_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_per_tensor`` with a fixed descale (8 / 448) in place of the absmax: no reduction over ``x``."""
    descale = torch.full((1, 1, 1, 1), 8.0 / FP8_MAX, dtype=torch.float32, device=x.device)
    return _to_fp8(x, descale), descale


def _to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` in e4m3, saturated at its largest value."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def category(name: str) -> str:
    for label, pattern in CATEGORIES:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return label
    return "other"


def profile_calls(call: Callable[[], Any], calls: int, top: int) -> dict[str, Any]:
    """``calls`` calls under the profiler: kernel time per category, idle time, top kernels (per call)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    per_category: dict[str, float] = defaultdict(float)
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in kernels:
        per_category[category(event.name)] += event.device_time / 1e3 / calls
        per_kernel[event.name][0] += event.device_time / 1e3 / calls
        per_kernel[event.name][1] += 1 / calls
    start = min(e.time_range.start for e in kernels)
    end = max(e.time_range.end for e in kernels)
    busy = sum(e.device_time for e in kernels) / 1e3 / calls
    ranked = sorted(per_kernel.items(), key=lambda item: -item[1][0])[:top]
    return {
        "span_ms": round((end - start) / 1e3 / calls, 2),
        "kernel_ms": round(busy, 2),
        "kernels_per_call": round(len(kernels) / calls),
        "categories_ms": {k: round(v, 2) for k, v in sorted(per_category.items(), key=lambda kv: -kv[1])},
        "top": [
            {"kernel": name[:140], "ms": round(ms, 3), "count": round(n, 1), "category": category(name)}
            for name, (ms, n) in ranked
        ],
    }


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_mode(pipe: Any, mode: str, inputs: dict[str, Any], args: argparse.Namespace, flops, ref) -> dict[str, Any]:
    options = mode.split("+")
    row: dict[str, Any] = {"mode": mode}
    try:
        undo = apply_mode(pipe, options, inputs)
    except Exception as exc:  # a mode that cannot apply is reported; the others still run
        return {**row, "error": f"{type(exc).__name__}: {exc}"}
    try:
        backend = next((o for o in options if o in ("cudnn", "flash", "efficient")), None)
        call = _caller(pipe.transformer, inputs, backend)
        start = time.perf_counter()
        with torch.no_grad():
            out = call()
            out = call()
        _sync()
        row["warmup_s"] = round(time.perf_counter() - start, 1)
        row["compile"] = _compile_report()
        import torch._inductor.config as inductor_config

        row["coordinate_descent_tuning"] = bool(inductor_config.coordinate_descent_tuning)
        times = []
        for _ in range(args.repeat):
            _sync()
            begin = time.perf_counter()
            call()
            _sync()
            times.append((time.perf_counter() - begin) * 1e3)
        row["call_ms"] = round(statistics.median(times), 2)
        row["run_s"] = round(row["call_ms"] * args.steps / 1e3, 3)
        row["rel_err"] = float((out.float() - ref).norm() / ref.norm())
        if not torch.cuda.is_available():
            return row  # CPU smoke test: timing only
        row.update(profile_calls(call, 2, args.top))
        cats = row["categories_ms"]
        row["gemm_tflops"] = round(flops["gemm"] / max(cats.get("gemm", 0), 1e-9) / 1e9, 1)
        row["attention_tflops"] = round(flops["attention"] / max(cats.get("attention", 1e-9), 1e-9) / 1e9, 1)
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        undo()
    return row


def _compile_report() -> dict[str, Any]:
    """Graphs dynamo compiled so far and where the compile time went (seconds per phase, summed)."""
    from torch._dynamo.utils import compile_times, counters

    phases: dict[str, float] = {}
    try:
        _, values = compile_times(repr="csv", aggregate=True)
        names, _ = compile_times(repr="csv", aggregate=True)
        phases = {str(n): round(float(v), 1) for n, v in zip(names, values, strict=False) if float(v) >= 1.0}
    except Exception as exc:  # the helper's format changes between torch versions
        phases = {"unavailable": str(exc)[:80]}
    return {"unique_graphs": counters["stats"]["unique_graphs"], "frames": counters["frames"]["ok"], "phases_s": phases}


def _caller(transformer: torch.nn.Module, inputs: dict[str, Any], backend: str | None) -> Callable[[], torch.Tensor]:
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    kernels = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION}  # fmt: skip

    def call() -> torch.Tensor:
        scope = sdpa_kernel(kernels[backend]) if backend else contextlib.nullcontext()
        with torch.no_grad(), scope:
            return transformer(**inputs)[0]

    return call


def main() -> None:
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    size = args.size or (64 if args.tiny else 1024)
    pipe = build_pipeline(args.tiny, device, torch.bfloat16, seed=0)
    inputs = call_inputs(args.tiny, size, device, torch.bfloat16)
    flops = count_flops(pipe.transformer, inputs)
    with torch.no_grad():
        ref = pipe.transformer(**inputs)[0].float()
    print(f"GEMM {flops['gemm'] / 1e12:.2f} TFLOP, attention {flops['attention'] / 1e12:.2f} TFLOP per call")
    rows: list[dict[str, Any]] = []
    for mode in args.modes.split(","):
        start = time.perf_counter()
        rows.append(run_mode(pipe, mode, inputs, args, flops, ref))
        print(f"[{time.perf_counter() - start:6.1f}s] {mode}: {_short(rows[-1])}", flush=True)
        if args.out:
            write_json(args.out, json_ready(_payload(rows, args, size, flops)))
    report(rows)


def _short(row: dict[str, Any]) -> str:
    if "error" in row:
        return row["error"][:300]
    return f"{row['call_ms']} ms/call, {row['run_s']} s/run, categories {row.get('categories_ms')}"


def _payload(rows, args, size, flops) -> dict[str, Any]:
    return {
        "benchmark": "profile_flux",
        "date": date.today().isoformat(),
        "device": device_name(torch.device("cuda" if torch.cuda.is_available() else "cpu")),
        "torch": torch.__version__,
        "config": {"tiny": args.tiny, "size": size, "steps": args.steps, "repeat": args.repeat},
        "flops_per_call": flops,
        "results": rows,
    }


def report(rows: list[dict[str, Any]]) -> None:
    header = ["mode", "warm-up s", "ms/call", "s/run", "GEMM ms", "GEMM TFLOP/s", "attn ms", "attn TFLOP/s",
              "quant ms", "triton ms", "other ms", "idle ms", "rel err"]  # fmt: skip
    table = []
    for r in rows:
        if "error" in r:
            table.append([r["mode"], r["error"][:80], *[""] * (len(header) - 2)])
            continue
        c = r.get("categories_ms", {})
        if not c:
            table.append([r["mode"], r["warmup_s"], r["call_ms"], r["run_s"], *[""] * 8, f"{r['rel_err']:.1e}"])
            continue
        other = sum(v for k, v in c.items() if k not in ("gemm", "attention", "triton fused", "fp8 quantization"))
        table.append([r["mode"], r["warmup_s"], r["call_ms"], r["run_s"], c.get("gemm", 0), r["gemm_tflops"],
                      c.get("attention", 0), r["attention_tflops"], c.get("fp8 quantization", 0),
                      c.get("triton fused", 0), round(other, 2),
                      round(r["call_ms"] - r["kernel_ms"], 2), f"{r['rel_err']:.1e}"])  # fmt: skip
    print(markdown_table(header, table))
    for r in rows:
        for k in r.get("top", []):
            print(f"  {r['mode']:<24} {k['ms']:8.3f} ms x{k['count']:<5} {k['category']:<18} {k['kernel'][:90]}")


if __name__ == "__main__":
    main()
