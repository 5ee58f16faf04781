"""``fastdit calibrate MODEL --target-psnr 32`` (or ``--target-speedup 3``): choose a cache configuration for a model.

The pipeline generates the calibration prompts with the calibration seeds, uncached, then searches cache
configurations (MagCache with the model's magnitude ratios, recorded here on the first prompt, and DBCache F1B0 with
TaylorSeer; TeaCache with the model's polynomial, fitted on the first prompt, on request; each over its thresholds
and caps) for the fewest block evaluations whose worst image stays above the
PSNR target plus a margin (``--target-psnr``), or for the best worst image within a work budget
(``--target-speedup``), SSIM above ``--ssim-min`` in both cases. The chosen configuration is then run on the
held-out seeds, which the search never saw, and both figures are printed side by side and stored with it.

The file (``--out``, by default one per model and step count under ``$FASTDIT_CALIBRATION_DIR`` or the user cache)
is read back by ``--cache calibrated`` (that default file) or ``--cache from:PATH`` in ``generate``, ``bench`` and
``serve``; ``fastdit bench MODEL --configs "none;from:PATH" --seeds 7,8`` measures it on any other seeds.

``--scales PATH`` records static FP8's activation scales instead (:mod:`fastdit.cli.scales`): every quantizable
Linear's largest input on the calibration cases, checked with ``--quantize fp8_static`` on both parts of the split.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fastdit.bench.calibrate import DEFAULT_POLICIES, POLICIES, Calibrated, Target, calibrate_cache, ladders
from fastdit.bench.heldout import CALIBRATION_SEEDS, HELDOUT_SEEDS, Split, SplitBench, transformer_blocks
from fastdit.bench.plain import json_ready, plain
from fastdit.bench.prompts import default_prompts
from fastdit.bench.report import markdown_table
from fastdit.bench.sweep import BenchRow
from fastdit.cache.files import CacheFile, default_cache_file, save_cache_file
from fastdit.cli import CLIError
from fastdit.cli.fields import cli_error
from fastdit.cli.options import (
    add_call_arguments,
    add_model_arguments,
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
from fastdit.config import (
    WEIGHT_SCALES,
    MagCache,
    MagCalibration,
    MagCalibrations,
    Quantize,
    TeaCache,
    TeaCalibration,
)
from fastdit.errors import FieldError
from fastdit.io import check_writable
from fastdit.process import process_count
from fastdit.session import ModelSource, Session, call_arguments, call_parameters, default_steps

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``calibrate`` command.

    Args:
        subparsers: The action returned by ``ArgumentParser.add_subparsers``.

    Returns:
        The command's parser.
    """
    parser = subparsers.add_parser(
        "calibrate",
        help="choose a cache configuration for a quality or speed target, or record static FP8 scales (--scales); "
        "check either on held-out seeds",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_arguments(parser)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--target-psnr", type=float, metavar="DB", help="lowest PSNR of the worst image (dB)")
    target.add_argument("--target-speedup", type=float, metavar="X", help="block evaluations cut by this factor")
    target.add_argument(
        "--scales",
        metavar="PATH",
        help="record static FP8 activation scales into PATH instead (for --quantize fp8_static,scales=PATH)",
    )
    parser.add_argument(
        "--headroom",
        type=float,
        default=1.0,
        metavar="X",
        help="with --scales: the Quantize headroom the held-out check runs with (default 1)",
    )
    parser.add_argument(
        "--weight-scales",
        choices=WEIGHT_SCALES,
        default="tensor",
        help="with --scales: the Quantize weight_scales the held-out check runs with (row: bfloat16 weights, "
        "--dtype bfloat16 on the CPU)",
    )
    parser.add_argument("--ssim-min", type=float, default=0.90, metavar="S", help="lowest SSIM (default 0.90)")
    parser.add_argument(
        "--margin", type=float, default=1.0, metavar="DB", help="with --target-psnr: dB kept above it (default 1)"
    )
    parser.add_argument(
        "--policies",
        default=",".join(DEFAULT_POLICIES),
        metavar="LIST",
        help=f"searched, among {','.join(POLICIES)} (default {','.join(DEFAULT_POLICIES)})",
    )
    parser.add_argument("--prompts", type=int, default=10, metavar="N", help="built-in prompts (default 10)")
    parser.add_argument("--prompt", action="append", metavar="TEXT", help="use these prompts instead (repeatable)")
    parser.add_argument(
        "--seeds", default=",".join(map(str, CALIBRATION_SEEDS)), metavar="LIST", help="calibration seeds"
    )
    parser.add_argument(
        "--heldout-seeds", default=",".join(map(str, HELDOUT_SEEDS)), metavar="LIST", help="held-out seeds"
    )
    parser.add_argument("--batch", type=int, default=10, metavar="N", help="cases per pipeline call (default 10)")
    add_call_arguments(parser)
    parser.add_argument("--out", metavar="PATH", help="the cache file (default: the one --cache calibrated reads)")
    parser.add_argument("--json", action="store_true", help="end with one JSON line: the file's content")
    parser.add_argument("--quiet", action="store_true", help="no progress")
    return parser


@dataclass
class _Plan:
    source: ModelSource
    kwargs: dict[str, Any]
    num_steps: int | None
    split: Split
    target: Target | None
    policies: list[str]
    out: Path
    device: Any
    dtype: Any


def _target(args: argparse.Namespace) -> Target:
    try:
        return Target(psnr=args.target_psnr, speedup=args.target_speedup, ssim=args.ssim_min, margin_db=args.margin)
    except ValueError as error:
        option = "--target-psnr" if args.target_psnr is not None else "--target-speedup"
        for name, flag in (("ssim", "--ssim-min"), ("margin_db", "--margin")):
            if f"Target.{name}=" in str(error):
                option = flag
        raise CLIError(f"argument {option}: {error}") from None


def _policies(text: str) -> list[str]:
    policies = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies or len(set(policies)) != len(policies):
        raise CLIError(f"argument --policies {text}: expected distinct names among {', '.join(POLICIES)}")
    return policies


def _plan(args: argparse.Namespace) -> _Plan:
    if process_count() > 1:
        raise CLIError("fastdit calibrate runs in one process: run it without torchrun")
    check_call_numbers(args)
    check_positive("--prompts", args.prompts)
    check_positive("--batch", args.batch)
    target = None if args.scales else _target(args)
    policies = _policies(args.policies)
    seeds = tuple(parse_seeds("--seeds", args.seeds))
    heldout = tuple(parse_seeds("--heldout-seeds", args.heldout_seeds))
    shared = sorted(set(seeds) & set(heldout))
    if shared:
        raise CLIError(f"argument --heldout-seeds {args.heldout_seeds}: seeds {shared} are calibration seeds too")
    source, pipeline_class = resolve_source(args)
    if "prompt" in call_parameters(pipeline_class):
        prompts = tuple(args.prompt) if args.prompt else tuple(default_prompts(source, args.prompts))
    elif args.prompt:
        raise CLIError(f"argument --prompt: {pipeline_class.__name__} takes no prompt")
    else:
        prompts = (None,)
    try:
        kwargs = call_arguments(pipeline_class, source.defaults, call_values(args, pipeline_class))
    except FieldError as error:
        raise cli_error(error) from None
    num_steps = default_steps(pipeline_class, kwargs)
    if args.scales and args.out:
        raise CLIError(f"argument --out {args.out}: with --scales the file is --scales {args.scales}")
    option, text = ("--scales", args.scales) if args.scales else ("--out", args.out)
    out = output_path(text) if text else default_cache_file(source.name, num_steps)
    try:
        check_writable(out)
    except OSError as error:
        raise CLIError(f"argument {option} {out}: {error.filename} {error.strerror}") from None
    if args.scales:
        _check_headroom(args.headroom)
    device = resolve_device(args.device)
    configure_threads(args.threads, reference=source.reference, device=device)
    split = Split(prompts=prompts, calibration_seeds=seeds, heldout_seeds=heldout)
    dtype = resolve_dtype(args.dtype, device)
    if args.scales and args.weight_scales == "row" and dtype != torch.bfloat16:
        raise CLIError(
            f"argument --weight-scales row: row-wise FP8 weights need bfloat16 weights; the model would load in "
            f"{str(dtype).removeprefix('torch.')} (--dtype bfloat16)"
        )
    return _Plan(source, kwargs, num_steps, split, target, policies, out, device, dtype)


def _check_headroom(value: float) -> None:
    try:
        Quantize(mode="fp8_static", calibrate=True, headroom=value)
    except FieldError as error:
        raise CLIError(f"argument --headroom {value}: {error}") from None


def _magcache_calibration(session: Session, plan: _Plan) -> MagCalibration | MagCalibrations | None:
    """The model's magnitude ratios, recorded on the first calibration case: one calibration per denoiser
    (``None``: a denoiser recorded nothing, so MagCache cannot apply)."""
    from fastdit.bench.timing import run as run_cases
    from fastdit.calibration import calibration_of

    session.accelerate(cache=MagCache(calibrate=True, threshold=0.0))
    try:
        run_cases(session, plan.split.cases("calibration")[:1], plan.kwargs)
        try:
            return calibration_of(session.pipe)
        except ValueError as error:  # a denoiser the calibration case never called
            print(f"magcache skipped: {error}", file=sys.stderr)
            return None
    finally:
        session.disable()


def _teacache_calibration(session: Session, plan: _Plan) -> TeaCalibration | None:
    """The model's input-to-residual polynomial, fitted on the first calibration case (``None``: cannot apply)."""
    from fastdit.bench.timing import run as run_cases
    from fastdit.calibration import calibration_of
    from fastdit.components import walk

    if len(walk(session.pipe).denoisers) != 1:
        print("teacache skipped: the pipeline has more than one denoiser", file=sys.stderr)
        return None
    session.accelerate(cache=TeaCache(calibrate=True, threshold=0.0))
    try:
        run_cases(session, plan.split.cases("calibration")[:1], plan.kwargs)
        return calibration_of(session.pipe)
    except ValueError as error:  # too few steps for the fit
        print(f"teacache skipped: {error}", file=sys.stderr)
        return None
    finally:
        session.disable()


def _declares_latent(session: Session) -> bool:
    """Whether every denoiser's family declares the latent the spectral signal filters."""
    from fastdit.components import walk

    return all(item.adapter.latent is not None for item in walk(session.pipe).denoisers)


def _row_cells(row: BenchRow, target: Target) -> list[Any]:
    return [
        row.name,
        f"{100 * row.blocks_computed_fraction:.1f}%",
        f"{row.psnr:.2f} / {row.worst[0]:.2f}",  # the worst image, or for videos the worst clip
        f"{row.worst[1]:.4f}",
        "yes" if target.meets(row) else "no",
    ]


def report(result: Calibrated) -> str:
    """The candidates and the choice (calibration vs held-out) as markdown."""
    header = ["Configuration", "Blocks computed", "PSNR mean / min (dB)", "SSIM min", "Meets target"]
    lines = [f"Target: {result.target.describe()}", "", "Candidates (calibration cases):", ""]
    lines.append(markdown_table(header, [_row_cells(r, result.target) for r in result.candidates]))
    if result.chosen is None:
        lines.append("No configuration met the target.")
        return "\n".join(lines)
    lines += ["", f"Chosen: {result.chosen[0]}", ""]
    rows = [("calibration", result.calibration), ("held-out", result.heldout)]
    table = [[part, *_row_cells(row, result.target)[1:4]] for part, row in rows if row is not None]
    lines.append(markdown_table(["Cases", "Blocks computed", "PSNR mean / min (dB)", "SSIM min"], table))
    return "\n".join(lines)


def _measured(row: BenchRow | None) -> dict[str, Any] | None:
    """A row without its config (the file holds the chosen one once; a candidate is named by its spec)."""
    return None if row is None else {k: v for k, v in row.to_dict().items() if k != "config"}


def _provenance(plan: _Plan, result: Calibrated) -> dict[str, Any]:
    return json_ready(
        {
            "target": {"psnr": plan.target.psnr, "speedup": plan.target.speedup, "ssim": plan.target.ssim,
                       "margin_db": plan.target.margin_db},
            "prompts": list(plan.split.prompts),
            "calibration_seeds": list(plan.split.calibration_seeds),
            "heldout_seeds": list(plan.split.heldout_seeds),
            "call": {k: v for k, v in plan.kwargs.items() if isinstance(v, (int, float, str, bool))},
            "calibration": _measured(result.calibration),
            "heldout": _measured(result.heldout),
            "candidates": [_measured(row) for row in result.candidates],
        }
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Calibrate, print the report and write the cache file.

    Args:
        args: Parsed arguments of the ``calibrate`` command.

    Returns:
        0 when a configuration met the target (the file is written), 1 when none did (nothing is written).

    Raises:
        CLIError: On bad input (before the model is loaded).
    """
    plan = _plan(args)
    session = Session.load(plan.source, device=plan.device, dtype=plan.dtype, progress=False)
    check_size(session.pipe, plan.kwargs)
    bench = SplitBench(session, plan.split, plan.kwargs, blocks=transformer_blocks(session), batch=args.batch)
    if plan.target is None:
        from fastdit.cli.scales import record_scales

        try:
            return record_scales(
                session, bench, plan.out, headroom=args.headroom, weight_scales=args.weight_scales, as_json=args.json
            )
        finally:
            bench.close()
    try:
        policies = list(plan.policies)
        calibration = _magcache_calibration(session, plan) if "magcache" in policies else None
        if calibration is None and "magcache" in policies:
            policies.remove("magcache")
        tea_calibration = _teacache_calibration(session, plan) if "teacache" in policies else None
        if tea_calibration is None and "teacache" in policies:
            policies.remove("teacache")
        if "spectral" in policies and not _declares_latent(session):
            print("spectral skipped: a denoiser's family declares no latent grid", file=sys.stderr)
            policies.remove("spectral")
        if not policies:
            raise CLIError("argument --policies: no policy can apply to this pipeline")
        space = ladders(policies, plan.num_steps or 0, calibration, tea_calibration)

        def progress(row: BenchRow) -> None:
            if not args.quiet:
                cells = _row_cells(row, plan.target)
                print(f"  {cells[0]}: blocks {cells[1]}, PSNR {cells[2]}, SSIM min {cells[3]}", file=sys.stderr)

        result = calibrate_cache(bench, plan.target, space, progress=progress)
    finally:
        bench.close()
    print(report(result), file=sys.stderr if args.json else sys.stdout)
    if result.chosen is None:
        return 1
    cache_file = CacheFile(result.chosen[1], plan.source.name, plan.num_steps, _provenance(plan, result))
    path = save_cache_file(plan.out, cache_file)
    print(f"wrote {path}", file=sys.stderr)
    if args.json:
        print(json.dumps({"path": str(path), "config": plain(result.chosen[1]), **cache_file.provenance}))
    return 0
