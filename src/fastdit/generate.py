"""Load a pipeline, accelerate it, run it and time it: the logic behind ``fastdit generate`` and ``fastdit bench``.

Nothing here parses command lines or prints, so a server can drive the same code::

    source = resolve_model("flux", None)                  # or None for the built-in reference pipeline
    generator = Generator.load(source, device="cuda", dtype=torch.bfloat16)
    generator.accelerate(cache=fastdit.FBCache(0.12))
    kwargs = call_arguments(generator.pipeline_class, source.defaults, {"num_inference_steps": 28})
    result = generator.run([Case("a cat", seed=0)], kwargs, warmup=1, repeat=3)
    result.outputs[0], result.median_seconds, result.cache.blocks_computed_fraction

Outputs are float32 arrays in [0, 1]: ``(H, W, C)`` for an image, ``(F, H, W, C)`` for a video. Every prompt runs as
its own pipeline call with a generator seeded from its :class:`Case`, so an image depends on its prompt and seed only,
not on the other prompts of the batch.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

import fastdit
from fastdit.models.registry import get_preset

__all__ = [
    "REFERENCE_MODEL",
    "CacheStats",
    "Case",
    "Generator",
    "MemoryTracker",
    "ModelSource",
    "RunResult",
    "call_arguments",
    "call_parameters",
    "compare_outputs",
    "default_prompts",
    "default_steps",
    "frame_multiple",
    "import_pipeline_class",
    "is_main_process",
    "is_video_pipeline",
    "output_paths",
    "process_count",
    "resolve_model",
    "save_output",
    "size_multiple",
]

REFERENCE_MODEL = "reference"
"""The model name reports use for the built-in reference pipeline."""

# Varied subjects for benchmarks of models that take free text (the reference pipeline has its own digit prompts).
_BENCH_PROMPTS: tuple[str, ...] = (
    "a cat holding a sign that says hello world",
    "a lighthouse on a cliff at sunset, oil painting",
    "a bowl of ramen on a wooden table, photograph",
    "an astronaut riding a horse on the moon",
    "a watercolor map of an imaginary island",
    "a red vintage car parked in a snowy street",
    "a close-up portrait of an old fisherman",
    "a futuristic city skyline at night with neon lights",
)


@dataclass(frozen=True)
class ModelSource:
    """Where a pipeline comes from and the call arguments it runs with by default.

    Attributes:
        name: Registry preset name, :data:`REFERENCE_MODEL`, or the directory for a bare ``--model-path``.
        pipeline_class: Fully qualified pipeline class, e.g. ``"diffusers.FluxPipeline"``.
        path: The local weights directory (``None`` for the reference pipeline).
        defaults: Call arguments of the preset (steps, guidance, size, ...).
        reference: Whether this is the built-in reference pipeline.
    """

    name: str
    pipeline_class: str
    path: Path | None = None
    defaults: Mapping[str, Any] = field(default_factory=dict)
    reference: bool = False


def _weights_dir(text: str, origin: str) -> Path:
    path = Path(text).expanduser()
    if not path.is_dir():
        raise ValueError(f"{origin}: no such directory")
    if not (path / "model_index.json").is_file():
        raise ValueError(f"{origin}: not a diffusers pipeline directory (no model_index.json)")
    return path


def _class_from_index(path: Path, origin: str) -> str:
    try:
        index = json.loads((path / "model_index.json").read_text())
        return f"diffusers.{index['_class_name']}"
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{origin}: unreadable model_index.json ({error})") from error


def _reference_source() -> ModelSource:
    # Imported here: the reference package is optional in a source checkout without its weights.
    from fastdit.reference import REFERENCE_DEFAULTS, reference_dir

    try:
        path = reference_dir()
    except FileNotFoundError as error:
        raise ValueError(f"the built-in reference pipeline is not available: {error}") from error
    return ModelSource(
        REFERENCE_MODEL, "diffusers.FluxPipeline", path=path, defaults=dict(REFERENCE_DEFAULTS), reference=True
    )


def resolve_model(name: str | None, model_path: str | None, environ: Mapping[str, str] | None = None) -> ModelSource:
    """Find the pipeline a user asked for, without loading it.

    Args:
        name: A registry preset name (``fastdit list``), or ``None`` for the reference pipeline (or, with
            ``model_path``, whatever pipeline that directory holds).
        model_path: A local ``save_pretrained`` directory; for a preset it overrides the preset's environment
            variable (e.g. ``FLUX_DIR``).
        environ: Environment to read the variable from (default ``os.environ``).

    Returns:
        The source.

    Raises:
        ValueError: Unknown model, no weights directory given, or a directory that is not a pipeline; the message
            names the flag or variable that supplied the value.
    """
    environ = os.environ if environ is None else environ
    if name is None and model_path is None:
        return _reference_source()
    if name is None:
        origin = f"--model-path {model_path}"
        path = _weights_dir(model_path, origin)
        return ModelSource(str(path), _class_from_index(path, origin), path=path)
    try:
        preset, _ = get_preset(name)
    except LookupError as error:
        raise ValueError(f"MODEL {name!r}: {error}, or pass a pipeline directory with --model-path") from None
    if model_path is not None:
        path = _weights_dir(model_path, f"--model-path {model_path}")
    elif environ.get(preset.env_var):
        path = _weights_dir(environ[preset.env_var], f"{preset.env_var}={environ[preset.env_var]}")
    else:
        raise ValueError(
            f"MODEL {name!r} needs its weights (fastdit never downloads): pass --model-path DIR or set "
            f"{preset.env_var}=DIR (a local copy of {preset.hub_id or 'the pipeline'})"
        )
    return ModelSource(name, preset.pipeline_class, path=path, defaults=dict(preset.defaults))


def import_pipeline_class(qualified: str) -> type:
    """Import ``"package.Class"`` (e.g. ``"diffusers.FluxPipeline"``).

    Raises:
        ValueError: If the module or class does not exist.
    """
    module_name, _, class_name = qualified.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"pipeline class {qualified!r} cannot be imported: {error}") from error


def call_parameters(pipeline_class: type) -> dict[str, inspect.Parameter]:
    """The keyword parameters of a pipeline's ``__call__`` (what a call may pass)."""
    parameters = inspect.signature(pipeline_class.__call__).parameters
    return {name: p for name, p in parameters.items() if name != "self" and p.kind is not p.VAR_POSITIONAL}


