"""Cache configurations on the trained reference pipeline: blocks computed, wall time, PSNR and SSIM vs no cache.

Runs fastdit's configurations and, when installed beside it, cache-dit's DBCache (+ TaylorSeer) and diffusers'
FirstBlockCache / TaylorSeerCache on the same pipeline, prompts and seeds, then prints a markdown table and writes
JSON. Blocks are counted the same way for every library: a forward pre-hook on each block's first sub-module fires
only when the block really computes. Each configuration's wall time is paired with an uncached run timed just
before it, so the wall speed-up compares runs made under the same machine load.

Run each library in its own process (cache-dit and diffusers leave hooks that do not always come off cleanly); the
rows merge into one JSON file:

    for lib in fastdit cache-dit diffusers; do
        PYTHONPATH=<dir with cache_dit> python benchmarks/cache_reference.py --threads 1 --libraries $lib \
            --out benchmarks/results/cache_reference_cpu.json
    done
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import numpy as np
import torch

import fastdit
from fastdit.metrics import psnr, ssim
from fastdit.reference import REFERENCE_DEFAULTS, digit_prompt, load_reference_pipeline


@dataclass
class Result:
    name: str
    library: str
    seconds: float
    baseline_seconds: float  # the uncached run timed just before this configuration (paired against load drift)
    blocks_fraction: float
    psnr_mean: float
    psnr_min: float
    ssim_mean: float
    ssim_min: float


class BlockCounter:
    """Counts blocks that actually compute (a pre-hook on each block's first child module)."""

    def __init__(self, transformer: torch.nn.Module) -> None:
        self.count = 0
        self.handles = []
        for name in ("transformer_blocks", "single_transformer_blocks"):
            for block in getattr(transformer, name):
                first = next(block.children())
                self.handles.append(first.register_forward_pre_hook(self._hit))

    def _hit(self, *_: object) -> None:
        self.count += 1


def generate(
    pipe, cases: list[tuple[int, int]], steps: int, true_cfg: float, batch: int
) -> tuple[list[np.ndarray], float]:
    """Generate every (digit, seed) case, ``batch`` at a time (per-sample seeded generators); images and seconds."""
    images: list[np.ndarray] = []
    extra = {"negative_prompt": "", "true_cfg_scale": true_cfg} if true_cfg > 1 else {}
    start = time.perf_counter()
    for i in range(0, len(cases), batch):
        chunk = cases[i : i + batch]
        out = pipe(
            prompt=[digit_prompt(d) for d, _ in chunk],
            num_inference_steps=steps,
            height=REFERENCE_DEFAULTS["height"],
            width=REFERENCE_DEFAULTS["width"],
            max_sequence_length=REFERENCE_DEFAULTS["max_sequence_length"],
            generator=[torch.Generator().manual_seed(s) for _, s in chunk],
            output_type="np",
            **extra,
        ).images
        images.extend(out)
    return images, time.perf_counter() - start


def measure(name, library, pipe, counter, cases, steps, true_cfg, batch, baseline, base_blocks, paired) -> Result:
    print(f"running {library}: {name}", flush=True)
    counter.count = 0
    images, seconds = generate(pipe, cases, steps, true_cfg, batch)
    p = [psnr(a, b) for a, b in zip(images, baseline, strict=True)]
    s = [ssim(a, b) for a, b in zip(images, baseline, strict=True)]
    finite = [v for v in p if np.isfinite(v)] or [float("inf")]
    return Result(
        name=name,
        library=library,
        seconds=round(seconds, 3),
        baseline_seconds=round(paired, 3),
        blocks_fraction=round(counter.count / base_blocks, 4),
        psnr_mean=round(statistics.fmean(finite), 2) if len(finite) == len(p) else float("inf"),
        psnr_min=round(min(p), 2),
        ssim_mean=round(statistics.fmean(s), 4),
        ssim_min=round(min(s), 4),
    )


def fastdit_configs(steps: int) -> dict[str, fastdit.DBCache]:
    ts1, ts2 = fastdit.TaylorSeer(order=1), fastdit.TaylorSeer(order=2)
    configs = {}
    for fn, bn in ((1, 0), (4, 0), (8, 0), (1, 1)):
        for threshold in (0.12, 0.2, 0.3):
            configs[f"F{fn}B{bn} τ{threshold} w2"] = dict(fn=fn, bn=bn, threshold=threshold, warmup_steps=2)
    for threshold in (0.2, 0.3, 0.5):
        configs[f"F1B0 τ{threshold} w2 +TS1"] = dict(fn=1, bn=0, threshold=threshold, warmup_steps=2, taylorseer=ts1)
        configs[f"F1B0 τ{threshold} w2 +TS2"] = dict(fn=1, bn=0, threshold=threshold, warmup_steps=2, taylorseer=ts2)
    for order in (1, 2):
        forecast = fastdit.TaylorSeer(order=order, forecast_decision=True)
        for threshold in (0.05, 0.1, 0.2):
            configs[f"F1B0 τ{threshold} w2 +TS{order} forecast"] = dict(
                fn=1, bn=0, threshold=threshold, warmup_steps=2, taylorseer=forecast
            )
    for preset in ("medium", "fast"):
        mask = fastdit.StepMask.preset(preset, steps)
        configs[f"F1B0 mask:{preset} +TS1"] = dict(fn=1, bn=0, warmup_steps=0, step_mask=mask, taylorseer=ts1)
    return configs


# A configuration to measure: (name, library, install, remove).
Config = tuple[str, str, Callable[[], None], Callable[[], None]]


def fastdit_runs(pipe, steps: int, num_blocks: int) -> list[Config]:
    runs = []
    for name, kwargs in fastdit_configs(steps).items():
        if kwargs["fn"] + kwargs.get("bn", 0) >= num_blocks:
            continue  # leaves no middle block on this model
        config = fastdit.DBCache(**kwargs)
        runs.append(
            (name, "fastdit", lambda c=config: fastdit.accelerate(pipe, cache=c), lambda: fastdit.disable(pipe))
        )
    return runs


def cache_dit_runs(pipe) -> list[Config]:
    import cache_dit
    from cache_dit import DBCacheConfig, TaylorSeerCalibratorConfig

    runs = []
    for threshold, order in ((0.12, None), (0.2, None), (0.3, None), (0.3, 1), (0.5, 1)):
        config = DBCacheConfig(
            Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=threshold, max_warmup_steps=2
        )
        calibrator = TaylorSeerCalibratorConfig(taylorseer_order=order) if order else None
        name = f"F1B0 τ{threshold} w2" + (f" +TS{order}" if order else "")

        def install(config=config, calibrator=calibrator) -> None:
            cache_dit.enable_cache(pipe, cache_config=config, calibrator_config=calibrator)

        runs.append((name, "cache-dit 1.5.3", install, lambda: cache_dit.disable_cache(pipe)))
    return runs


def diffusers_runs(pipe) -> list[Config]:
    import diffusers
    from diffusers.hooks import FirstBlockCacheConfig

    library = f"diffusers {diffusers.__version__}"
    configs = [(f"FirstBlockCache τ{t}", FirstBlockCacheConfig(threshold=t)) for t in (0.12, 0.2, 0.3)]
    try:
        from diffusers.hooks import TaylorSeerCacheConfig
    except ImportError:
        TaylorSeerCacheConfig = None  # noqa: N806 - older diffusers
    if TaylorSeerCacheConfig is not None:
        configs += [
            (f"TaylorSeerCache interval {i}", TaylorSeerCacheConfig(cache_interval=i, disable_cache_before_step=2))
            for i in (2, 3)
        ]
    return [
        (name, library, lambda c=config: pipe.transformer.enable_cache(c), pipe.transformer.disable_cache)
        for name, config in configs
    ]


def table(results: list[Result]) -> str:
    lines = [
        "| library | configuration | blocks computed | speed-up (blocks) | wall s | speed-up (wall, paired) "
        "| PSNR mean / min | SSIM mean / min |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.library} | {r.name} | {r.blocks_fraction:.1%} | {1 / r.blocks_fraction:.2f}× | {r.seconds:.2f} | "
            f"{r.baseline_seconds / r.seconds:.2f}× | {r.psnr_mean:.1f} / {r.psnr_min:.1f} "
            f"| {r.ssim_mean:.3f} / {r.ssim_min:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=2, help="seeds per digit (10 digits each)")
    parser.add_argument("--steps", type=int, default=REFERENCE_DEFAULTS["num_inference_steps"])
    parser.add_argument("--true-cfg", type=float, default=1.0, help=">1 runs cond+uncond forwards per step")
    parser.add_argument(
        "--libraries",
        default="fastdit",
        help="comma list of fastdit, cache-dit, diffusers (run each in its own process)",
    )
    parser.add_argument("--batch", type=int, default=20, help="images per pipeline call (cache decisions are per call)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pipe = load_reference_pipeline()
    pipe.set_progress_bar_config(disable=True)
    counter = BlockCounter(pipe.transformer)
    num_blocks = len(counter.handles)
    cases = [(d, s) for s in range(args.seeds) for d in range(10)]
    generate(pipe, cases[:1], args.steps, args.true_cfg, 1)  # warm-up
    counter.count = 0
    baseline, base_seconds = generate(pipe, cases, args.steps, args.true_cfg, args.batch)
    base_blocks = counter.count

    libraries = {name.strip() for name in args.libraries.split(",") if name.strip()}
    runs: list[Config] = []
    if "fastdit" in libraries:
        runs.append(("no cache (baseline again)", "—", lambda: None, lambda: None))
        runs += fastdit_runs(pipe, args.steps, num_blocks)
    if "cache-dit" in libraries:
        runs += cache_dit_runs(pipe)
    if "diffusers" in libraries:
        runs += diffusers_runs(pipe)
    results = []
    for name, library, install, remove in runs:
        # Time the uncached pipeline right before each configuration: on a shared machine the load drifts, and the
        # wall speed-up is only meaningful against a baseline measured under the same load.
        _, paired = generate(pipe, cases, args.steps, args.true_cfg, args.batch)
        install()
        try:
            results.append(
                measure(
                    name,
                    library,
                    pipe,
                    counter,
                    cases,
                    args.steps,
                    args.true_cfg,
                    args.batch,
                    baseline,
                    base_blocks,
                    paired,
                )
            )
        finally:
            remove()
    print(f"baseline: {base_seconds:.2f} s for {len(cases)} images, {args.steps} steps, true_cfg {args.true_cfg}")
    print(table(results))
    if args.out:
        write_results(args, len(cases), base_seconds, results)


def write_results(args: argparse.Namespace, num_cases: int, base_seconds: float, results: list[Result]) -> None:
    """Merge ``results`` into the JSON at ``args.out`` (rows keyed by library and configuration), atomically."""
    payload = json.loads(args.out.read_text()) if args.out.exists() else {"results": []}
    fresh = {(r.library, r.name) for r in results}
    kept = [r for r in payload["results"] if (r["library"], r["name"]) not in fresh]
    payload.update(
        {
            "date": date.today().isoformat(),
            "device": f"CPU {platform.machine()}, {os.cpu_count()} cores, {args.threads} threads",
            "torch": torch.__version__,
            "cases": num_cases,
            "steps": args.steps,
            "true_cfg": args.true_cfg,
            "batch": args.batch,
            "baseline_seconds": round(base_seconds, 3),
            "results": kept + [r.__dict__ for r in results],
        }
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    tmp.replace(args.out)


if __name__ == "__main__":
    main()
