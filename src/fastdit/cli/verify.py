"""``fastdit verify [TARGET]``: run the model-integration ladder and print pass/fail per configuration.

TARGET is omitted (the built-in reference pipeline), ``tiny:FAMILY`` or ``tiny:FAMILY:VARIANT`` (a family's
random-weight tiny pipeline, e.g. ``tiny:flux``), a registered model name (weights from ``--model-path`` or its
environment variable), or a local pipeline directory. The baseline runs first without acceleration; then each rung
(cache, ulysses, ring, tp, tep, vaep, ulysses_tp, usp, cfg) is applied, run on the same prompt and seed, removed,
and compared with the baseline: cache rows need PSNR > 30 dB, parallel rows PSNR > 35 dB, all SSIM > 0.90; PSNR
> 30 dB with SSIM < 0.5 is "garbled". Parallel rows use every process: run under ``torchrun --nproc-per-node N``.
Rows the model or the process count cannot run are shown with the reason. Exit code 1 when a row fails.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from fastdit.cli import CLIError
from fastdit.cli.distributed import EXIT_FAILED, add_timeout_argument, report_stop
from fastdit.cli.fields import cli_error
from fastdit.cli.options import (
    DTYPES,
    add_call_arguments,
    call_values,
    check_call_numbers,
    check_positive,
    check_size,
    configure_threads,
    output_path,
    resolve_device,
    resolve_dtype,
)
from fastdit.errors import FieldError

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``verify`` command.

    Args:
        subparsers: The action returned by ``ArgumentParser.add_subparsers``.

    Returns:
        The command's parser.
    """
    parser = subparsers.add_parser(
        "verify",
        help="run the integration ladder (cache, CP, TP, TEP, VAE, hybrid) against the baseline: pass/fail per row",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "target",
        nargs="?",
        metavar="TARGET",
        help="tiny:FAMILY[:VARIANT], model name, directory, or module.path:function returning (pipeline, call "
        "kwargs[, adapter]) for a third-party model",
    )
    parser.add_argument("--model-path", metavar="DIR", help="weights directory of a registered model")
    parser.add_argument("--ladder", metavar="LIST", help="comma-separated rungs or groups (cp, hybrid); default all")
    parser.add_argument("--prompt", metavar="TEXT", help="prompt (default: the target's own or a built-in one)")
    parser.add_argument("--seed", type=int, default=0, help="noise seed (default 0)")
    add_call_arguments(parser)
    group = parser.add_argument_group("run and report")
    group.add_argument("--device", help="device to run on (default: cuda if available, else cpu)")
    group.add_argument("--dtype", choices=("auto", *DTYPES), default="auto", help="parameter dtype")
    group.add_argument("--threads", type=int, metavar="N", help="CPU threads for torch")
    group.add_argument("--warmup", type=int, default=1, metavar="N", help="untimed calls per row (default 1)")
    group.add_argument("--repeat", type=int, default=1, metavar="N", help="timed calls per row (median reported)")
    group.add_argument("--min-psnr", type=float, metavar="DB", help="PSNR minimum of every row (overrides 30/35)")
    group.add_argument("--min-ssim", type=float, metavar="X", help="SSIM minimum of every row (overrides 0.90)")
    group.add_argument("--json", metavar="PATH", help="write the report as JSON to PATH (atomically)")
    group.add_argument("--grid", metavar="PATH", help="write an image grid of every row's output to PATH (.png)")
    add_timeout_argument(group)
    return parser


def _writable(flag: str, text: str | None) -> Path | None:
    if text is None:
        return None
    from fastdit.io import check_writable

    path = output_path(text)
    try:
        check_writable(path)
    except OSError as error:
        raise CLIError(f"argument {flag} {text}: {error.filename} {error.strerror}") from None
    return path


def _thresholds(args: argparse.Namespace) -> Any:
    from fastdit.diagnostics.verify import Thresholds

    thresholds = Thresholds()
    check_positive("--min-psnr", args.min_psnr, allow_zero=True)
    if args.min_psnr is not None:
        thresholds = replace(thresholds, cache_psnr=args.min_psnr, parallel_psnr=args.min_psnr)
    if args.min_ssim is not None:
        check_positive("--min-ssim", args.min_ssim, allow_zero=True)
        thresholds = replace(thresholds, ssim=args.min_ssim)
    return thresholds


