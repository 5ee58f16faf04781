"""Probe: static (calibrated) FP8 activation scales against dynamic ones on one GPU, before building the mode.

The FLUX.1-dev-sized pipeline of ``cp_flux.py`` runs once in bf16 while forward pre-hooks record the absolute maximum
of every block Linear's input over all 28 steps; each layer is then quantized with torchao's
``Float8StaticActivationFloat8WeightConfig`` (per-tensor scales, the activation scale fixed at amax / 448) and the
blocks compiled with CUDA graphs, against fastdit's dynamic per-row FP8 in the same process. Latent PSNR is over
the bf16 run's range.

    python benchmarks/probe_fp8_static.py --out benchmarks/results/<date>_h200_single/probe_fp8_static.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from cp_flux import build_pipeline, embeddings, generate

import fastdit
from fastdit.bench import compare_outputs, device_name, json_ready, time_calls
from fastdit.io import write_json
from fastdit.metrics import psnr

BLOCK_LISTS = ("transformer_blocks.", "single_transformer_blocks.")
FP8_MAX = 448.0


def block_linears(transformer: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    return {
        name: module
        for name, module in transformer.named_modules()
        if isinstance(module, torch.nn.Linear) and name.startswith(BLOCK_LISTS)
    }


def calibrate(pipe: Any, run: Callable[[], Any]) -> tuple[Any, dict[str, tuple[float, int]]]:
    """One bf16 call with the absolute maximum (and rank) of every block Linear's input recorded."""
    seen: dict[str, tuple[torch.Tensor, int]] = {}
    handles = []
    for name, module in block_linears(pipe.transformer).items():

        def hook(_module: Any, args: tuple[Any, ...], name: str = name) -> None:
            x = args[0]
            amax = x.detach().abs().amax().float()
            old = seen.get(name)
            seen[name] = (amax if old is None else torch.maximum(old[0], amax), x.dim())

        handles.append(module.register_forward_pre_hook(hook))
    try:
        result = run()
    finally:
        for handle in handles:
            handle.remove()
    return result, {name: (float(amax), ndim) for name, (amax, ndim) in seen.items()}


def quantize_static(pipe: Any, scales: dict[str, tuple[float, int]], margin: float) -> Callable[[], None]:
    from torchao.quantization import Float8StaticActivationFloat8WeightConfig, PerTensor, quantize_

    kept: dict[str, tuple[torch.nn.Linear, torch.nn.Parameter]] = {}
    for name, module in block_linears(pipe.transformer).items():
        amax, ndim = scales[name]
        scale = torch.tensor(max(amax * margin, 1e-6) / FP8_MAX, device=module.weight.device).reshape((1,) * ndim)
        kept[name] = (module, module.weight)
        config = Float8StaticActivationFloat8WeightConfig(
            act_quant_scale=scale, granularity=PerTensor(), set_inductor_config=False
        )
        quantize_(module, config)

    def undo() -> None:
        for module, weight in kept.values():
            module.__dict__.pop("extra_repr", None)
            module._parameters["weight"] = weight

    return undo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--margins", default="1.0", help="comma-separated: amax multipliers of the static scale")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    pipe = build_pipeline(args.tiny, device, dtype, 0)
    kwargs = {**embeddings(args.tiny, device, dtype, 0), "height": args.size, "width": args.size}
    kwargs |= {"num_inference_steps": args.steps, "guidance_scale": 3.5}

    def run() -> Any:
        return generate(pipe, kwargs, 0, device)

    (images0, latents0), scales = calibrate(pipe, run)
    rows: list[dict[str, Any]] = []
    amaxes = sorted(a for a, _ in scales.values())
    print(f"{len(scales)} layers, input amax min {amaxes[0]:.3g} median {statistics.median(amaxes):.3g} "
          f"max {amaxes[-1]:.3g}", flush=True)  # fmt: skip
    modes = [("dynamic-rowwise", None), *[(f"static-x{m}", float(m)) for m in args.margins.split(",")]]
    gpu = device.type == "cuda"
    if not gpu:  # CPU smoke test: torchao's dynamic FP8, cuDNN, inductor and CUDA graphs need the GPU
        modes = modes[1:]
    for attention in (None, "cudnn-fp8") if gpu else (None,):
        for label, margin in modes:
            undo_static = quantize_static(pipe, scales, margin) if margin is not None else (lambda: None)
            quantize = fastdit.Quantize(mode="fp8") if margin is None else None
            attn = fastdit.Attention(backend=attention) if attention else None
            compiled = {"compile": fastdit.Compile(outer=True), "cuda_graph": fastdit.CudaGraph()} if gpu else {}
            fastdit.accelerate(pipe, quantize=quantize, attention=attn, **compiled)
            try:
                (images, latents), times = time_calls(run, device, warmup=1, repeat=args.repeat)
            finally:
                fastdit.disable(pipe)
                undo_static()
                torch._dynamo.reset()
            quality = compare_outputs(list(images0), list(images))
            row = {"mode": label, "attention": attention or "default", "seconds": statistics.median(times)}
            row |= {"latent_psnr": psnr(latents, latents0, data_range=float(latents0.max() - latents0.min()))}
            row |= {"psnr": quality.psnr, "ssim": quality.ssim}
            rows.append(row)
            print(row, flush=True)
            if args.out is not None:
                write_json(args.out, json_ready({"device": device_name(device), "rows": rows}))


if __name__ == "__main__":
    main()
