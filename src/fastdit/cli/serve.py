"""``fastdit serve [MODEL]``: serve an accelerated pipeline over an OpenAI-compatible HTTP API.

``POST /v1/images/generations`` and ``/v1/images/edits`` (the ``openai`` client's ``images.generate`` and
``images.edit``), ``POST /v1/videos`` and ``GET /v1/videos[/{id}[/content]]`` (asynchronous video jobs),
``/v1/loras`` (LoRA adapters, from ``--lora-dir``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``
(Prometheus) and a web page at ``/``. Without MODEL the built-in reference pipeline is served, offline. Requests run
one at a time; under ``torchrun`` with ``--parallel`` rank 0 serves HTTP and every rank runs each request together.
Binds to 127.0.0.1 unless ``--host`` says otherwise; with ``--api-key`` (or FASTDIT_API_KEY) ``/v1/*`` needs
``Authorization: Bearer KEY``. See docs/serve.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from fastdit.cache.presets import DEFAULT_CACHE_PRESET, NO_CACHE, cache_config
from fastdit.cli import CLIError
from fastdit.cli.distributed import EXIT_FAILED, report_stop
from fastdit.cli.generate import acceleration_options, add_acceleration_arguments, loading_options
from fastdit.cli.options import (
    add_cache_arguments,
    add_model_arguments,
    check_cache_fits,
    check_positive,
    check_size,
    configure_threads,
    is_file_spec,
    resolve_device,
    resolve_dtype,
    resolve_source,
)
from fastdit.config import DEFAULT_TIMEOUT_S
from fastdit.errors import FieldError
from fastdit.parallel.failures import CollectiveError, collective_failures
from fastdit.process import is_main_process, join_process_group, process_count, process_group_scope
from fastdit.serve.limits import Limits, limit_fields
from fastdit.session import Session, call_arguments
from fastdit.session import check_size as check_call_size

__all__ = ["API_KEY_ENV", "add_parser", "run"]

API_KEY_ENV = "FASTDIT_API_KEY"
"""The environment variable read for the API key when ``--api-key`` is not given."""

_LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``serve`` command.

    Args:
        subparsers: The action returned by ``ArgumentParser.add_subparsers``.

    Returns:
        The command's parser.
    """
    parser = subparsers.add_parser(
        "serve",
        help="serve a pipeline over an OpenAI-compatible HTTP API",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_arguments(parser)
    parser.add_argument(
        "--steps", type=int, metavar="N", help="steps of a request that gives no num_inference_steps (default: model's)"
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=0,
        metavar="N",
        help="runs at the default size before serving (first-call compilation, CUDA graphs, allocator); default 0",
    )
    parser.add_argument(
        "--warmup-sizes",
        metavar="WxH,...",
        help="also warm up at each of these sizes (e.g. 1024x1024,768x1344), and at each batch size of --max-batch; "
        "/health answers warming_up until done",
    )
    add_cache_arguments(parser)
    add_acceleration_arguments(parser)
    _add_server_arguments(parser)
    return parser


def _add_server_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    group.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    group.add_argument(
        "--model-name",
        metavar="NAME",
        help="the model id clients pass and /v1/models lists (default: MODEL, 'reference', or the directory's name)",
    )
    group.add_argument(
        "--api-key", metavar="KEY", help=f"require Authorization: Bearer KEY on /v1/* (default: ${API_KEY_ENV})"
    )
    group.add_argument(
        "--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"), help="server log"
    )
    group.add_argument(
        "--lora-dir", metavar="DIR", help="POST /v1/loras may load LoRA files from under DIR (default: LoRA off)"
    )
    group.add_argument(
        "--video-dir", metavar="DIR", help="where finished videos are kept (default: a temporary directory)"
    )
    group.add_argument(
        "--video-ttl-s", type=float, default=3600.0, metavar="S", help="seconds a finished video is kept (default 3600)"
    )
    group.add_argument(
        "--max-videos", type=int, default=100, metavar="N", help="video jobs kept, finished or not (default 100)"
    )
    limits = parser.add_argument_group("request limits")
    for name, kind, default, doc in limit_fields():
        limits.add_argument(
            f"--{name.replace('_', '-')}", type=kind, default=default, metavar="N", help=f"{doc} (default {default:g})"
        )