def _check(args: argparse.Namespace) -> None:
    from fastdit.diagnostics.verify import LadderError, select_rungs

    check_call_numbers(args)
    check_positive("--seed", args.seed, allow_zero=True)
    check_positive("--warmup", args.warmup, allow_zero=True)
    check_positive("--repeat", args.repeat)
    try:
        select_rungs(args.ladder)
    except LadderError as error:
        raise CLIError(f"argument --ladder {args.ladder}: {error}") from None


def _resolve(args: argparse.Namespace) -> Any:
    from fastdit.diagnostics.verify import TargetError, resolve_target

    try:
        return resolve_target(args.target, args.model_path)
    except TargetError as error:
        raise CLIError(str(error)) from None
    except FieldError as error:
        raise cli_error(error, model=args.target) from None


def _call(args: argparse.Namespace, target: Any) -> tuple[dict[str, Any], Any]:
    """The call arguments and the one case: the target's defaults, then the flags."""
    from fastdit.bench import default_prompts
    from fastdit.session import Case, call_arguments, call_parameters

    session = target.session
    try:
        kwargs = call_arguments(session.pipeline_class, target.defaults, call_values(args, session.pipeline_class))
        prompt = None
        if "prompt" in call_parameters(session.pipeline_class):
            prompt = args.prompt or kwargs.pop("prompt", None) or default_prompts(session.source, 1)[0]
        elif args.prompt:
            raise CLIError(f"argument --prompt: {session.pipeline_class.__name__} takes no prompt")
        kwargs.pop("prompt", None)
        check_size(session.pipe, kwargs)
        return kwargs, Case(prompt, args.seed)
    except FieldError as error:
        raise cli_error(error) from None


def _write(args: argparse.Namespace, report: Any, json_path: Path | None, grid_path: Path | None) -> None:
    from fastdit.diagnostics.verify import save_grid
    from fastdit.io import write_json

    print(f"# {report.title()}\n\n{report.table()}", end="")
    if json_path is not None:
        write_json(json_path, report.to_dict())
    if grid_path is not None:
        save_grid(report, grid_path)
    for row in report.failures:
        print(f"fastdit: verify: {row.name} failed: {row.reason}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    """Verify the target and print the table (rank 0 prints and writes).

    Args:
        args: Parsed arguments of the ``verify`` command.

    Returns:
        0 when every row that ran passed, 1 when one failed (or a collective lost a rank), 130 when interrupted.

    Raises:
        CLIError: On bad input (before anything is loaded or written).
    """
    from fastdit.diagnostics.verify import TargetError, VerifyRuntime, load_target, verify_ladder
    from fastdit.process import is_main_process, process_group_scope

    _check(args)
    json_path, grid_path = _writable("--json", args.json), _writable("--grid", args.grid)
    thresholds = _thresholds(args)
    resolved = _resolve(args)
    device = resolve_device(args.device)
    reference = getattr(resolved, "reference", False)
    # Tiny pipelines' kernels are as small as the reference pipeline's: one thread runs them fastest.
    configure_threads(args.threads, reference=reference or isinstance(resolved, tuple), device=device)
    try:
        target = load_target(resolved, device=device, dtype=resolve_dtype(args.dtype, device))
    except TargetError as error:  # a module:function target that cannot be imported or returns something else
        raise CLIError(str(error)) from None
    kwargs, case = _call(args, target)
    runtime = VerifyRuntime(
        cases=(case,),
        warmup=args.warmup,
        repeat=args.repeat,
        thresholds=thresholds,
        timeout_s=args.dist_timeout,
        adapter=target.adapter,
        name=target.session.source.name,
    )
    try:
        # The process group the first parallel row starts under torchrun ends here, once every row is done.
        with process_group_scope():
            report = verify_ladder(target.session.pipe, kwargs, args.ladder, runtime)
    except KeyboardInterrupt as stop:
        return report_stop(stop)
    if is_main_process():
        _write(args, report, json_path, grid_path)
    return 0 if report.passed else EXIT_FAILED
