"""``fastdit bench [MODEL] --configs "none;fbcache;fn=1,threshold=0.2" --out DIR``: cache configurations side by side.

The pipeline is loaded once. The baseline (no acceleration) and then each configuration generate the same prompts
with the same seeds; every configuration is compared with the baseline images. Results go to ``DIR/bench.json``, a
markdown table ``DIR/bench.md`` (Configuration | Latency | Speed-up | Blocks computed | PSNR | SSIM | Memory, PSNR and
SSIM as mean / min) and a speed-versus-quality plot ``DIR/bench.png``.

A configuration is a cache preset (``fastdit list --cache-presets``), a preset followed by ``field=value`` overrides
(``fbcache,threshold=0.2``), or overrides of the default preset alone (``fn=1,bn=1,threshold=0.2,taylorseer=1``);
field names are those of DBCache/DBPrune. ``none`` runs without a cache (a determinism check: PSNR is infinite).
Latency is the median over ``--repeat`` of the time per image.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastdit.cli import CLIError
from fastdit.cli.options import (
    add_call_arguments,
    add_model_arguments,
    cache_from_spec,
    call_values,
    check_call_numbers,
    check_positive,
    check_size,
    configure_threads,
    resolve_device,
    resolve_dtype,
    resolve_source,
)
from fastdit.generate import (
    Case,
    Generator,
    ModelSource,
    RunResult,
    call_arguments,
    call_parameters,
    compare_outputs,
    default_prompts,
    default_steps,
    is_main_process,
    is_video_pipeline,
    save_output,
)

__all__ = ["BenchRow", "add_parser", "markdown", "plot", "run"]

DEFAULT_CONFIGS = "fbcache;balanced;fast;ultra"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``bench`` command.

    Args:
        subparsers: The action returned by ``ArgumentParser.add_subparsers``.

    Returns:
        The command's parser.
    """
    parser = subparsers.add_parser(
        "bench",
        help="benchmark cache configurations against the baseline: latency, PSNR, SSIM, memory",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_arguments(parser)
    parser.add_argument(
        "--configs",
        default=DEFAULT_CONFIGS,
        metavar="SPECS",
        help=f"configurations separated by ';' (default {DEFAULT_CONFIGS!r})",
    )
    parser.add_argument("--prompts", type=int, default=4, metavar="N", help="number of built-in prompts (default 4)")
    parser.add_argument("--prompt", action="append", metavar="TEXT", help="use these prompts instead (repeatable)")
    parser.add_argument("--seeds", default="0", metavar="LIST", help="comma-separated seeds, each with every prompt")
    add_call_arguments(parser)
    parser.add_argument("--warmup", type=int, default=1, metavar="N", help="untimed calls per configuration")
    parser.add_argument("--repeat", type=int, default=1, metavar="N", help="timed passes per configuration")
    parser.add_argument("--out", required=True, metavar="DIR", help="directory for bench.json, bench.md, bench.png")
    parser.add_argument("--save-images", action="store_true", help="also save every output under DIR/<config>/")
    parser.add_argument("--json", action="store_true", help="end with one JSON line: the rows of bench.json")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


@dataclass
class BenchRow:
    """One line of the benchmark.

    Attributes:
        name: The configuration as given (``baseline`` for the baseline).
        config: The cache configuration as plain data (``None``: no cache).
        seconds: Median time per image.
        speedup: Baseline seconds / these seconds.
        blocks_computed_fraction: Blocks computed / blocks of an uncached run.
        cached_steps: Cached steps over all images of one pass.
        psnr, psnr_min, ssim, ssim_min: Quality against the baseline images (mean and minimum).
        peak_memory: Peak bytes (``None`` when not measurable).
    """

    name: str
    config: dict[str, Any] | None
    seconds: float
    speedup: float = 1.0
    blocks_computed_fraction: float = 1.0
    cached_steps: int = 0
    psnr: float = float("inf")
    psnr_min: float = float("inf")
    ssim: float = 1.0
    ssim_min: float = 1.0
    peak_memory: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (infinite PSNR as the string ``"inf"``)."""
        from fastdit.metrics import json_safe

        out = dataclasses.asdict(self)
        for name in ("psnr", "psnr_min", "ssim", "ssim_min"):
            out[name] = json_safe(out[name])
        return out


@dataclass
class _Plan:
    source: ModelSource
    pipeline_class: type
    kwargs: dict[str, Any]
    cases: list[Case]
    configs: list[tuple[str, Any]]
    out: Path
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.float32
    num_steps: int | None = None


def _seeds(text: str) -> list[int]:
    try:
        seeds = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise CLIError(f"argument --seeds {text}: expected comma-separated integers") from None
    if not seeds or min(seeds) < 0:
        raise CLIError(f"argument --seeds {text}: expected one or more non-negative integers")
    return seeds


def _configs(text: str, num_steps: int | None) -> list[tuple[str, Any]]:
    specs = [spec.strip() for spec in text.split(";") if spec.strip()]
    if not specs:
        raise CLIError(f"argument --configs {text!r}: no configuration given")
    if len(set(specs)) != len(specs):
        raise CLIError(f"argument --configs {text!r}: a configuration is listed twice")
    return [(spec, cache_from_spec(spec, num_steps)) for spec in specs]


def _prompts(args: argparse.Namespace, source: ModelSource, pipeline_class: type) -> list[str | None]:
    if "prompt" not in call_parameters(pipeline_class):
        if args.prompt:
            raise CLIError(f"argument --prompt: {pipeline_class.__name__} takes no prompt")
        return [None]
    check_positive("--prompts", args.prompts)
    return list(args.prompt) if args.prompt else list(default_prompts(source, args.prompts))


def _plan(args: argparse.Namespace) -> _Plan:
    check_call_numbers(args)
    check_positive("--repeat", args.repeat)
    check_positive("--warmup", args.warmup, allow_zero=True)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise CLIError(f"argument --out {args.out}: exists and is not a directory")
    seeds = _seeds(args.seeds)
    source, pipeline_class = resolve_source(args)
    try:
        kwargs = call_arguments(pipeline_class, source.defaults, call_values(args, pipeline_class))
    except ValueError as error:
        raise CLIError(str(error)) from None
    num_steps = default_steps(pipeline_class, kwargs)
    cases = [Case(prompt, seed) for prompt in _prompts(args, source, pipeline_class) for seed in seeds]
    device = resolve_device(args.device)
    configure_threads(args.threads, reference=source.reference, device=device)
    return _Plan(
        source=source,
        pipeline_class=pipeline_class,
        kwargs=kwargs,
        cases=cases,
        configs=_configs(args.configs, num_steps),
        out=out,
        device=device,
        dtype=resolve_dtype(args.dtype, device),
        num_steps=num_steps,
    )


def _check_configs(generator: Generator, plan: _Plan) -> None:
    # Install and remove every cache once before timing anything, so a configuration the model cannot take (e.g.
    # more front blocks than it has) fails in a second instead of after the runs before it.
    for name, config in plan.configs:
        if config is None:
            continue
        try:
            generator.accelerate(cache=config)
        except ValueError as error:
            raise CLIError(f"argument --configs: {name!r}: {error}") from None
        generator.disable()


def _row(name: str, config: Any, result: RunResult, baseline: RunResult | None, count: int) -> BenchRow:
    row = BenchRow(
        name=name,
        config=None if config is None else {"type": type(config).__name__, **dataclasses.asdict(config)},
        seconds=result.median_seconds / count,
        peak_memory=result.peak_memory,
    )
    if result.cache is not None:
        row.blocks_computed_fraction = result.cache.blocks_computed_fraction
        row.cached_steps = result.cache.cached_steps
    if baseline is not None:
        quality = compare_outputs(baseline.outputs, result.outputs)
        row.speedup = baseline.median_seconds / result.median_seconds
        row.psnr, row.psnr_min, row.ssim, row.ssim_min = quality.psnr, quality.psnr_min, quality.ssim, quality.ssim_min
    return row


def _measure(generator: Generator, plan: _Plan, args: argparse.Namespace) -> list[tuple[BenchRow, RunResult]]:
    variants = [{}] + [{"cache": config} if config is not None else {} for _, config in plan.configs]
    results = generator.run_variants(
        variants, plan.cases, plan.kwargs, warmup=args.warmup, repeat=args.repeat, track_memory=True
    )
    baseline, count = results[0], len(plan.cases)
    measured = [(_row("baseline", None, baseline, None, count), baseline)]
    for (name, config), result in zip(plan.configs, results[1:], strict=True):
        measured.append((_row(name, config, result, baseline, count), result))
    return measured


def _fmt_psnr(value: float) -> str:
    return "∞" if value == float("inf") else f"{value:.2f}"


def markdown(rows: list[BenchRow], title: str) -> str:
    """The benchmark as a markdown table (PSNR and SSIM against the baseline, mean / min)."""
    lines = [
        f"# {title}",
        "",
        "| Configuration | Latency (s/image) | Speed-up | Blocks computed | PSNR (dB) | SSIM | Memory (GiB) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        memory = "-" if row.peak_memory is None else f"{row.peak_memory / 2**30:.2f}"
        lines.append(
            f"| {row.name} | {row.seconds:.3f} | {row.speedup:.2f}x | {row.blocks_computed_fraction:.1%} | "
            f"{_fmt_psnr(row.psnr)} / {_fmt_psnr(row.psnr_min)} | {row.ssim:.4f} / {row.ssim_min:.4f} | {memory} |"
        )
    return "\n".join(lines) + "\n"


def _capped(rows: list[BenchRow]) -> tuple[list[float], list[float], float]:
    finite = [v for r in rows for v in (r.psnr, r.psnr_min) if np.isfinite(v)]
    cap = (max(finite) + 5.0) if finite else 60.0  # where identical outputs (infinite PSNR) are drawn

    def capped(values: list[float]) -> list[float]:
        return [v if np.isfinite(v) else cap for v in values]

    return capped([r.psnr for r in rows]), capped([r.psnr_min for r in rows]), cap


def plot(rows: list[BenchRow], path: Path, title: str) -> Path:
    """Speed-up and blocks computed against PSNR (mean, with a line down to the minimum), saved atomically.

    Points are numbered; the legend below the plots maps numbers to configurations (their names can be long).
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: never open a window or need a display
    import matplotlib.pyplot as plt

    from fastdit.io import atomic_output

    means, minima, cap = _capped(rows)
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.5 + 0.22 * len(rows)), sharey=True)
    for axis, x_values, label in (
        (axes[0], [r.speedup for r in rows], "speed-up vs baseline (×)"),
        (axes[1], [r.blocks_computed_fraction for r in rows], "blocks computed (fraction)"),
    ):
        for index, (row, x, mean, minimum) in enumerate(zip(rows, x_values, means, minima, strict=True)):
            axis.vlines(x, minimum, mean, color="tab:gray", linewidth=1)
            axis.plot(x, mean, "o", color=f"C{index % 10}", label=f"{index}: {row.name}")
            axis.annotate(str(index), (x, mean), textcoords="offset points", xytext=(4, 4), fontsize=8)
        axis.set_xlabel(label)
        axis.margins(x=0.15, y=0.1)
        axis.grid(alpha=0.3)
    axes[0].set_ylabel(f"PSNR vs baseline, mean and min (dB; identical at {cap:.0f})")
    handles, labels = axes[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=1, fontsize=8, frameon=False)
    figure.suptitle(title)
    figure.tight_layout(rect=(0, 0.06 * len(rows) / (1 + 0.05 * len(rows)), 1, 1))
    with atomic_output(path) as temp:
        figure.savefig(temp, format="png", dpi=120)
    plt.close(figure)
    return path