def _limits(args: argparse.Namespace) -> Limits:
    values = {name: getattr(args, name) for name, *_ in limit_fields()}
    try:
        return Limits(**values)
    except ValueError as error:
        name = str(error).split("=", 1)[0]
        raise CLIError(f"argument --{name.replace('_', '-')} {values.get(name)}: {error}") from None


def _cache_name(args: argparse.Namespace, options: dict[str, Any]) -> str:
    """What reports call the server's cache: its preset, or ``custom`` when field flags changed it."""
    cache = options.get("cache")
    if cache is None:
        return NO_CACHE
    preset = args.cache or DEFAULT_CACHE_PRESET
    if is_file_spec(preset):  # a calibrated configuration: reports name the file
        return preset
    return preset if cache == cache_config(preset) else "custom"


def warmup_sizes(text: str | None, max_side: int) -> list[tuple[int, int]]:
    """``--warmup-sizes``: ``WxH`` entries separated by commas, each within ``--max-side``.

    Raises:
        CLIError: Naming the flag and the entry at fault.
    """
    from fastdit.serve.schemas import parse_size

    if text is None:
        return []
    sizes = []
    for entry in text.split(","):
        try:
            width, height = parse_size(entry)
        except ValueError as error:
            raise CLIError(f"argument --warmup-sizes {text}: {entry.strip() or '(empty)'!r}: {error}") from None
        if max(width, height) > max_side:
            raise CLIError(f"argument --warmup-sizes {text}: {entry.strip()!r} exceeds --max-side {max_side}")
        sizes.append((width, height))
    return sizes


def _directory(flag: str, value: str | None) -> Path | None:
    if value is None:
        return None
    path = Path(value).expanduser()
    if not path.is_dir():
        raise CLIError(f"argument {flag} {value}: no such directory")
    return path


def _plan(args: argparse.Namespace) -> dict[str, Any]:
    """Everything that can be checked before loading: model, defaults, acceleration, limits, key, warm-up sizes."""
    check_positive("--steps", args.steps)
    check_positive("--warmup", args.warmup, allow_zero=True)
    check_positive("--port", args.port, allow_zero=True)
    check_positive("--video-ttl-s", args.video_ttl_s)
    check_positive("--max-videos", args.max_videos)
    limits = _limits(args)
    sizes = warmup_sizes(args.warmup_sizes, limits.max_side)
    lora_dir = _directory("--lora-dir", args.lora_dir)
    video_dir = _directory("--video-dir", args.video_dir)
    source, pipeline_class = resolve_source(args)
    overrides = {} if args.steps is None else {"num_inference_steps": args.steps}
    try:
        defaults = call_arguments(pipeline_class, source.defaults, overrides)
    except FieldError as error:
        raise CLIError(f"argument --steps {args.steps}: {error.requirement}") from None
    options = acceleration_options(args, defaults.get("num_inference_steps"), source.name)
    if process_count() > 1 and "parallel" not in options:
        raise CLIError(f"argument --parallel: a server of {process_count()} processes needs a layout, e.g. ulysses=2")
    device = resolve_device(args.device)
    configure_threads(args.threads, reference=source.reference, device=device)
    return {
        "source": replace(source, defaults=defaults),
        "options": options,
        "loading": loading_options(args, options.get("parallel")),
        "cache_name": _cache_name(args, options),
        "device": device,
        "dtype": resolve_dtype(args.dtype, device),
        "limits": limits,
        "api_key": args.api_key or os.environ.get(API_KEY_ENV) or None,
        "warmup_sizes": sizes,
        "lora_dir": lora_dir,
        "video_dir": video_dir,
    }


def _warn_exposed(host: str, api_key: str | None) -> None:
    if host not in _LOOPBACK and api_key is None:
        print(
            f"fastdit: warning: serving on {host} without an API key: anyone who reaches this port can use it "
            f"(set --api-key or {API_KEY_ENV}, or put it behind a proxy that authenticates)",
            file=sys.stderr,
        )


