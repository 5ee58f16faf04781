"""Quantization on one GPU: a FLUX.1-dev-sized transformer in bf16 vs FP8 and int8 (fastdit.Quantize) vs the
diffusers + torchao anchor, in one process, with time per call and step, memory and quality against bf16.

The model, its random weights (residual outputs scaled so 57 blocks stay finite), the prompt embeddings and the
decode are those of ``cp_flux.py`` (imported from it). A mode is a precision with options joined by ``+``:

- precision: ``bf16`` (no quantization: the model's dtype, bfloat16 on the GPU, float32 on the CPU) or a
  :class:`fastdit.Quantize` mode (``fp8`` rowwise, ``fp8_tensor``, ``fp8_static``, ``fp8_weight``, ``int8_weight``,
  ``int8``); ``fp8_static``'s scales are recorded once, on a call with another seed than the measured one (so its
  quality is a held-out figure), with the mode's layer choice;
- options: ``compile`` (inductor blocks), ``graph`` (CUDA graphs of the calls), ``all`` (quantize every Linear,
  embedders and final projection included, as the anchor does), ``noada`` (keep the AdaLN modulation linears in
  bf16), ``fp8attn`` (torchao's FP8 attention, FA3 on Hopper, around the transformer's SDPA calls; reported as
  unavailable when its kernels are not installed), ``cudnnfp8`` (fastdit's ``Attention(backend="cudnn-fp8")``:
  cuDNN's fused FP8 attention, ``nvidia-cudnn-frontend``);
- ``anchor``: diffusers + torchao ``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())`` on the whole
  transformer and ``compile_repeated_blocks(fullgraph=True)``. It cannot be undone, so it runs last.

The first mode is the baseline of every quality figure (latent PSNR over the baseline's range, image PSNR / SSIM of
the decoded images). Each mode's compile and warm-up get ``--mode-timeout`` seconds; a mode that fails or runs out
of time is reported with its error and the others still run. JSON is rewritten (atomically) after every mode.

    python benchmarks/quant_flux.py --out benchmarks/results/<date>_h200_quant/quant_flux.json   # every mode
    bash benchmarks/run_h200_quant.sh      # the same modes in parts of a few minutes each, the reference, GPU tests
    python benchmarks/quant_flux.py --reference --out .../quant_reference.json   # trained model: image quality
    python benchmarks/quant_flux.py --tiny --modes bf16,int8_weight,fp8_weight,int8   # CPU smoke test, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from datetime import date
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import torch
from cp_flux import build_pipeline, embeddings, generate, model_memory, peak_memory

import fastdit
from fastdit.bench import compare_outputs, device_name, json_ready, markdown_table, time_calls
from fastdit.config import QUANTIZE_MODES
from fastdit.io import write_json
from fastdit.metrics import psnr

PRECISIONS = ("bf16", *QUANTIZE_MODES)
OPTIONS = ("compile", "graph", "all", "noada", "fp8attn", "cudnnfp8")
ANCHOR = "anchor"
DEFAULT_MODES = (
    "bf16+compile,fp8+compile,fp8_tensor+compile,fp8_static+compile,fp8+compile+graph,fp8_static+compile+graph,"
    "fp8+compile+noada,fp8+compile+all,fp8_weight+compile,int8_weight+compile,int8_weight,fp8+compile+fp8attn,anchor"
)
REFERENCE_MODES = "bf16,fp8,fp8_tensor,fp8_static,fp8+noada,fp8_weight,int8_weight,int8,anchor"
# AdaLN modulation linears of FLUX's double (norm1, norm1_context) and single (norm) blocks.
ADALN = ("*.norm1.linear", "*.norm1_context.linear", "*.norm.linear")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model, 64x64, 4 steps (CPU smoke test)")
    parser.add_argument("--reference", action="store_true", help="the trained reference pipeline (digits, 32x32)")
    parser.add_argument("--digits", type=int, default=10, help="with --reference: prompts for digits 0..N-1")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default 28; 4 with --tiny)")
    parser.add_argument("--size", type=int, default=None, help="image side (default 1024; 64 with --tiny)")
    parser.add_argument("--modes", default=None, help=f"comma-separated (default {DEFAULT_MODES})")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls per mode (compile, graph capture)")
    parser.add_argument("--repeat", type=int, default=3, help="timed calls per mode (median reported)")
    parser.add_argument("--mode-timeout", type=float, default=900.0, help="seconds one mode may take in all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--out", type=Path, default=None, help="JSON path, rewritten after every mode")
    args = parser.parse_args()
    args.modes = args.modes or (REFERENCE_MODES if args.reference else DEFAULT_MODES)
    modes = args.modes.split(",")
    bad = [m for m in modes if m != ANCHOR and not _valid(m)]
    if bad:
        parser.error(f"--modes: unknown {bad}; precisions {PRECISIONS}, options {OPTIONS}, or {ANCHOR!r}")
    if ANCHOR in modes and modes[-1] != ANCHOR:
        parser.error("--modes: the anchor cannot be undone in-process; list it last")
    return args


def _valid(mode: str) -> bool:
    precision, *options = mode.split("+")
    return precision in PRECISIONS and all(o in OPTIONS for o in options)


def log(start: float, text: str) -> None:
    print(f"[{time.perf_counter() - start:7.1f}s] {text}", flush=True)


class ModeTimeoutError(Exception):
    """A mode ran past ``--mode-timeout`` (compile included)."""


@contextlib.contextmanager
def time_box(seconds: float) -> Iterator[None]:
    """Raise :class:`ModeTimeoutError` in the main thread after ``seconds`` (compile is Python: the signal gets in)."""
    if not hasattr(signal, "SIGALRM"):
        yield
        return

    def expire(_signum: int, _frame: Any) -> None:
        raise ModeTimeoutError(f"ran past --mode-timeout {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# --- modes ---


# Static FP8 scales by layer choice, recorded on first use (``record_scales`` sets the recorder).
_SCALES: dict[tuple[tuple[str, ...], tuple[str, ...]], Any] = {}
_RECORDER: dict[str, Callable[[tuple[str, ...], tuple[str, ...]], Any]] = {}


def quantize_for(precision: str, options: list[str]) -> fastdit.Quantize | None:
    if precision == "bf16":
        return None
    include = ("*",) if "all" in options else ()
    exclude = ADALN if "noada" in options else ()
    if precision != "fp8_static":
        return fastdit.Quantize(mode=precision, include=include, exclude=exclude)
    if (include, exclude) not in _SCALES:
        _SCALES[include, exclude] = _RECORDER["record"](include, exclude)
    return fastdit.Quantize(mode=precision, include=include, exclude=exclude, scales=_SCALES[include, exclude])


Wrap = Callable[[Callable[[], Any]], Callable[[], Any]]


def _same(call: Callable[[], Any]) -> Callable[[], Any]:
    return call


def fp8_attention(pipe: Any) -> tuple[Wrap, Callable[[], None]]:
    """torchao's FP8 attention for the transformer's SDPA calls: a wrapper of the call and its undo.

    Raises:
        RuntimeError: saying why it is unavailable (no CUDA, not Hopper, FA3's ``flash_attn_interface`` missing).
    """
    try:
        import torch._inductor.config as inductor_config
        import torch.nn.functional as F
        from torch.nn.attention import activate_flash_attention_impl, restore_flash_attention_impl
        from torchao.prototype.attention import apply_low_precision_attention
    except ImportError as error:
        raise RuntimeError(f"FP8 attention unavailable: {error}") from error
    previous_pass = inductor_config.pre_grad_custom_pass
    wrapper = apply_low_precision_attention(pipe.transformer)  # also installs a global inductor pass
    patched, impl = wrapper._sdpa_patch_fn, wrapper._flash_impl_name

    def wrap(call: Callable[[], Any]) -> Callable[[], Any]:
        # What torchao's wrapper does around the module's forward, around the whole call instead: fastdit's
        # components stay the pipeline's own modules.
        def run() -> Any:
            activate_flash_attention_impl(impl)
            original, F.scaled_dot_product_attention = F.scaled_dot_product_attention, patched
            try:
                return call()
            finally:
                F.scaled_dot_product_attention = original
                restore_flash_attention_impl()

        return run

    def undo() -> None:
        inductor_config.pre_grad_custom_pass = previous_pass  # later modes compile without it

    return wrap, undo


def apply_mode(pipe: Any, mode: str) -> tuple[Callable[[], None], Wrap]:
    """Apply ``mode``; return its undo and a wrapper of the call (identity unless FP8 attention)."""
    if mode == ANCHOR:
        apply_anchor(pipe)
        return (lambda: None), _same
    precision, *options = mode.split("+")
    wrap, attention_undo = fp8_attention(pipe) if "fp8attn" in options else (_same, lambda: None)
    quantize = quantize_for(precision, options)
    compile_config = fastdit.Compile() if "compile" in options else None
    graphs = fastdit.CudaGraph() if "graph" in options else None
    attention = fastdit.Attention(backend="cudnn-fp8") if "cudnnfp8" in options else None
    if quantize is None and compile_config is None and graphs is None and attention is None:
        return attention_undo, wrap
    try:
        fastdit.accelerate(pipe, quantize=quantize, compile=compile_config, cuda_graph=graphs, attention=attention)
    except BaseException:
        attention_undo()
        raise

    def undo() -> None:
        try:
            fastdit.disable(pipe)
        finally:
            attention_undo()
            torch._dynamo.reset()  # the next mode compiles afresh

    return undo, wrap


def apply_anchor(pipe: Any) -> None:
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    quantize_(pipe.transformer, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
    pipe.transformer.compile_repeated_blocks(fullgraph=True)


def library(mode: str) -> str:
    if mode != ANCHOR:
        return "fastdit"
    from importlib.metadata import version

    return f"diffusers {version('diffusers')} + torchao {version('torchao')}"


# --- one mode ---


def run_mode(pipe: Any, mode: str, call: Callable[[], Any], args: argparse.Namespace, device, start) -> dict:
    """Apply, warm up (compile), time and undo one mode; its row (``error`` set when it failed)."""
    row: dict[str, Any] = {"mode": mode, "library": library(mode)}
    undo: Callable[[], None] = lambda: None  # noqa: E731
    try:
        with time_box(args.mode_timeout):
            log(start, f"{mode}: applying")
            undo, wrap = apply_mode(pipe, mode)
            row.update(model_memory(device))
            row["quantized"] = quantized_report(pipe)
            run = wrap(call)
            warm = time.perf_counter()
            log(start, f"{mode}: {args.warmup} warm-up call(s) (compile, graphs)")
            outputs, times = time_calls(run, device, warmup=args.warmup, repeat=args.repeat)
            row["warmup_s"] = round(time.perf_counter() - warm - sum(times), 2)
        row["seconds"] = round(statistics.median(times), 4)
        row["outputs"] = outputs
        row.update(peak_memory(device))
        log(start, f"{mode}: {row['seconds']:.3f} s per call")
    except Exception as error:
        row["error"] = f"{type(error).__name__}: {error}"[:500]
        log(start, f"{mode}: FAILED {row['error']}")
    finally:
        try:
            undo()
        except Exception as error:
            row["undo_error"] = f"{type(error).__name__}: {error}"[:300]
        torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def quantized_report(pipe: Any) -> dict[str, Any] | None:
    try:
        info = fastdit.summary(pipe).transformers["transformer"].get("quantize")
    except ValueError:  # not accelerated by fastdit (bf16 eager, the anchor)
        return None
    if info is None:
        return None
    return {k: info[k] for k in ("num_quantized", "num_skipped", "bytes_before", "bytes_after")}


def score(row: dict[str, Any], baseline: dict[str, Any], steps: int) -> dict[str, Any]:
    """Speed and quality of ``row`` against the baseline row (outputs dropped)."""
    images, latents = row.pop("outputs")
    base_images, base_latents = baseline["base_outputs"]
    quality = compare_outputs(list(base_images), list(images))
    latent_range = float(base_latents.max() - base_latents.min())
    row.update(
        step_ms=round(1000 * row["seconds"] / steps, 2),
        speedup=round(baseline["seconds"] / row["seconds"], 3),
        psnr=quality.psnr,
        ssim=quality.ssim,
        latent_psnr=psnr(list(base_latents), list(latents), data_range=latent_range),
        latent_max_abs_err=float(np.abs(base_latents - latents).max()),
    )
    return row


# --- the run ---


def build(args: argparse.Namespace, device: torch.device) -> tuple[Any, dict[str, Any], int, int]:
    """The pipeline, its call arguments, steps and image side."""
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    if args.reference:
        from fastdit.reference import REFERENCE_DEFAULTS, digit_prompt, load_reference_pipeline

        if device.type == "cpu":
            torch.set_num_threads(1)  # its kernels are tiny: more threads only synchronise (see the CLI's --threads)
        pipe = load_reference_pipeline(device, dtype)
        kwargs = {**REFERENCE_DEFAULTS, "prompt": [digit_prompt(d) for d in range(args.digits)]}
        if args.steps:
            kwargs["num_inference_steps"] = args.steps
        return pipe, kwargs, kwargs["num_inference_steps"], kwargs["height"]
    steps = args.steps or (4 if args.tiny else 28)
    size = args.size or (64 if args.tiny else 1024)
    pipe = build_pipeline(args.tiny, device, dtype, args.seed)
    kwargs = {**embeddings(args.tiny, device, dtype, args.seed), "height": size, "width": size,
              "num_inference_steps": steps, "guidance_scale": 3.5}  # fmt: skip
    return pipe, kwargs, steps, size


def main() -> None:
    args = parse_args()
    start = time.perf_counter()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    log(start, f"building the {'reference' if args.reference else 'tiny' if args.tiny else 'FLUX.1-dev-sized'} "
        f"pipeline on {device}")  # fmt: skip
    pipe, kwargs, steps, size = build(args, device)
    call = lambda: generate(pipe, kwargs, args.seed, device)  # noqa: E731

    def record(include: tuple[str, ...], exclude: tuple[str, ...]) -> Any:
        from fastdit.calibration import calibrate_scales

        log(start, "fp8_static: recording the activation scales on a call with seed + 1")
        return calibrate_scales(
            pipe, lambda: generate(pipe, kwargs, args.seed + 1, device), include=include, exclude=exclude
        )

    _RECORDER["record"] = record
    rows: list[dict[str, Any]] = []
    baseline: dict[str, Any] | None = None
    for mode in args.modes.split(","):
        row = run_mode(pipe, mode, call, args, device, start)
        if "error" not in row:
            if baseline is None:
                baseline = {"seconds": row["seconds"], "base_outputs": row["outputs"]}
            row = score(row, baseline, steps)
        rows.append(row)
        write(rows, args, device, steps, size)
    report(rows, args, device, steps, size)


def payload(rows: list[dict[str, Any]], args: argparse.Namespace, device, steps: int, size: int) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for package in ("torch", "torchao", "diffusers", "transformers"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = None
    return {
        "benchmark": "quant_flux",
        "date": date.today().isoformat(),
        "device": device_name(device),
        "versions": versions,
        "model": "reference" if args.reference else "tiny" if args.tiny else "flux1-dev-sized random",
        "config": {
            "steps": steps,
            "size": size,
            "warmup": args.warmup,
            "repeat": args.repeat,
            "mode_timeout_s": args.mode_timeout,
            "baseline": rows[0]["mode"] if rows else None,
        },
        "results": rows,
    }


def write(rows: list[dict[str, Any]], args: argparse.Namespace, device, steps: int, size: int) -> None:
    if args.out is not None:
        write_json(args.out, json_ready(payload(rows, args, device, steps, size)))


def _cell(row: dict[str, Any], key: str, spec: str) -> str:
    value = row.get(key)
    return "-" if value is None else format(value, spec)


def report(rows: list[dict[str, Any]], args: argparse.Namespace, device, steps: int, size: int) -> None:
    print(f"\n{payload(rows, args, device, steps, size)['model']} FLUX transformer, {size}x{size}, {steps} steps, "
          f"{device_name(device)}; quality against {rows[0]['mode'] if rows else '-'}\n")  # fmt: skip
    header = ("mode", "library", "s/call", "ms/step", "speed-up", "latent PSNR", "PSNR", "SSIM", "layers",
              "weights MiB", "model GiB", "peak GiB")  # fmt: skip
    cells = []
    for r in rows:
        if "error" in r:
            cells.append((r["mode"], r["library"], f"failed: {r['error'][:80]}", *("-",) * 9))
            continue
        q = r.get("quantized")
        layers = "-" if q is None else f"{q['num_quantized']}/{q['num_quantized'] + q['num_skipped']}"
        weights = "-" if q is None else f"{q['bytes_before'] / 2**20:.0f} -> {q['bytes_after'] / 2**20:.0f}"
        cells.append((r["mode"], r["library"], _cell(r, "seconds", ".3f"), _cell(r, "step_ms", ".1f"),
                      _cell(r, "speedup", ".2f"), _cell(r, "latent_psnr", ".2f"), _cell(r, "psnr", ".2f"),
                      _cell(r, "ssim", ".4f"), layers, weights, _cell(r, "model_gib", ".2f"),
                      _cell(r, "peak_gib", ".2f")))  # fmt: skip
    print(markdown_table(header, cells), end="")
    if args.out is not None:
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
