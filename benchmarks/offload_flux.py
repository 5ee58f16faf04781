"""Block offload on a FLUX.1-dev-sized transformer: time and peak GPU memory vs the resident model, with and without a
step cache.

The pipeline is ``cp_flux.py``'s (random bf16 FLUX.1-dev-shaped transformer and VAE, prompt embeddings given). Each
mode runs the same seed; quality is PSNR of the latents against the resident run of the same cache (offload moves
weights, it must not change a value: ``inf``). The cache is F1B0 on a fixed schedule computing every other step
(random weights never hit a residual threshold). Peak memory is CUDA max allocated over the timed calls.

    python benchmarks/offload_flux.py --out benchmarks/results/<date>_h200_offload/offload_flux.json
    python benchmarks/offload_flux.py --tiny        # CPU smoke test, seconds

Modes are ``[cache+][compile+]resident|offloadN`` (``offloadN``: N blocks kept resident).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import cp_flux
import torch

import fastdit
from fastdit.bench import device_name, json_ready, markdown_table
from fastdit.io import write_json
from fastdit.metrics import psnr
from fastdit.process import choose_device

DEFAULT_MODES = (
    "resident",
    "offload0",
    "offload29",
    "cache+resident",
    "cache+offload1",
    "cache+offload29",
    "cache+compile+resident",
    "cache+compile+offload1",
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model, 64x64, 4 steps (CPU smoke test)")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default 28; 4 with --tiny)")
    parser.add_argument("--size", type=int, default=None, help="height and width (default 1024; 64 with --tiny)")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES), help="comma-separated modes")
    parser.add_argument("--prefetch", type=int, default=2, help="streamed blocks copied ahead")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default $OUT/offload_flux.json if set)")
    args = parser.parse_args()
    args.steps = args.steps or (4 if args.tiny else 28)
    args.size = args.size or (64 if args.tiny else 1024)
    if args.out is None and os.environ.get("OUT"):
        args.out = Path(os.environ["OUT"]) / "offload_flux.json"
    return args


def options_for(mode: str, steps: int, prefetch: int, tiny: bool) -> dict[str, Any]:
    """``fastdit.accelerate`` options of ``mode``."""
    *flags, placement = mode.split("+")
    options: dict[str, Any] = {}
    if "cache" in flags:
        options["cache"] = cp_flux.cache_for(["cache"], steps)
    if "compile" in flags:
        options["compile"] = fastdit.Compile(backend="eager") if tiny else fastdit.Compile()
    if placement.startswith("offload"):
        options["offload"] = fastdit.Offload(resident_blocks=int(placement.removeprefix("offload")), prefetch=prefetch)
    elif placement != "resident":
        raise SystemExit(f"--modes: {mode!r}: expected [cache+][compile+]resident|offloadN")
    return options


def run_mode(pipe: Any, mode: str, kwargs: dict[str, Any], args: argparse.Namespace, device: torch.device) -> dict:
    options = options_for(mode, args.steps, args.prefetch, args.tiny)
    if options:
        fastdit.accelerate(pipe, **options)
    try:
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
        (_, latents), seconds = cp_flux.timed(lambda: cp_flux.generate(pipe, kwargs, args.seed, device), args, device)
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        info = fastdit.summary(pipe).transformers["transformer"] if options else {}
    finally:
        if options:
            fastdit.disable(pipe)
    return {"mode": mode, "seconds": seconds, "peak_gib": peak, "latents": latents, "offload": info.get("offload")}


def main() -> None:
    args = parse_args()
    device = choose_device()
    dtype = torch.float32 if args.tiny else torch.bfloat16
    pipe = cp_flux.build_pipeline(args.tiny, device, dtype, args.seed)
    kwargs = {**cp_flux.embeddings(args.tiny, device, dtype, args.seed), "height": args.size, "width": args.size}
    kwargs.update(num_inference_steps=args.steps, guidance_scale=3.5)
    rows, baselines = [], {}
    for mode in args.modes.split(","):
        print(f"mode {mode} ...", flush=True)
        row = run_mode(pipe, mode, kwargs, args, device)
        key = "+".join(f for f in mode.split("+")[:-1] if f != "compile")
        baseline = baselines.setdefault(key, row)
        base = baseline["latents"]
        span = float(base.max() - base.min())
        row["latent_psnr"] = psnr(base[0], row["latents"][0], data_range=span)
        row["vs_resident"] = row["seconds"] / baseline["seconds"]
        rows.append(row)
    report(rows, args, device)


def report(rows: list[dict[str, Any]], args: argparse.Namespace, device: torch.device) -> None:
    header = ("mode", "seconds", "vs resident", "peak GiB", "latent PSNR", "transfers", "on demand", "GiB moved")
    table = []
    for row in rows:
        stats = row["offload"] or {}
        moved = stats.get("transferred_bytes", 0) / 2**30
        peak = "-" if row["peak_gib"] is None else f"{row['peak_gib']:.2f}"
        table.append((row["mode"], f"{row['seconds']:.3f}", f"{row['vs_resident']:.2f}x", peak,
                      f"{row['latent_psnr']:.1f}", str(stats.get("transfers", "-")), str(stats.get("on_demand", "-")),
                      f"{moved:.1f}"))  # fmt: skip
    print(markdown_table(header, table))
    if args.out is not None:
        data = {
            "benchmark": "offload_flux",
            "device": device_name(device),
            "torch": torch.__version__,
            "steps": args.steps,
            "size": args.size,
            "prefetch": args.prefetch,
            "rows": [{k: v for k, v in row.items() if k != "latents"} for row in rows],
        }
        write_json(args.out, json_ready(data))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