def _load(plan: dict[str, Any]) -> Any:
    from fastdit.parallel.load_broadcast import LoadBroadcastError
    from fastdit.serve.worker import Runner

    try:
        session = Session.load(plan["source"], device=plan["device"], dtype=plan["dtype"], loading=plan["loading"])
    except LoadBroadcastError as error:  # raised on every rank alike, before any weight moved
        raise CLIError(f"argument --load {plan['loading'].mode}: {error}") from None
    check_size(session.pipe, plan["source"].defaults)
    for width, height in plan["warmup_sizes"]:  # loaded: the model's size unit is known, still before serving
        try:
            check_call_size(session.pipe, {"width": width, "height": height})
        except FieldError as error:
            raise CLIError(f"argument --warmup-sizes {width}x{height}: {error.requirement}") from None
    check_cache_fits(session.pipe, plan["options"].get("cache"))
    return Runner(session, plan["options"], plan["cache_name"])


def _serve(args: argparse.Namespace, plan: dict[str, Any], runner: Any, timeout_s: float) -> int:
    uvicorn = _require("uvicorn")
    from fastdit.serve.app import create_app
    from fastdit.serve.jobs import ModelSpec, warmup_jobs
    from fastdit.serve.videos import VideoStore
    from fastdit.serve.worker import Driver

    failures: list[BaseException] = []
    server: Any = None

    def on_fatal(error: BaseException) -> None:
        failures.append(error)
        server.should_exit = True

    driver = Driver(runner, process_count(), timeout_s)
    spec = ModelSpec.of(runner.session, plan["options"].get("cache"), name=args.model_name)
    # Warm-up runs through the driver like requests, after the port opened: /health says warming_up meanwhile,
    # and under torchrun every rank runs it in lockstep.
    warmup = warmup_jobs(spec, plan["limits"], plan["warmup_sizes"], args.warmup)
    videos = None
    if spec.video:
        _require("imageio")
        _require("imageio_ffmpeg")
        videos = VideoStore(plan["video_dir"], ttl_s=args.video_ttl_s, max_videos=args.max_videos)
    app = create_app(
        driver,
        spec,
        limits=plan["limits"],
        api_key=plan["api_key"],
        on_fatal=on_fatal,
        warmup=warmup,
        lora_dir=plan["lora_dir"],
        videos=videos,
    )
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level))
    _warn_exposed(args.host, plan["api_key"])
    server.run()
    if failures:
        error = failures[0]
        if isinstance(error, CollectiveError):
            return report_stop(error)
        print(f"fastdit: error: {error}", file=sys.stderr)
        return EXIT_FAILED
    return 0


def _require(module: str) -> Any:
    from fastdit.serve import require

    try:
        return require(module)
    except ImportError as error:
        raise CLIError(str(error)) from None


def run(args: argparse.Namespace) -> int:
    """Load, accelerate, and serve until interrupted (rank 0), or run the jobs rank 0 sends (other ranks).

    Returns:
        0 after a clean shutdown; 1 when a rank was lost (after one line naming it); 130 when interrupted under
        ``torchrun``.

    Raises:
        CLIError: On bad input, before anything is loaded.
    """
    _require("fastapi")
    _require("prometheus_client")
    plan = _plan(args)
    parallel = plan["options"].get("parallel")
    timeout_s = parallel.timeout_s if parallel is not None else DEFAULT_TIMEOUT_S
    try:
        # The default group is joined here, not by accelerating: switching a request's cache re-applies the
        # acceleration, which must find the group rather than end it.
        with process_group_scope(), collective_failures(timeout_s):
            join_process_group(plan["device"], timeout_s)
            runner = _load(plan)
            if not is_main_process():
                from fastdit.serve.worker import worker_loop

                worker_loop(runner, timeout_s)
                return 0
            return _serve(args, plan, runner, timeout_s)
    except (CollectiveError, KeyboardInterrupt) as stop:
        return report_stop(stop)
