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
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastdit.bench import RunResult, Sweep, default_prompts, measure, write_reports
from fastdit.cli import CLIError
from fastdit.cli.fields import cli_error
from fastdit.cli.options import (
    add_call_arguments,
    add_model_arguments,
    cache_from_spec,
    call_values,
    check_call_numbers,
    check_positive,
    check_size,
    configure_threads,
    output_path,
    parse_seeds,
    resolve_device,
    resolve_dtype,
    resolve_source,
)
from fastdit.errors import FieldError
from fastdit.io import check_writable
from fastdit.process import is_main_process
from fastdit.session import (
    Case,
    ModelSource,
    Session,
    audio_sample_rate,
    call_arguments,
    call_parameters,
    default_steps,
    is_audio_pipeline,
    is_video_pipeline,
    save_outputs,
)

__all__ = ["add_parser", "run"]

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
class _Plan:
    sweep: Sweep
    out: Path


def _configs(text: str, num_steps: int | None, model: str) -> list[tuple[str, Any]]:
    specs = [spec.strip() for spec in text.split(";") if spec.strip()]
    if not specs:
        raise CLIError(f"argument --configs {text!r}: no configuration given")
    if len(set(specs)) != len(specs):
        raise CLIError(f"argument --configs {text!r}: a configuration is listed twice")
    return [(spec, cache_from_spec(spec, num_steps, model=model)) for spec in specs]


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
    out = output_path(args.out)
    try:
        check_writable(out, directory=True)
    except OSError as error:
        raise CLIError(f"argument --out {args.out}: {error.filename} {error.strerror}") from None
    seeds = parse_seeds("--seeds", args.seeds)
    source, pipeline_class = resolve_source(args)
    try:
        kwargs = call_arguments(pipeline_class, source.defaults, call_values(args, pipeline_class))
    except FieldError as error:
        raise cli_error(error) from None
    num_steps = default_steps(pipeline_class, kwargs)
    cases = [Case(prompt, seed) for prompt in _prompts(args, source, pipeline_class) for seed in seeds]
    device = resolve_device(args.device)
    configure_threads(args.threads, reference=source.reference, device=device)
    sweep = Sweep(
        source=source,
        pipeline_class=pipeline_class,
        kwargs=kwargs,
        cases=cases,
        configs=_configs(args.configs, num_steps, source.name),
        device=device,
        dtype=resolve_dtype(args.dtype, device),
        num_steps=num_steps,
        warmup=args.warmup,
        repeat=args.repeat,
    )
    return _Plan(sweep, out)


def _check_configs(session: Session, sweep: Sweep) -> None:
    # Install and remove every cache once before timing anything, so a configuration the model cannot take (e.g.
    # more front blocks than it has) fails in a second instead of after the runs before it.
    for name, config in sweep.configs:
        if config is None:
            continue
        try:
            session.accelerate(cache=config)
        except ValueError as error:
            raise CLIError(f"argument --configs: {name!r}: {error}") from None
        session.disable()


def _save_images(plan: _Plan, results: list[RunResult], sample_rate: int | None = None) -> None:
    audio = is_audio_pipeline(plan.sweep.pipeline_class)
    suffix = ".wav" if audio else ".mp4" if is_video_pipeline(plan.sweep.pipeline_class) else ".png"
    for index, result in enumerate(results):
        # Numbered directories: configuration names hold characters that do not belong in file names.
        directory = plan.out / "images" / f"{index:02d}"
        paths = [directory / f"{number:04d}{suffix}" for number in range(len(result.outputs))]
        save_outputs(paths, result.outputs, sample_rate=sample_rate)  # all of a row or none of it


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and write ``bench.json``, ``bench.md`` and ``bench.png`` (rank 0 only).

    Args:
        args: Parsed arguments of the ``bench`` command.

    Returns:
        0 on success.

    Raises:
        CLIError: On bad input (before anything is written).
    """
    plan = _plan(args)
    sweep, main = plan.sweep, is_main_process()
    session = Session.load(sweep.source, device=sweep.device, dtype=sweep.dtype, progress=main and not args.quiet)
    check_size(session.pipe, sweep.kwargs)
    _check_configs(session, sweep)
    measured = measure(session, sweep)
    if not main:
        return 0
    report, table = write_reports(plan.out, sweep, [row for row, _ in measured])
    if args.save_images:
        _save_images(plan, [result for _, result in measured], audio_sample_rate(session.pipe))
    print(table, end="", file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(report["rows"], allow_nan=False))
    return 0