def is_video_pipeline(pipeline_class: type) -> bool:
    """Whether the pipeline produces videos (it takes a number of frames)."""
    return "num_frames" in call_parameters(pipeline_class)


def call_arguments(pipeline_class: type, defaults: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Merge preset defaults with the user's values, keeping only what the pipeline's ``__call__`` accepts.

    Defaults a pipeline does not take are dropped silently (presets are shared by pipeline variants); a user value it
    does not take is an error, because silently ignoring what was asked for would mislead.

    Raises:
        ValueError: Naming the parameters ``pipeline_class`` does not accept.
    """
    accepted = call_parameters(pipeline_class)
    unknown = sorted(k for k in overrides if k not in accepted)
    if unknown:
        raise ValueError(f"{pipeline_class.__name__} does not take {', '.join(unknown)}")
    merged = {k: v for k, v in defaults.items() if k in accepted}
    merged.update(overrides)
    if "output_type" in accepted:
        merged["output_type"] = "np"
    return merged


def default_steps(pipeline_class: type, kwargs: Mapping[str, Any]) -> int | None:
    """The number of denoising steps a call with ``kwargs`` runs (the signature's default if not given)."""
    if "num_inference_steps" in kwargs:
        return kwargs["num_inference_steps"]
    parameter = call_parameters(pipeline_class).get("num_inference_steps")
    default = None if parameter is None else parameter.default
    return default if isinstance(default, int) else None


def default_prompts(source: ModelSource, count: int) -> list[str]:
    """``count`` benchmark prompts: the reference pipeline's digit prompts, or varied scenes for other models."""
    if source.reference:
        from fastdit.reference import digit_prompt

        return [digit_prompt(i % 10) for i in range(count)]
    return [_BENCH_PROMPTS[i % len(_BENCH_PROMPTS)] for i in range(count)]


def _spatial(value: Any) -> int | None:
    if isinstance(value, int):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[-1], int):
        return value[-1]  # (t, h, w) patches of video transformers: the last entry is spatial
    return None


def size_multiple(pipe: Any) -> int:
    """What height and width must be multiples of for ``pipe`` to run them unchanged.

    The least common multiple of the image (or video) processor's factor, which covers latent packing (FLUX packs 2x2
    latents, so its processor factor is twice the VAE's), and the VAE factor times the transformer's patch size.
    """
    processor = getattr(pipe, "image_processor", None) or getattr(pipe, "video_processor", None)
    processor_factor = getattr(getattr(processor, "config", None), "vae_scale_factor", None) or 1
    vae_factor = getattr(pipe, "vae_scale_factor_spatial", None) or getattr(pipe, "vae_scale_factor", None) or 1
    transformer = getattr(pipe, "transformer", None)
    patch = _spatial(getattr(getattr(transformer, "config", None), "patch_size", None)) or 1
    return math.lcm(int(processor_factor), int(vae_factor) * int(patch))


def frame_multiple(pipe: Any) -> int | None:
    """Video pipelines: ``num_frames - 1`` must be a multiple of this (the VAE's temporal factor); else ``None``.

    Causal video VAEs keep the first frame and compress the rest by their temporal factor, so other counts are
    rounded by the pipeline.
    """
    factor = getattr(pipe, "vae_scale_factor_temporal", None)
    return int(factor) if isinstance(factor, int) and factor > 1 else None


@dataclass(frozen=True)
class Case:
    """One image to generate: a prompt (``None`` for pipelines without one) and the seed of its noise."""

    prompt: str | None
    seed: int = 0


@dataclass
class CacheStats:
    """Cache statistics summed over the calls of one pass (see :func:`fastdit.summary`)."""

    cached_steps: int = 0
    blocks_computed: int = 0
    blocks_total: int = 0

    @property
    def blocks_computed_fraction(self) -> float:
        """Blocks computed / blocks a run without cache computes (1.0 when nothing was counted)."""
        return self.blocks_computed / self.blocks_total if self.blocks_total else 1.0

    def add(self, summary: fastdit.Summary) -> None:
        """Add the statistics of one pipeline call."""
        for info in summary.transformers.values():
            stats = info.get("cache")
            if stats:
                self.cached_steps += stats["num_cached_steps"]
                self.blocks_computed += stats["blocks_computed"]
                self.blocks_total += stats["blocks_total"]


class MemoryTracker:
    """Peak memory of a stretch of work: CUDA max allocated on GPUs, the process's peak RSS on CPU.

    On Linux the RSS high-water mark is reset through ``/proc/self/clear_refs``, so each stretch is measured on its
    own; where that is not possible the peak is the process's peak so far (:attr:`resettable` is ``False``).
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.resettable = self.device.type == "cuda"
        self.kind = "CUDA max allocated" if self.device.type == "cuda" else "process peak RSS"

    def reset(self) -> None:
        """Start a new measurement."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")  # 5 resets the peak RSS to the current RSS (proc(5), Linux 4.0+)
            self.resettable = True
        except OSError:
            self.resettable = False

    def peak(self) -> int | None:
        """Peak bytes since :meth:`reset` (``None`` where the platform cannot tell)."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        try:
            with open("/proc/self/status") as handle:
                for line in handle:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass  # not Linux: fall back to getrusage below
        if sys.platform == "win32":
            return None
        import resource

        scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB elsewhere
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * scale


@dataclass
class RunResult:
    """What :meth:`Generator.run` measured.

    Attributes:
        outputs: One float32 array in [0, 1] per case, from the last timed pass.
        seconds: Wall time of each timed pass over all cases.
        call_seconds: Wall time of each pipeline call of the timed passes.
        warmup_seconds: Total wall time of the warm-up calls.
        cache: Cache statistics of the last pass (``None`` when the pipeline is not accelerated).
        summary: :func:`fastdit.summary` of the last call (``None`` when the pipeline is not accelerated).
        peak_memory: Peak bytes over the timed passes (``None`` unless tracked).
        memory_kind: What :attr:`peak_memory` measures.
    """

    outputs: list[np.ndarray] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    call_seconds: list[float] = field(default_factory=list)
    warmup_seconds: float = 0.0
    cache: CacheStats | None = None
    summary: fastdit.Summary | None = None
    peak_memory: int | None = None
    memory_kind: str = ""

    def extend(self, later: RunResult) -> None:
        """Add the passes of a later run of the same variant (outputs and statistics are the later ones)."""
        self.outputs = later.outputs
        self.seconds += later.seconds
        self.call_seconds += later.call_seconds
        self.warmup_seconds += later.warmup_seconds
        self.cache, self.summary = later.cache, later.summary
        if later.peak_memory is not None:
            self.peak_memory = max(self.peak_memory or 0, later.peak_memory)
            self.memory_kind = later.memory_kind

    @property
    def median_seconds(self) -> float:
        """Median wall time of one pass over all cases."""
        return statistics.median(self.seconds)

    @property
    def median_call_seconds(self) -> float:
        """Median wall time of one pipeline call (one image or video)."""
        return statistics.median(self.call_seconds)


def _to_array(item: Any) -> np.ndarray:
    if isinstance(item, torch.Tensor):
        item = item.detach().float().cpu().numpy()
    if isinstance(item, (list, tuple)):  # a video as a list of PIL frames or arrays
        return np.stack([_to_array(frame) for frame in item])
    array = np.asarray(item)
    if array.dtype == np.uint8:
        return array.astype(np.float32) / 255.0
    return np.clip(array.astype(np.float32), 0.0, 1.0)


def _first_output(result: Any) -> np.ndarray:
    batch = result.frames if hasattr(result, "frames") else result.images
    return _to_array(batch[0])


@contextlib.contextmanager
def _loading_bars(show: bool) -> Iterator[None]:
    """Hide diffusers' and transformers' loading bars unless ``show`` (their switches are global: restore them)."""
    if show:
        yield
        return
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    switches = [(m, m.is_progress_bar_enabled()) for m in (diffusers_logging, transformers_logging)]
    for module, _ in switches:
        module.disable_progress_bar()
    try:
        yield
    finally:
        for module, was_enabled in switches:
            if was_enabled:
                module.enable_progress_bar()


class Generator:
    """A loaded pipeline plus what it takes to run and time it.

    Attributes:
        pipe: The diffusers pipeline.
        source: Where it came from.
        device: The device it runs on.
        load_seconds: Wall time of loading it (weights and the move to ``device``).
    """

    def __init__(self, pipe: Any, source: ModelSource, device: torch.device, load_seconds: float = 0.0) -> None:
        self.pipe = pipe
        self.source = source
        self.device = device
        self.load_seconds = load_seconds
        self.accelerated = False

    @classmethod
    def load(
        cls, source: ModelSource, *, device: torch.device | str, dtype: torch.dtype, progress: bool = False
    ) -> Generator:
        """Load ``source`` onto ``device`` in ``dtype`` (local files only).

        Args:
            source: From :func:`resolve_model`.
            device: Where every component goes.
            dtype: Parameter dtype.
            progress: Show the pipeline's progress bar over denoising steps.
        """
        device = torch.device(device)
        start = time.perf_counter()
        with _loading_bars(progress):
            if source.reference:
                from fastdit.reference import load_reference_pipeline

                pipe = load_reference_pipeline(device, dtype)
            else:
                pipeline_class = import_pipeline_class(source.pipeline_class)
                pipe = pipeline_class.from_pretrained(source.path, dtype=dtype, local_files_only=True).to(device)
        pipe.set_progress_bar_config(disable=not progress, leave=False)
        return cls(pipe, source, device, time.perf_counter() - start)

    @property
    def pipeline_class(self) -> type:
        """The pipeline's class."""
        return type(self.pipe)

    def accelerate(self, **options: Any) -> None:
        """:func:`fastdit.accelerate` the pipeline (``cache=``, ``parallel=``, ``compile=``, ``attention=``)."""
        fastdit.accelerate(self.pipe, **options)
        self.accelerated = True

    def disable(self) -> None:
        """Undo :meth:`accelerate` (a no-op when not accelerated)."""
        if self.accelerated:
            fastdit.disable(self.pipe)
            self.accelerated = False

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _call(self, case: Case, kwargs: Mapping[str, Any]) -> tuple[np.ndarray, float]:
        call = dict(kwargs)
        if case.prompt is not None:
            call["prompt"] = case.prompt
        # A CPU generator gives the same noise on every device, so a GPU run is comparable to a CPU one.
        call["generator"] = torch.Generator("cpu").manual_seed(case.seed)
        self._sync()
        start = time.perf_counter()
        result = self.pipe(**call)
        self._sync()
        return _first_output(result), time.perf_counter() - start

    @contextlib.contextmanager
    def variant(self, options: Mapping[str, Any] | None) -> Iterator[None]:
        """Run the block accelerated with ``options`` (none or empty: plain), then restore the plain pipeline."""
        if not options:
            yield
            return
        self.accelerate(**options)
        try:
            yield
        finally:
            self.disable()

    def run(
        self,
        cases: Sequence[Case],
        kwargs: Mapping[str, Any],
        *,
        warmup: int = 0,
        repeat: int = 1,
        track_memory: bool = False,
    ) -> RunResult:
        """Generate every case ``repeat`` times, as the pipeline is now, after ``warmup`` untimed calls of the first.

        Args:
            cases: What to generate.
            kwargs: Call arguments from :func:`call_arguments` (no prompt or generator).
            warmup: Untimed calls before timing (compilation, allocator and kernel caches).
            repeat: Timed passes over all cases; reports use the median.
            track_memory: Measure peak memory over the timed passes.
        """
        if not cases or repeat < 1 or warmup < 0:
            raise ValueError(
                f"need at least one case and repeat >= 1, warmup >= 0; got {len(cases)}, {repeat}, {warmup}"
            )
        result = RunResult(warmup_seconds=sum(self._call(cases[0], kwargs)[1] for _ in range(warmup)))
        memory = MemoryTracker(self.device) if track_memory else None
        if memory is not None:
            memory.reset()
        for _ in range(repeat):
            result.outputs, result.cache = [], CacheStats() if self.accelerated else None
            for case in cases:
                output, elapsed = self._call(case, kwargs)
                result.outputs.append(output)
                result.call_seconds.append(elapsed)
                if result.cache is not None:
                    result.summary = fastdit.summary(self.pipe)
                    result.cache.add(result.summary)
            result.seconds.append(sum(result.call_seconds[-len(cases) :]))
        if memory is not None:
            result.peak_memory, result.memory_kind = memory.peak(), memory.kind
        return result

    def run_variants(
        self,
        variants: Sequence[Mapping[str, Any] | None],
        cases: Sequence[Case],
        kwargs: Mapping[str, Any],
        *,
        warmup: int = 0,
        repeat: int = 1,
        track_memory: bool = False,
    ) -> list[RunResult]:
        """Run several accelerations (``None`` or ``{}``: plain) on the same cases, interleaved pass by pass.

        Each variant is warmed up first; then every round runs one timed pass of each variant in turn. A change of
        machine load during the measurement (other processes, clocks, thermals) then slows every variant alike
        instead of whichever happened to run at the time, so ratios between variants stay meaningful.

        Args:
            variants: ``fastdit.accelerate`` keyword arguments per variant.
            cases: What to generate.
            kwargs: Call arguments from :func:`call_arguments`.
            warmup: Untimed calls per variant.
            repeat: Timed passes per variant.
            track_memory: Measure each variant's peak memory.

        Returns:
            One result per variant, in order.
        """
        results = [RunResult() for _ in variants]
        for result, options in zip(results, variants, strict=True):
            with self.variant(options):
                result.warmup_seconds = sum(self._call(cases[0], kwargs)[1] for _ in range(warmup))
        for _ in range(repeat):
            for result, options in zip(results, variants, strict=True):
                with self.variant(options):
                    result.extend(self.run(cases, kwargs, track_memory=track_memory))
        return results


