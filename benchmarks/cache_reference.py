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
import dataclasses
import json
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

import torch

import fastdit
from fastdit.bench import RunResult, compare_outputs, json_ready, markdown_table, run
from fastdit.bench.heldout import BlockCounter, transformer_blocks
from fastdit.io import write_json
from fastdit.reference import REFERENCE_DEFAULTS, digit_prompt
from fastdit.session import Case, Session, call_arguments, resolve_model


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


@dataclass
class Bench:
    """The pipeline, its call and cases, the block counter, and the uncached run every configuration is scored on."""

    session: Session
    counter: BlockCounter
    cases: list[Case]
    kwargs: dict[str, Any]
    batch: int
    baseline: RunResult | None = None
    base_blocks: int = 0

    def generate(self) -> RunResult:
        """One timed pass over every case, ``batch`` per pipeline call (cache decisions are per call)."""
        return run(self.session, self.cases, self.kwargs, batch=self.batch)


def measure(bench: Bench, name: str, library: str, paired: float) -> Result:
    print(f"running {library}: {name}", flush=True)
    bench.counter.count = 0
    result = bench.generate()
    quality = compare_outputs(bench.baseline.outputs, result.outputs)
    return Result(
        name=name,
        library=library,
        seconds=round(result.median_seconds, 3),
        baseline_seconds=round(paired, 3),
        blocks_fraction=round(bench.counter.count / bench.base_blocks, 4),
        psnr_mean=round(quality.psnr, 2),
        psnr_min=round(quality.psnr_min, 2),
        ssim_mean=round(quality.ssim, 4),
        ssim_min=round(quality.ssim_min, 4),
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


def fastdit_runs(session: Session, steps: int, num_blocks: int) -> list[Config]:
    runs = []
    for name, kwargs in fastdit_configs(steps).items():
        if kwargs["fn"] + kwargs.get("bn", 0) >= num_blocks:
            continue  # leaves no middle block on this model
        config = fastdit.DBCache(**kwargs)
        runs.append((name, "fastdit", lambda c=config: session.accelerate(cache=c), session.disable))
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
    header = ("library", "configuration", "blocks computed", "speed-up (blocks)", "wall s", "speed-up (wall, paired)",
              "PSNR mean / min", "SSIM mean / min")  # fmt: skip
    rows = [
        (
            r.library,
            r.name,
            f"{r.blocks_fraction:.1%}",
            f"{1 / r.blocks_fraction:.2f}×",
            f"{r.seconds:.2f}",
            f"{r.baseline_seconds / r.seconds:.2f}×",
            f"{r.psnr_mean:.1f} / {r.psnr_min:.1f}",
            f"{r.ssim_mean:.3f} / {r.ssim_min:.3f}",
        )
        for r in results
    ]
    return markdown_table(header, rows)


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
    bench = setup(args)
    libraries = {name.strip() for name in args.libraries.split(",") if name.strip()}
    runs: list[Config] = []
    if "fastdit" in libraries:
        runs.append(("no cache (baseline again)", "—", lambda: None, lambda: None))
        runs += fastdit_runs(bench.session, args.steps, bench.counter.num_blocks)
    if "cache-dit" in libraries:
        runs += cache_dit_runs(bench.session.pipe)
    if "diffusers" in libraries:
        runs += diffusers_runs(bench.session.pipe)
    results = []
    for name, library, install, remove in runs:
        # Time the uncached pipeline right before each configuration: on a shared machine the load drifts, and the
        # wall speed-up is only meaningful against a baseline measured under the same load.
        paired = bench.generate().median_seconds
        install()
        try:
            results.append(measure(bench, name, library, paired))
        finally:
            remove()
    base_seconds = bench.baseline.median_seconds
    print(f"baseline: {base_seconds:.2f} s for {len(bench.cases)} images, {args.steps} steps, true_cfg {args.true_cfg}")
    print(table(results), end="")
    if args.out:
        write_results(args, len(bench.cases), base_seconds, results)


def setup(args: argparse.Namespace) -> Bench:
    """Load the reference pipeline, warm it up, and run the uncached baseline."""
    source = resolve_model(None, None)
    session = Session.load(source, device="cpu", dtype=torch.float32)
    overrides: dict[str, Any] = {"num_inference_steps": args.steps}
    if args.true_cfg > 1:
        overrides.update(negative_prompt="", true_cfg_scale=args.true_cfg)
    cases = [Case(digit_prompt(d), seed=s) for s in range(args.seeds) for d in range(10)]
    kwargs = call_arguments(session.pipeline_class, source.defaults, overrides)
    bench = Bench(session, BlockCounter(transformer_blocks(session)), cases, kwargs, args.batch)
    run(session, cases[:1], kwargs)  # warm-up, before the blocks are counted
    bench.counter.count = 0
    bench.baseline = bench.generate()
    bench.base_blocks = bench.counter.count
    return bench


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
            "results": kept + [dataclasses.asdict(r) for r in results],
        }
    )
    write_json(args.out, json_ready(payload), indent=1)


if __name__ == "__main__":
    main()
