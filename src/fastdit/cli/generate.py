"""``fastdit generate [MODEL]``: load a pipeline, accelerate it, generate, time it, and save the result.

MODEL is a registered name (``fastdit list``) whose weights are read from ``--model-path`` or the model's environment
variable (e.g. ``FLUX_DIR``); fastdit never downloads. Without MODEL the built-in reference pipeline runs, offline, and
an accelerated run is compared with the plain one by default (speed-up, PSNR, SSIM).

Every check that does not need the weights runs before they are loaded, and nothing is written unless the run
succeeds: bad input ends with one line ``fastdit: error: ...`` and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from fastdit.bench import RunResult, compare_outputs, default_prompts, plain_options, run_variants, timed_load
from fastdit.cache.policy import check_run_length
from fastdit.cli import CLIError
from fastdit.cli.distributed import add_timeout_argument, report_stop, with_timeout
from fastdit.cli.fields import cli_error
from fastdit.cli.options import (
    add_cache_arguments,
    add_call_arguments,
    add_model_arguments,
    cache_from_args,
    call_values,
    check_cache_fits,
    check_call_numbers,
    check_positive,
    check_size,
    configure_threads,
    output_path,
    parse_attention,
    parse_config_fields,
    parse_parallel,
    parse_quantize,
    resolve_device,
    resolve_dtype,
    resolve_source,
)
from fastdit.config import (
    ATTENTION_BACKENDS,
    DEFAULT_TIMEOUT_S,
    QUANTIZE_MODES,
    Compile,
    CudaGraph,
    DBCache,
    DBPrune,
    Fuse,
    Loading,
    Offload,
    Parallel,
)
from fastdit.errors import FieldError
from fastdit.io import AUDIO_SUFFIXES, IMAGE_SUFFIXES, VIDEO_SUFFIXES, check_writable
from fastdit.parallel.failures import CollectiveError, collective_failures
from fastdit.parallel.load_broadcast import LoadBroadcastError
from fastdit.process import is_main_process, process_count, process_group_scope
from fastdit.session import (
    AUDIO,
    Case,
    ModelSource,
    Session,
    audio_sample_rate,
    call_arguments,
    call_parameters,
    default_steps,
    is_audio_pipeline,
    is_video_pipeline,
    output_paths,
    save_outputs,
)

__all__ = [
    "GeneratePlan",
    "GenerateRun",
    "acceleration_options",
    "add_acceleration_arguments",
    "add_parser",
    "execute",
    "loading_options",
    "plan_from_args",
    "run",
]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``generate`` command.

    Args:
        subparsers: The action returned by ``ArgumentParser.add_subparsers``.

    Returns:
        The command's parser.
    """
    parser = subparsers.add_parser(
        "generate",
        help="generate images or videos with an accelerated pipeline",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_arguments(parser)
    parser.add_argument(
        "--prompt", action="append", metavar="TEXT", help="prompt; repeat for several (one output each, in order)"
    )
    parser.add_argument("--seed", type=int, default=0, help="noise seed, the same for every prompt (default 0)")
    add_call_arguments(parser)
    add_cache_arguments(parser)
    add_acceleration_arguments(parser)
    _add_run_arguments(parser)
    return parser


def add_acceleration_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--parallel``, ``--dist-timeout``, ``--load``, ``--compile``, ``--cuda-graph``, ``--attention``,
    ``--offload``, ``--fuse`` and ``--quantize`` (shared with ``serve``)."""
    group = parser.add_argument_group("parallelism and compilation")
    group.add_argument(
        "--parallel",
        metavar="SPEC",
        help="degrees as key=value pairs, e.g. ulysses=2,ring=1 (keys: ulysses, ring, tp, cfg, text_encoder, vae); "
        "their product must equal the number of processes (torchrun)",
    )
    add_timeout_argument(group)
    group.add_argument(
        "--load",
        metavar="MODE",
        default="every-rank",
        help="who reads the weights under torchrun: every-rank (default: each process reads the whole checkpoint), "
        "rank0 (global rank 0 reads it and broadcasts every tensor to the others), node-rank0 (each node's local "
        "rank 0 reads it and broadcasts within its node)",
    )
    group.add_argument("--compile", action="store_true", help="torch.compile the transformer blocks")
    group.add_argument(
        "--compile-vae",
        action="store_true",
        help="torch.compile the VAE decoders too (implies --compile; not with a parallel VAE decode)",
    )
    group.add_argument(
        "--compile-outer",
        action="store_true",
        help="torch.compile the transformer's modules outside its blocks too (embedders, RoPE, final norm and "
        "projection: most of what a cached step costs beyond its front blocks; implies --compile)",
    )
    group.add_argument(
        "--cuda-graph",
        action="store_true",
        help="replay transformer calls as CUDA graphs (CUDA only; with --cache each block is graphed and the cache "
        "decides between blocks; with --compile the compiled kernels are graphed)",
    )
    group.add_argument(
        "--attention",
        metavar="BACKEND[,key=value]",
        help=f"attention backend ({', '.join(ATTENTION_BACKENDS)}) and optional key=value pairs (keys: gqa, scales, "
        "headroom), e.g. cudnn-fp8,scales=PATH (static FP8 attention scales from a file fastdit calibrate --scales "
        "wrote)",
    )
    group.add_argument(
        "--offload",
        nargs="?",
        const="",
        metavar="SPEC",
        help="keep transformer blocks in host memory and stream them in for their call (a model larger than the "
        "GPU); optional fields, e.g. resident_blocks=20,prefetch=2 (keys: resident_blocks, prefetch, device, "
        "pin_memory)",
    )
    group.add_argument(
        "--fuse",
        nargs="?",
        const="",
        metavar="SPEC",
        help="compute the projections each block applies to one tensor (Q/K/V, FLUX's single-block Q/K/V + MLP "
        "input) as one matmul per group, as the model family declares them; optional fields, e.g. "
        "exclude=single_transformer_blocks.*.proj_mlp (keys: exclude, one fnmatch pattern)",
    )
    group.add_argument(
        "--quantize",
        metavar="SPEC",
        help=f"quantize the transformer blocks' linear layers with torchao (pip install 'fastdit[quant]'): MODE "
        f"({', '.join(QUANTIZE_MODES)}) and optional key=value pairs (keys: include, exclude, min_size, scales, "
        "headroom), e.g. fp8 or int8_weight,exclude=*.norm1.linear or fp8_static,scales=PATH (a file fastdit "
        "calibrate --scales wrote); fp8 and fp8_tensor need a CUDA GPU of compute capability >= 8.9",
    )


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("timing and output")
    group.add_argument(
        "--warmup",
        type=int,
        metavar="N",
        help="untimed runs first (default: 1 with --compare, --compile or --cuda-graph, else 0)",
    )
    group.add_argument("--repeat", type=int, default=1, metavar="N", help="timed runs; the median is reported")
    group.add_argument(
        "--compare",
        action=argparse.BooleanOptionalAction,
        help="also run without acceleration (same seed) and report speed-up, PSNR and SSIM "
        "(default: on for the reference pipeline when an acceleration is requested)",
    )
    group.add_argument("--summary", action="store_true", help="print the cache statistics of the last run")
    group.add_argument(
        "--track-memory", action="store_true", help="report peak memory (CUDA max allocated, or process peak RSS)"
    )
    group.add_argument(
        "--out",
        metavar="PATH",
        help="output file for one prompt (.png, ... ; .mp4 or .gif for videos; .wav for audio); a directory for "
        "several (0000.png, 0001.png, ... in prompt order)",
    )
    group.add_argument("--fps", type=float, default=16.0, help="frames per second of saved videos (default 16)")
    group.add_argument("--json", action="store_true", help="end with one JSON line of results (the rest on stderr)")
    group.add_argument("--quiet", action="store_true", help="no progress bar")


@dataclass
class GeneratePlan:
    """Everything ``generate`` will do, checked before any weights are loaded.

    Attributes:
        source: The model.
        pipeline_class: Its pipeline class (imported, not instantiated).
        kwargs: Call arguments (without prompt and generator).
        cases: Prompt and seed of each output.
        acceleration: ``fastdit.accelerate`` keyword arguments (empty: none requested).
        device: Where to run.
        dtype: Parameter dtype.
        warmup: Untimed runs.
        repeat: Timed runs.
        compare: Whether to run the un-accelerated baseline too.
        outputs: Where each output is saved (empty: nothing is saved).
        video: Whether the pipeline makes videos.
        num_steps: Denoising steps per call (``None`` if the pipeline does not say).
        loading: Who reads the weights (``--load``).
    """

    source: ModelSource
    pipeline_class: type
    kwargs: dict[str, Any]
    cases: list[Case]
    acceleration: dict[str, Any] = field(default_factory=dict)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.float32
    warmup: int = 0
    repeat: int = 1
    compare: bool = False
    outputs: list[Path] = field(default_factory=list)
    video: bool = False
    num_steps: int | None = None
    loading: Loading = field(default_factory=Loading)


def loading_options(args: argparse.Namespace, parallel: Parallel | None) -> Loading:
    """The :class:`Loading` that ``--load`` asks for, waiting ``--dist-timeout`` for the reading rank if given.

    Raises:
        CLIError: A mode that does not exist, naming the flag.
    """
    try:
        return Loading(mode=args.load, timeout_s=parallel.timeout_s if parallel is not None else DEFAULT_TIMEOUT_S)
    except FieldError as error:
        raise CLIError(f"argument --load {args.load}: {error.requirement}") from None


def _check_numbers(args: argparse.Namespace) -> None:
    check_call_numbers(args)
    check_positive("--repeat", args.repeat)
    check_positive("--warmup", args.warmup, allow_zero=True)
    check_positive("--seed", args.seed, allow_zero=True)
    check_positive("--fps", args.fps)


def _cases(args: argparse.Namespace, source: ModelSource, pipeline_class: type) -> list[Case]:
    takes_prompt = "prompt" in call_parameters(pipeline_class)
    if args.prompt and not takes_prompt:
        raise CLIError(f"argument --prompt: {pipeline_class.__name__} takes no prompt")
    if not takes_prompt:
        return [Case(None, args.seed)]
    prompts = args.prompt or (default_prompts(source, 1) if source.reference else None)
    if not prompts:
        raise CLIError(f"argument --prompt: required for MODEL {source.name!r}")
    return [Case(prompt, args.seed) for prompt in prompts]


def acceleration_options(args: argparse.Namespace, num_steps: int | None, model: str | None = None) -> dict[str, Any]:
    """The ``fastdit.accelerate`` keyword arguments the cache and acceleration flags ask for (empty: none).

    ``model`` is the model's name (:attr:`ModelSource.name`), which ``--cache calibrated`` looks its file up by.

    Raises:
        CLIError: On a bad value, naming the flag.
    """
    options: dict[str, Any] = {}
    cache = cache_from_args(args, num_steps, model)
    if cache is not None:
        options["cache"] = cache
    if args.parallel is not None:
        try:
            num_processes = process_count()
        except FieldError as error:  # a malformed WORLD_SIZE
            raise cli_error(error) from None
        options["parallel"] = with_timeout(args, parse_parallel(args.parallel, num_processes))
    else:
        with_timeout(args, None)  # refuses --dist-timeout alone
    if args.compile or args.compile_vae or args.compile_outer:
        options["compile"] = Compile(vae=args.compile_vae, outer=args.compile_outer)
    if args.cuda_graph:  # graphs without dynamo unless --compile is given too
        options["cuda_graph"] = CudaGraph()
    if args.quantize is not None:
        options["quantize"] = parse_quantize(args.quantize)
    if args.attention is not None:
        options["attention"] = parse_attention(args.attention)
    if args.offload is not None:
        options["offload"] = parse_config_fields(Offload, args.offload, "--offload")
    if args.fuse is not None:
        options["fuse"] = parse_config_fields(Fuse, args.fuse, "--fuse")
    return options


def _check_step_mask(cache: DBCache | DBPrune | None, num_steps: int | None) -> None:
    """Refuse a step mask laid out for fewer steps than the run before loading anything (the run would refuse it
    at its first step; ``fastdit.cli.main`` names the flag that set the mask's ``num_steps``)."""
    if num_steps is not None and isinstance(cache, DBCache):
        check_run_length(cache.step_mask, num_steps)


def _output_files(args: argparse.Namespace, out: Path, count: int, video: bool, audio: bool = False) -> list[Path]:
    suffixes = AUDIO_SUFFIXES if audio else VIDEO_SUFFIXES if video else IMAGE_SUFFIXES
    if count > 1:
        if out.suffix.lower() in IMAGE_SUFFIXES | VIDEO_SUFFIXES | AUDIO_SUFFIXES or out.is_file():
            raise CLIError(f"argument --out {args.out}: {count} prompts need a directory, not a file")
        return output_paths(out, count, ".wav" if audio else ".mp4" if video else ".png")
    if out.is_dir():
        raise CLIError(f"argument --out {args.out}: is a directory; one prompt is saved to a file")
    if out.suffix.lower() not in suffixes:
        kind = "audio" if audio else "a video" if video else "an image"
        raise CLIError(f"argument --out {args.out}: {kind} needs one of the suffixes {', '.join(sorted(suffixes))}")
    return [out]


def _outputs(args: argparse.Namespace, count: int, video: bool, audio: bool = False) -> list[Path]:
    """Where the outputs go, checked to be writable before any weights are loaded (nothing is created)."""
    if args.out is None:
        return []
    out = output_path(args.out)
    paths = _output_files(args, out, count, video, audio)
    if video and any(p.suffix.lower() != ".gif" for p in paths) and importlib.util.find_spec("imageio") is None:
        raise CLIError(f"argument --out {args.out}: mp4 needs imageio and imageio-ffmpeg (pip install fastdit[video])")
    try:
        check_writable(out, directory=count > 1)
    except OSError as error:
        raise CLIError(f"argument --out {args.out}: {error.filename} {error.strerror}") from None
    return paths


def plan_from_args(args: argparse.Namespace) -> GeneratePlan:
    """Check every argument that can be checked without the weights and resolve the model.

    Raises:
        CLIError: On any bad value, naming the flag.
    """
    _check_numbers(args)
    source, pipeline_class = resolve_source(args)
    try:
        kwargs = call_arguments(pipeline_class, source.defaults, call_values(args, pipeline_class))
    except FieldError as error:
        raise cli_error(error) from None
    num_steps = default_steps(pipeline_class, kwargs)
    cases = _cases(args, source, pipeline_class)
    acceleration = acceleration_options(args, num_steps, source.name)
    loading = loading_options(args, acceleration.get("parallel"))
    _check_step_mask(acceleration.get("cache"), num_steps)
    compare = args.compare if args.compare is not None else source.reference and bool(acceleration)
    if compare and not acceleration:
        raise CLIError("argument --compare: nothing to compare, ask for an acceleration (--cache, --compile, ...)")
    device = resolve_device(args.device)
    configure_threads(args.threads, reference=source.reference, device=device)
    video = is_video_pipeline(pipeline_class)
    default_warmup = 1 if compare or args.compile or args.compile_vae or args.compile_outer or args.cuda_graph else 0
    return GeneratePlan(
        source=source,
        pipeline_class=pipeline_class,
        kwargs=kwargs,
        cases=cases,
        acceleration=acceleration,
        device=device,
        dtype=resolve_dtype(args.dtype, device),
        warmup=default_warmup if args.warmup is None else args.warmup,
        repeat=args.repeat,
        compare=compare,
        outputs=_outputs(args, len(cases), video, is_audio_pipeline(pipeline_class)),
        video=video,
        num_steps=num_steps,
        loading=loading,
    )


def _accelerate(session: Session, plan: GeneratePlan) -> None:
    try:
        check_cache_fits(session.pipe, plan.acceleration.get("cache"))
        session.accelerate(**plan.acceleration)
    except FieldError:
        raise  # fastdit.cli.main names the flags that set the field (or argument), from the parsed arguments
    except (NotImplementedError, ValueError) as error:  # about the model, not a value the user chose
        raise CLIError(f"cannot accelerate {plan.source.name}: {error}") from None
    except ImportError as error:  # an optional package a technique needs (torchao for --quantize)
        raise CLIError(f"cannot accelerate {plan.source.name}: {error}") from None


@dataclass
class GenerateRun:
    """What :func:`execute` measured.

    Attributes:
        session: The loaded pipeline (left un-accelerated).
        load_seconds: Wall time of loading it.
        result: The accelerated run (or the plain one when no acceleration was asked for).
        baseline: The plain run under ``plan.compare``, else ``None``.
    """

    session: Session
    load_seconds: float
    result: RunResult
    baseline: RunResult | None = None


def execute(plan: GeneratePlan, *, progress: bool, track_memory: bool) -> GenerateRun:
    """Load, check sizes and the acceleration, then run (interleaved with the baseline under ``plan.compare``)."""
    try:
        session, load_seconds = timed_load(
            plan.source, device=plan.device, dtype=plan.dtype, progress=progress, loading=plan.loading
        )
    except LoadBroadcastError as error:  # raised on every rank alike, before any weight moved
        raise CLIError(f"argument --load {plan.loading.mode}: {error}") from None
    check_size(session.pipe, plan.kwargs)
    if plan.acceleration:
        _accelerate(session, plan)  # fail fast, before spending time on any run
        session.disable()
    variants = [{}, plan.acceleration] if plan.compare else [plan.acceleration]
    results = run_variants(
        session, variants, plan.cases, plan.kwargs, warmup=plan.warmup, repeat=plan.repeat, track_memory=track_memory
    )
    return GenerateRun(session, load_seconds, results[-1], results[0] if plan.compare else None)


def _per_transformer(summary: Any, technique: str, lists: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Per transformer that ``technique`` changed: its statistics without the per-layer ``lists``."""
    out = {}
    for name, info in summary.transformers.items() if summary is not None else ():
        stats = info.get(technique)
        if stats:
            out[name] = {k: v for k, v in stats.items() if k not in lists}
    return out


def _layout(summary: Any) -> dict | None:
    """The mesh the run used and which of its dims cross nodes (from rank 0's summary), if it ran in parallel."""
    for info in summary.transformers.values() if summary is not None else ():
        parallel = info.get("parallel")
        if parallel is not None:
            return {"layout": parallel["layout"].split("mesh=")[-1].rstrip(")"), "topology": parallel["topology"]}
    return None


def _payload(plan: GeneratePlan, done: GenerateRun) -> dict:
    from fastdit.metrics import json_safe

    result, baseline = done.result, done.baseline
    payload: dict[str, Any] = {
        "model": plan.source.name,
        "pipeline": plan.pipeline_class.__name__,
        "out": str(plan.outputs[0])
        if len(plan.outputs) == 1
        else (str(plan.outputs[0].parent) if plan.outputs else None),
        "files": [str(p) for p in plan.outputs],
        "prompts": [c.prompt for c in plan.cases],
        "seed": plan.cases[0].seed,
        "steps": plan.num_steps,
        "height": plan.kwargs.get("height"),
        "width": plan.kwargs.get("width"),
        "device": str(plan.device),
        "dtype": str(plan.dtype).removeprefix("torch."),
        "world_size": process_count(),
        "acceleration": plain_options(plan.acceleration),
        "load": plan.loading.mode,
        "load_seconds": done.load_seconds,
        "warmup_seconds": result.warmup_seconds,
        "repeat": plan.repeat,
        "seconds": result.median_seconds,
        "seconds_per_image": result.median_seconds / len(plan.cases),
    }
    layout = _layout(result.summary)
    if layout is not None:
        payload["parallel"] = layout
    # Quantization: the mode, layer counts and weight bytes; fusion: group and layer counts, shared and recomputed
    # calls.
    for key, technique, lists in (("quantized", "quantize", ("quantized", "skipped")), ("fused", "fuse", ("groups",))):
        report = _per_transformer(result.summary, technique, lists)
        if report:
            payload[key] = report
    if "num_frames" in plan.kwargs:
        payload["frames"] = plan.kwargs["num_frames"]
    if result.cache is not None and "cache" in plan.acceleration:
        payload["cached_steps"] = result.cache.cached_steps
        payload["blocks_computed_fraction"] = result.cache.blocks_computed_fraction
    if result.peak_memory is not None:
        payload["peak_memory_bytes"] = result.peak_memory
        payload["memory_kind"] = result.memory_kind
    if baseline is not None:
        quality = compare_outputs(baseline.outputs, result.outputs, audio=result.output_kind == AUDIO)
        payload["baseline_seconds"] = baseline.median_seconds
        payload["speedup"] = baseline.median_seconds / result.median_seconds
        # Audio: waveform PSNR and SNR, spectrogram SSIM (none for a waveform too short for a spectrogram).
        for name in ("psnr", "psnr_min", "ssim", "ssim_min", "snr", "snr_min"):
            if getattr(quality, name) is not None:
                payload[name] = json_safe(getattr(quality, name))
        if baseline.peak_memory is not None:
            payload["baseline_peak_memory_bytes"] = baseline.peak_memory
    return payload


def _gib(value: int) -> str:
    return f"{value / 2**30:.2f} GiB"


def _report(payload: dict[str, Any], stream: TextIO) -> None:
    def line(label: str, text: str) -> None:
        print(f"{label:<10} {text}", file=stream)

    line("model", f"{payload['model']} ({payload['pipeline']}, {payload['device']}, {payload['dtype']})")
    line("loaded", f"{payload['load_seconds']:.2f} s")
    if payload["warmup_seconds"]:
        line("warm-up", f"{payload['warmup_seconds']:.2f} s")
    count = len(payload["prompts"])
    line(
        "latency",
        f"{payload['seconds']:.3f} s per run (median of {payload['repeat']}), {count} output{'s' * (count > 1)}, "
        f"{payload['steps']} steps",
    )
    if "blocks_computed_fraction" in payload:
        line(
            "cache",
            f"{payload['cached_steps']} steps cached, {payload['blocks_computed_fraction']:.1%} of blocks computed",
        )
    if "speedup" in payload:
        line("baseline", f"{payload['baseline_seconds']:.3f} s, speed-up {payload['speedup']:.2f}x")
        psnr, psnr_min = (f"{v:.2f}" if isinstance(v, float) else v for v in (payload["psnr"], payload["psnr_min"]))
        text = f"PSNR {psnr} dB (min {psnr_min})"
        if "ssim" in payload:
            text += f", SSIM {payload['ssim']:.4f} (min {payload['ssim_min']:.4f})"
        if "snr" in payload:
            snr = payload["snr"]
            text += f", SNR {snr:.2f} dB" if isinstance(snr, float) else f", SNR {snr} dB"
        line("quality", text)
    if "peak_memory_bytes" in payload:
        line("memory", f"{_gib(payload['peak_memory_bytes'])} ({payload['memory_kind']})")
    line("saved", ", ".join(payload["files"]) if payload["files"] else "nothing (pass --out PATH to save)")


def _save(plan: GeneratePlan, done: GenerateRun, args: argparse.Namespace) -> None:
    try:
        rate = audio_sample_rate(done.session.pipe) if done.result.output_kind == AUDIO else None
        save_outputs(plan.outputs, done.result.outputs, fps=args.fps, sample_rate=rate)
    except OSError as error:  # a full disk, a directory changed meanwhile: all or nothing, so nothing was saved
        raise CLIError(f"argument --out {args.out}: cannot save ({error}); nothing was saved") from None


def run(args: argparse.Namespace) -> int:
    """Generate, report, and save (rank 0 only).

    Args:
        args: Parsed arguments of the ``generate`` command.

    Returns:
        0 on success; under ``torchrun``, 1 when a collective lost a rank and 130 when interrupted (after one line
        on stderr per rank).

    Raises:
        CLIError: On bad input (before anything is written), or when saving fails (nothing is saved).
    """
    plan = plan_from_args(args)
    main = is_main_process()
    parallel = plan.acceleration.get("parallel")
    try:
        # The process group that accelerating with --parallel starts under torchrun ends once the runs are done;
        # a collective that lost a rank is explained while the group still exists.
        with process_group_scope(), collective_failures(parallel.timeout_s if parallel else None):
            done = execute(plan, progress=main and not args.quiet, track_memory=args.track_memory)
    except (CollectiveError, KeyboardInterrupt) as stop:
        return report_stop(stop)
    if main and plan.outputs:
        _save(plan, done, args)
    payload = _payload(plan, done)
    if not main:
        return 0
    stream = sys.stderr if args.json else sys.stdout
    _report(payload, stream)
    if args.summary and done.result.summary is not None:
        print(done.result.summary, file=stream)
    if args.json:
        print(json.dumps(payload, allow_nan=False))
    return 0