def compare_outputs(reference: Sequence[np.ndarray], test: Sequence[np.ndarray]) -> Any:
    """PSNR and SSIM of ``test`` against ``reference``, frame by frame over every output.

    Returns:
        A :class:`fastdit.metrics.Comparison` (means and minima over all images or frames).
    """
    from fastdit.metrics import compare

    def frames(outputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        return [frame for output in outputs for frame in (output if output.ndim == 4 else [output])]

    return compare(frames(reference), frames(test))


def output_paths(out: Path, count: int, suffix: str) -> list[Path]:
    """Where ``count`` outputs go: ``out`` itself for one, ``out/0000<suffix>``, ... in order for several."""
    if count == 1:
        return [out]
    return [out / f"{index:04d}{suffix}" for index in range(count)]


def save_output(path: Path, output: np.ndarray, *, fps: float = 8.0) -> Path:
    """Atomically save one output: an image, or a video when ``output`` has a frame axis."""
    from fastdit.io import save_image, save_video

    if output.ndim == 4:
        return save_video(path, output, fps=fps)
    return save_image(path, output)


def process_count(environ: Mapping[str, str] | None = None) -> int:
    """Processes of this run: ``WORLD_SIZE`` under ``torchrun``, else 1."""
    environ = os.environ if environ is None else environ
    text = environ.get("WORLD_SIZE", "1")
    try:
        return max(1, int(text))
    except ValueError:
        raise ValueError(f"environment variable WORLD_SIZE={text!r}: must be an integer") from None


def is_main_process(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process writes outputs: ``RANK`` unset or 0."""
    environ = os.environ if environ is None else environ
    return environ.get("RANK", "0").strip() in ("", "0")