def _save_images(plan: _Plan, measured: list[tuple[BenchRow, RunResult]]) -> None:
    suffix = ".mp4" if is_video_pipeline(plan.pipeline_class) else ".png"
    for index, (_, result) in enumerate(measured):
        # Numbered directories: configuration names hold characters that do not belong in file names.
        directory = plan.out / "images" / f"{index:02d}"
        for number, output in enumerate(result.outputs):
            save_output(directory / f"{number:04d}{suffix}", output)


def _report(plan: _Plan, rows: list[BenchRow], args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": plan.source.name,
        "pipeline": plan.pipeline_class.__name__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(plan.device),
        "device_name": torch.cuda.get_device_name(plan.device)
        if plan.device.type == "cuda"
        else platform.processor() or platform.machine(),
        "dtype": str(plan.dtype).removeprefix("torch."),
        "steps": plan.num_steps,
        "call": {k: v for k, v in plan.kwargs.items() if isinstance(v, (int, float, str, bool))},
        "prompts": sorted({c.prompt for c in plan.cases if c.prompt is not None}),
        "seeds": sorted({c.seed for c in plan.cases}),
        "warmup": args.warmup,
        "repeat": args.repeat,
        "rows": [row.to_dict() for row in rows],
    }


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and write ``bench.json``, ``bench.md`` and ``bench.png`` (rank 0 only).

    Args:
        args: Parsed arguments of the ``bench`` command.

    Returns:
        0 on success.

    Raises:
        CLIError: On bad input (before anything is written).
    """
    from fastdit.io import write_json, write_text

    plan = _plan(args)
    main = is_main_process()
    generator = Generator.load(plan.source, device=plan.device, dtype=plan.dtype, progress=main and not args.quiet)
    check_size(generator.pipe, plan.kwargs)
    _check_configs(generator, plan)
    measured = _measure(generator, plan, args)
    rows = [row for row, _ in measured]
    if not main:
        return 0
    title = f"{plan.source.name}: {len(plan.cases)} images, {plan.num_steps} steps, {plan.device}"
    report = _report(plan, rows, args)
    write_json(plan.out / "bench.json", report)
    table = markdown(rows, title)
    write_text(plan.out / "bench.md", table)
    plot(rows, plan.out / "bench.png", title)
    if args.save_images:
        _save_images(plan, measured)
    print(table, end="", file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(report["rows"], allow_nan=False))
    return 0
