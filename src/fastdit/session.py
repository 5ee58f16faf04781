"""Resolve a model, load its pipeline, accelerate it and call it: what every front end (CLI, scripts, a server) drives.

Nothing here parses command lines, prints or times; :mod:`fastdit.bench` times and compares on top of it::

    source = resolve_model("flux", None)                  # or (None, None) for the built-in reference pipeline
    session = Session.load(source, device="cuda", dtype=torch.bfloat16)
    session.accelerate(cache=fastdit.FBCache(0.12))
    kwargs = call_arguments(session.pipeline_class, source.defaults, {"num_inference_steps": 28})
    image = session.call(Case("a cat", seed=0), kwargs)

Outputs are float32 arrays in [0, 1]: ``(H, W, C)`` for an image, ``(F, H, W, C)`` for a video; an audio pipeline's
(its result has ``audios``) are ``(channels, samples)`` waveforms, full scale [-1, 1], as the pipeline produced them
(not clipped: some pipelines clamp, others leave that to the file writer; :attr:`Session.output_kind` says which
kind the last call produced). :meth:`Session.call`
runs one prompt per pipeline call with a generator seeded from its :class:`Case`, so an output depends on its prompt
and seed only. An output holding NaN or infinite values is never returned: the call raises
:class:`fastdit.errors.NonFiniteOutputError` (a :class:`FloatingPointError`) naming the likely cause, because clipped
to [0, 1] it would look like a valid (black) image. :func:`save_outputs` writes several outputs all or nothing.

Errors about a value the caller supplied raise :class:`fastdit.errors.FieldError`, which front ends map to their own
flags or request fields. The fields, by owner:

- ``"model"``: ``"loading"`` (a broadcasting load mode for a ModularPipeline), ``"name"`` (an unknown registry
  name; value ``None``: the reference pipeline is unavailable),
  ``"model_path"`` (a directory that is not a pipeline, is broken, holds another pipeline than the registered
  model's, or fails to load; value ``None``: a registered model without weights), ``"env:<VARIABLE>"`` (the same
  for a directory read from a preset's variable, e.g. ``"env:FLUX_DIR"``), ``"pipeline_class"`` (a class that cannot
  be imported);
- ``"call"``: a ``__call__`` parameter (``"height"``, ``"num_frames"``, ...) the pipeline does not take or cannot
  run as given, or ``"seed"`` (a :class:`Case`'s seed outside [0, :data:`MAX_SEED`]).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

import fastdit
from fastdit import modular, pipeline_dir
from fastdit.config import Loading
from fastdit.errors import FieldError, NonFiniteOutputError
from fastdit.models.registry import get_preset

__all__ = [
    "AUDIO",
    "CALL_OWNER",
    "MAX_SEED",
    "MODEL_OWNER",
    "REFERENCE_MODEL",
    "Case",
    "ModelSource",
    "Session",
    "audio_sample_rate",
    "call_arguments",
    "call_parameters",
    "check_size",
    "default_steps",
    "frame_multiple",
    "import_pipeline_class",
    "is_audio_pipeline",
    "is_video_pipeline",
    "output_kind",
    "output_paths",
    "resolve_model",
    "save_output",
    "save_outputs",
    "size_multiple",
]

REFERENCE_MODEL = "reference"
"""The model name reports use for the built-in reference pipeline."""

MODEL_OWNER = "model"
"""The :attr:`~fastdit.errors.FieldError.owner` of errors about which model to load (see the module docstring)."""

CALL_OWNER = "call"
"""The :attr:`~fastdit.errors.FieldError.owner` of errors about a pipeline call's arguments."""

MAX_SEED = 2**63 - 1
"""The largest seed a :class:`Case` takes: seeds are signed 64-bit integers wherever they are stored or reported."""


@dataclass(frozen=True)
class ModelSource:
    """Where a pipeline comes from and the call arguments it runs with by default.

    Attributes:
        name: Registry preset name, :data:`REFERENCE_MODEL`, or the directory when only a directory was given.
        pipeline_class: Fully qualified pipeline class, e.g. ``"diffusers.FluxPipeline"``.
        path: The local weights directory.
        defaults: Call arguments of the preset (steps, guidance, size, ...).
        reference: Whether this is the built-in reference pipeline.
        path_field: The :class:`~fastdit.errors.FieldError` field that gave :attr:`path` (``"model_path"`` or
            ``"env:<VARIABLE>"``), which errors found while loading it name.
    """

    name: str
    pipeline_class: str
    path: Path | None = None
    defaults: Mapping[str, Any] = field(default_factory=dict)
    reference: bool = False
    path_field: str = "model_path"


def _weights_dir(text: str, field_name: str) -> tuple[Path, dict[str, Any]]:
    """The directory ``text`` and its ``model_index.json``, once the checks that need no weights passed."""
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        index_file = path.name in ("model_index.json", modular.INDEX_FILE)
        hint = ": give the directory that holds it" if index_file else ""
        raise FieldError(MODEL_OWNER, field_name, text, f"is a file, not a directory{hint}")
    if not path.is_dir():
        raise FieldError(MODEL_OWNER, field_name, text, "no such directory")
    if not any((path / name).is_file() for name in ("model_index.json", modular.INDEX_FILE)):
        raise FieldError(
            MODEL_OWNER,
            field_name,
            text,
            f"not a diffusers pipeline directory (no model_index.json or {modular.INDEX_FILE})",
        )
    try:
        index = pipeline_dir.read_index(path)
        pipeline_dir.check_components(path, index)
    except ValueError as error:
        raise FieldError(MODEL_OWNER, field_name, text, str(error)) from None
    return path, index


def _check_holds(index: Mapping[str, Any], preset_class: str, text: str, field_name: str, name: str) -> None:
    """Refuse a directory holding another pipeline than the registered model ``name`` runs."""
    if f"diffusers.{index['_class_name']}" == preset_class:
        return  # the usual case: nothing to import
    try:
        pipeline_dir.check_pipeline_class(index, import_pipeline_class(preset_class))
    except ValueError as error:
        raise FieldError(
            MODEL_OWNER,
            field_name,
            text,
            f"{error} that model {name!r} runs; leave out the model name to run the directory's own pipeline",
        ) from None


def _reference_source() -> ModelSource:
    # Imported here: the reference package is optional in a source checkout without its weights.
    from fastdit.reference import REFERENCE_DEFAULTS, reference_dir

    try:
        path = reference_dir()
    except FileNotFoundError as error:
        raise FieldError(
            MODEL_OWNER, "name", None, f"the built-in reference pipeline is not available: {error}"
        ) from error
    return ModelSource(
        REFERENCE_MODEL, "diffusers.FluxPipeline", path=path, defaults=dict(REFERENCE_DEFAULTS), reference=True
    )


def resolve_model(name: str | None, model_path: str | None, environ: Mapping[str, str] | None = None) -> ModelSource:
    """Find the pipeline a caller asked for, without loading it.

    Args:
        name: A registry preset name (:func:`fastdit.models.registry.all_presets`), or ``None`` for the reference
            pipeline (or, with ``model_path``, whatever pipeline that directory holds).
        model_path: A local ``save_pretrained`` directory; for a preset it overrides the preset's environment
            variable (e.g. ``FLUX_DIR``).
        environ: Environment to read the variable from (default ``os.environ``).

    Returns:
        The source.

    Raises:
        FieldError: Owner ``"model"``; field ``"name"`` for an unknown name, ``"model_path"`` or
            ``"env:<VARIABLE>"`` for a directory that is not a pipeline, ``"model_path"`` with value ``None`` for a
            registered model whose weights were given neither way.
    """
    environ = os.environ if environ is None else environ
    if name is None and model_path is None:
        return _reference_source()
    if name is None:
        path, index = _weights_dir(model_path, "model_path")
        return ModelSource(str(path), f"diffusers.{index['_class_name']}", path=path)
    try:
        preset, _ = get_preset(name)
    except LookupError:
        raise FieldError(MODEL_OWNER, "name", name, "not a registered model name") from None
    if model_path is not None:
        text, field_name = model_path, "model_path"
    elif environ.get(preset.env_var):
        text, field_name = environ[preset.env_var], f"env:{preset.env_var}"
    else:
        raise FieldError(
            MODEL_OWNER,
            "model_path",
            None,
            f"model {name!r} needs a local copy of {preset.hub_id or 'its pipeline'} (fastdit never downloads): "
            f"give its directory, or set the environment variable {preset.env_var}",
        )
    path, index = _weights_dir(text, field_name)
    _check_holds(index, preset.pipeline_class, text, field_name, name)
    return ModelSource(name, preset.pipeline_class, path=path, defaults=dict(preset.defaults), path_field=field_name)


class _DropBackendFallbackNotes(logging.Filter):
    """Drops transformers' notes that an image processor falls back to its PIL version without torchvision.

    Importing a diffusers pipeline module imports image processors it may never use; without torchvision each one
    prints a line (two for the usual pipelines) that would precede every later message of a command, errors included.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "requires torchvision (not installed); falling back" not in record.getMessage()


@contextlib.contextmanager
def _quiet_pipeline_imports() -> Iterator[None]:
    """Apply :class:`_DropBackendFallbackNotes` to transformers' import logger, for the block only."""
    logger = logging.getLogger("transformers.utils.import_utils")
    notes = _DropBackendFallbackNotes()
    logger.addFilter(notes)
    try:
        yield
    finally:
        logger.removeFilter(notes)


def import_pipeline_class(qualified: str) -> type:
    """Import ``"package.Class"`` (e.g. ``"diffusers.FluxPipeline"``).

    Raises:
        FieldError: Owner ``"model"``, field ``"pipeline_class"``: the module or class does not exist.
    """
    module_name, _, class_name = qualified.rpartition(".")
    try:
        with _quiet_pipeline_imports():
            return getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as error:
        raise FieldError(MODEL_OWNER, "pipeline_class", qualified, f"cannot be imported: {error}") from error


def call_parameters(pipeline_class: type) -> dict[str, inspect.Parameter]:
    """The keyword parameters of a pipeline's ``__call__`` (what a call may pass); a ModularPipeline's are its
    blocks' inputs (:func:`fastdit.modular.call_parameters`)."""
    if modular.is_modular(pipeline_class):
        return modular.call_parameters(pipeline_class)
    parameters = inspect.signature(pipeline_class.__call__).parameters
    return {name: p for name, p in parameters.items() if name != "self" and p.kind is not p.VAR_POSITIONAL}


def is_audio_pipeline(pipeline_class: type) -> bool:
    """Whether the pipeline produces waveforms: its ``__call__`` is annotated to return an ``AudioPipelineOutput``."""
    annotation = inspect.signature(pipeline_class.__call__).return_annotation
    return "AudioPipelineOutput" in (annotation if isinstance(annotation, str) else repr(annotation))


def is_video_pipeline(pipeline_class: type) -> bool:
    """Whether the pipeline produces videos (it takes a number of frames; a ModularPipeline: it outputs videos)."""
    if modular.is_modular(pipeline_class):
        return modular.decoded_output(pipeline_class) == "videos"
    return "num_frames" in call_parameters(pipeline_class)


def call_arguments(pipeline_class: type, defaults: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Merge preset defaults with the caller's values, keeping only what the pipeline's ``__call__`` accepts.

    Defaults a pipeline does not take are dropped silently (presets are shared by pipeline variants); a value the
    caller gave that it does not take is an error, because silently ignoring what was asked for would mislead.

    Raises:
        FieldError: Owner ``"call"``, field the first parameter ``pipeline_class`` does not accept (the requirement
            names them all).
    """
    accepted = call_parameters(pipeline_class)
    unknown = sorted(k for k in overrides if k not in accepted)
    if unknown:
        first = unknown[0]
        raise FieldError(
            CALL_OWNER, first, overrides[first], f"{pipeline_class.__name__} does not take {', '.join(unknown)}"
        )
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


def check_size(pipe: Any, kwargs: Mapping[str, Any]) -> None:
    """Reject a height, width or frame count the loaded pipeline would silently round.

    Raises:
        FieldError: Owner ``"call"``, field ``"height"``, ``"width"`` or ``"num_frames"``; see
            :func:`size_multiple` and :func:`frame_multiple`.
    """
    multiple = size_multiple(pipe)
    for name in ("height", "width"):
        value = kwargs.get(name)
        if isinstance(value, int) and value % multiple:
            raise FieldError(
                CALL_OWNER,
                name,
                value,
                f"must be a multiple of {multiple} for {type(pipe).__name__} (VAE factor × patch size)",
            )
    frames, temporal = kwargs.get("num_frames"), frame_multiple(pipe)
    if isinstance(frames, int) and temporal is not None and (frames - 1) % temporal:
        raise FieldError(
            CALL_OWNER,
            "num_frames",
            frames,
            f"must be one more than a multiple of {temporal} for {type(pipe).__name__} (temporal VAE factor), "
            f"e.g. {(frames - 1) // temporal * temporal + 1}",
        )


@dataclass(frozen=True)
class Case:
    """One output to generate: a prompt (``None`` for pipelines without one) and the seed of its noise.

    Raises:
        FieldError: Owner ``"call"``, field ``"seed"``: not an integer in [0, :data:`MAX_SEED`].
    """

    prompt: str | None
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED:
            raise FieldError(CALL_OWNER, "seed", self.seed, f"must be an integer from 0 to {MAX_SEED} (2**63 - 1)")


def _to_array(item: Any) -> np.ndarray:
    """A float32 array of one output, uint8 scaled to [0, 1], floats as they are (not clipped: see _finite)."""
    if isinstance(item, torch.Tensor):
        item = item.detach().float().cpu().numpy()
    if isinstance(item, (list, tuple)):  # a video as a list of PIL frames or arrays
        return np.stack([_to_array(frame) for frame in item])
    array = np.asarray(item)
    if array.dtype == np.uint8:
        return array.astype(np.float32) / 255.0
    return array.astype(np.float32)


AUDIO = "audio"
"""The :attr:`Session.output_kind` of waveforms (a diffusers ``AudioPipelineOutput``'s ``audios``)."""
_KINDS = {"frames": "video", "images": "image", "image": "image", "video": "video", "audios": AUDIO}


def output_kind(result: Any) -> str:
    """``"video"``, ``"image"`` or ``"audio"``: what a pipeline result holds, by the attribute that holds it."""
    return next((kind for name, kind in _KINDS.items() if hasattr(result, name)), "image")


def _outputs(result: Any) -> list[np.ndarray]:
    # Videos come as .frames, images as .images, except a few pipelines' outputs that name them .image (Kandinsky 5)
    # or .video (Cosmos 3); audio pipelines return .audios; SANA-WM's refiner returns its tensor bare.
    if isinstance(result, (torch.Tensor, np.ndarray)):
        return [_to_array(item) for item in result]
    name = next((name for name in _KINDS if hasattr(result, name)), "images")
    return [_to_array(item) for item in getattr(result, name)]


# Guidance scales are usually between 1 and 20; far above, the difference of two predictions is blown up past the
# range of the latents.
_LARGE_GUIDANCE = 100.0


def _suspect_arguments(call: Mapping[str, Any]) -> dict[str, Any]:
    """Call arguments that can turn an output non-finite: numbers that are not finite, huge guidance scales."""
    suspects = {}
    for name, value in call.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        guidance = "guidance" in name or "cfg" in name
        if not math.isfinite(value) or (guidance and abs(value) > _LARGE_GUIDANCE):
            suspects[name] = value
    return suspects


def _non_finite_components(pipe: Any) -> tuple[str, ...]:
    """Components of ``pipe`` with a NaN or infinite parameter or buffer (read only once an output was bad)."""
    found = []
    for name, component in getattr(pipe, "components", {}).items():
        if not isinstance(component, torch.nn.Module):
            continue
        tensors = [*component.parameters(), *component.buffers()]
        if any(t.is_floating_point() and not t.is_meta and not bool(torch.isfinite(t).all()) for t in tensors):
            found.append(name)
    return tuple(found)


def _uses_float16(pipe: Any) -> bool:
    modules = [c for c in getattr(pipe, "components", {}).values() if isinstance(c, torch.nn.Module)]
    return any(p.dtype == torch.float16 for module in modules for p in module.parameters())


def _finite(pipe: Any, outputs: list[np.ndarray], call: Mapping[str, Any], kind: str = "image") -> list[np.ndarray]:
    """``outputs`` clipped to [0, 1] (waveforms as they are), or :class:`NonFiniteOutputError` if any value is NaN
    or infinite.

    Checked before clipping, which would turn +inf into white and leave NaN to become black when saved. Under
    context parallelism every rank holds the same gathered outputs, so every rank raises alike.
    """
    count = sum(int(np.count_nonzero(~np.isfinite(output))) for output in outputs)
    if count:
        raise NonFiniteOutputError(
            count,
            sum(output.size for output in outputs),
            arguments=_suspect_arguments(call),
            components=_non_finite_components(pipe),
            float16=_uses_float16(pipe),
        )
    if kind == AUDIO:  # a waveform is not clipped: its peaks are part of what a comparison must see
        return outputs
    return [np.clip(output, 0.0, 1.0) for output in outputs]


def _generator(seed: int) -> torch.Generator:
    # A CPU generator gives the same noise on every device, so a GPU run is comparable to a CPU one.
    return torch.Generator("cpu").manual_seed(seed)


# What from_pretrained raises for a directory it cannot load (configs it cannot parse, weights that do not fit the
# model, files safetensors refuses). Out-of-memory errors are RuntimeErrors too, but say nothing about the directory.
def _load_errors() -> tuple[type[BaseException], ...]:
    from safetensors import SafetensorError

    return (OSError, ValueError, KeyError, RuntimeError, SafetensorError)


def _from_pretrained(source: ModelSource, dtype: torch.dtype) -> Any:
    pipeline_class = import_pipeline_class(source.pipeline_class)
    try:
        if modular.is_modular(pipeline_class):
            return modular.load(pipeline_class, Path(source.path), dtype)
        return pipeline_class.from_pretrained(source.path, dtype=dtype, local_files_only=True)
    except torch.OutOfMemoryError:
        raise
    except _load_errors() as error:
        message = " ".join(f"{type(error).__name__}: {error}".split())
        raise FieldError(
            MODEL_OWNER,
            source.path_field,
            str(source.path),
            f"cannot be loaded as {pipeline_class.__name__}: {message}",
        ) from error


def _read(source: ModelSource, device: torch.device, dtype: torch.dtype) -> Any:
    """Read the whole pipeline from its files onto ``device``."""
    if source.reference:
        from fastdit.reference import load_reference_pipeline

        return load_reference_pipeline(device, dtype)
    return _from_pretrained(source, dtype).to(device)


def _build_empty(source: ModelSource, dtype: torch.dtype) -> Any:
    """The pipeline without its weights, for a rank that receives them (:func:`build_empty_pipeline`)."""
    from fastdit.parallel.load_broadcast import build_empty_pipeline

    pipeline_class = import_pipeline_class(source.pipeline_class)
    try:
        return build_empty_pipeline(pipeline_class, Path(source.path), dtype)
    except _load_errors() as error:
        message = " ".join(f"{type(error).__name__}: {error}".split())
        raise FieldError(
            MODEL_OWNER,
            source.path_field,
            str(source.path),
            f"cannot be built as {pipeline_class.__name__} from its configs: {message}",
        ) from error


def _load_pipeline(source: ModelSource, device: torch.device, dtype: torch.dtype, loading: Loading) -> Any:
    from fastdit.process import join_process_group, process_count

    if not loading.broadcasts or process_count() == 1:
        return _read(source, device, dtype)
    if modular.is_modular(import_pipeline_class(source.pipeline_class)):
        # The broadcast loader builds a pipeline's models empty from their configs and hands them to
        # from_pretrained; a ModularPipeline loads its components through specs, which it cannot do that for.
        raise FieldError(
            MODEL_OWNER,
            "loading",
            loading.mode,
            f"not available for {source.pipeline_class}, a ModularPipeline (every process reads its files "
            "itself): use every-rank",
        )
    from fastdit.parallel.load_broadcast import load_broadcast

    join_process_group(device, loading.timeout_s)  # a no-op when the caller (or accelerate) made one already
    return load_broadcast(
        lambda: _read(source, device, dtype), lambda: _build_empty(source, dtype), loading=loading, device=device
    )


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


class Session:
    """A loaded pipeline, how it is accelerated, and calls of it.

    Attributes:
        pipe: The diffusers pipeline.
        source: Where it came from.
        device: The device it runs on.
        output_kind: What the last call produced: ``"image"`` (also before any call), ``"video"`` or ``"audio"``.
    """

    def __init__(self, pipe: Any, source: ModelSource, device: torch.device | str) -> None:
        self.pipe = pipe
        self.source = source
        self.device = torch.device(device)
        self._accelerated = False
        self.output_kind = "image"

    @classmethod
    def load(
        cls,
        source: ModelSource,
        *,
        device: torch.device | str,
        dtype: torch.dtype,
        progress: bool = False,
        loading: Loading | None = None,
    ) -> Session:
        """Load ``source`` onto ``device`` in ``dtype`` (local files only).

        Args:
            source: From :func:`resolve_model`.
            device: Where every component goes.
            dtype: Parameter dtype.
            progress: Show the loading bars and the pipeline's progress bar over denoising steps.
            loading: Who reads the files (default: every process). A mode that broadcasts is, under ``torchrun``
                with more than one process, a collective: it joins (or creates) the default process group, which
                outlives the call, and every rank must load alike (:mod:`fastdit.parallel.load_broadcast`).

        Raises:
            FieldError: The directory cannot be loaded (see the module docstring); under a broadcasting mode, on
                every rank when the reading rank fails.
            LoadBroadcastError: Under a broadcasting mode, on every rank, when a rank fails otherwise or the
                ranks' pipelines differ in structure.
        """
        device = torch.device(device)
        loading = Loading() if loading is None else loading
        with _loading_bars(progress), _quiet_pipeline_imports():
            pipe = _load_pipeline(source, device, dtype, loading)
        modular.set_progress_bar_config(pipe, disable=not progress, leave=False)
        return cls(pipe, source, device)

    @property
    def pipeline_class(self) -> type:
        """The pipeline's class."""
        return type(self.pipe)

    @property
    def accelerated(self) -> bool:
        """Whether :meth:`accelerate` is in effect."""
        return self._accelerated

    def accelerate(self, **options: Any) -> None:
        """:func:`fastdit.accelerate` the pipeline (``cache=``, ``parallel=``, ``compile=``, ``attention=``)."""
        fastdit.accelerate(self.pipe, **options)
        self._accelerated = True

    def disable(self) -> None:
        """Undo :meth:`accelerate` (a no-op when not accelerated)."""
        if self._accelerated:
            fastdit.disable(self.pipe)
            self._accelerated = False

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

    def summary(self) -> fastdit.Summary | None:
        """:func:`fastdit.summary` of the last call (``None`` when the pipeline is not accelerated)."""
        return fastdit.summary(self.pipe) if self._accelerated else None

    def call(self, case: Case, kwargs: Mapping[str, Any]) -> np.ndarray:
        """Generate one output.

        Args:
            case: Prompt and seed.
            kwargs: Call arguments from :func:`call_arguments` (no prompt or generator).

        Returns:
            A float32 array in [0, 1], ``(H, W, C)`` or ``(F, H, W, C)``; for audio a ``(channels, samples)``
            waveform, unclipped.

        Raises:
            NonFiniteOutputError: The output holds NaN or infinite values (nothing is returned).
        """
        call = dict(kwargs)
        if case.prompt is not None:
            call["prompt"] = case.prompt
        call["generator"] = _generator(case.seed)
        return self._finished(modular.call_pipeline(self.pipe, **call), call)[0]

    def call_batch(self, cases: Sequence[Case], kwargs: Mapping[str, Any]) -> list[np.ndarray]:
        """Generate several outputs in one pipeline call, each from a generator seeded with its case's seed.

        Each output's noise depends on its seed only, but an accelerated pipeline decides for the call as a whole
        (a cache computes or skips a step for every item at once), so outputs may depend on the other cases.

        Raises:
            ValueError: If ``cases`` is empty, or several cases lack a prompt (pipelines without one take the batch
                size in their own ways: call them one case at a time).
            NonFiniteOutputError: An output holds NaN or infinite values (none is returned).
        """
        if len(cases) == 1:
            return [self.call(cases[0], kwargs)]
        prompts = [case.prompt for case in cases]
        if not cases or None in prompts:
            raise ValueError(f"a batch needs one or more cases, each with a prompt; got prompts {prompts}")
        call = {**kwargs, "prompt": prompts, "generator": [_generator(case.seed) for case in cases]}
        return self._finished(modular.call_pipeline(self.pipe, **call), call)

    def _finished(self, result: Any, call: Mapping[str, Any]) -> list[np.ndarray]:
        self.output_kind = output_kind(result)
        return _finite(self.pipe, _outputs(result), call, self.output_kind)


def output_paths(out: Path, count: int, suffix: str) -> list[Path]:
    """Where ``count`` outputs go: ``out`` itself for one, ``out/0000<suffix>``, ... in order for several."""
    if count == 1:
        return [out]
    return [out / f"{index:04d}{suffix}" for index in range(count)]


def audio_sample_rate(pipe: Any) -> int | None:
    """The sample rate of an audio pipeline's waveforms (its VAE's ``sampling_rate`` or ``sample_rate``), else
    ``None``."""
    config = getattr(getattr(pipe, "vae", None), "config", None)
    for name in ("sampling_rate", "sample_rate"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _audio_rate(path: Path, sample_rate: int | None) -> int:
    if sample_rate is None:
        raise ValueError(f"{path}: saving audio needs the sample rate (the pipeline's VAE names none)")
    return sample_rate


def _encode(file: Path, output: np.ndarray, suffix: str, fps: float, sample_rate: int | None) -> None:
    from fastdit.io import AUDIO_SUFFIXES, encode_audio, encode_image, encode_video

    if suffix.lower() in AUDIO_SUFFIXES:
        encode_audio(file, output, sample_rate=_audio_rate(file, sample_rate))
    elif output.ndim == 4:
        encode_video(file, output, suffix=suffix, fps=fps)
    else:
        encode_image(file, output, suffix=suffix)


def save_output(path: Path, output: np.ndarray, *, fps: float = 8.0, sample_rate: int | None = None) -> Path:
    """Atomically save one output: an image, a video when ``output`` has a frame axis, a waveform to a ``.wav``
    path (at ``sample_rate``).

    Raises:
        ValueError: ``output`` is neither ``(H, W, C)`` nor ``(F, H, W, C)`` for an image or video path (a waveform,
            ``(channels, samples)``, goes to a ``.wav`` path).
    """
    from fastdit.io import AUDIO_SUFFIXES, save_audio, save_image, save_video

    if Path(path).suffix.lower() in AUDIO_SUFFIXES:
        return save_audio(path, output, sample_rate=_audio_rate(path, sample_rate))
    _check_savable(output)
    if output.ndim == 4:
        return save_video(path, output, fps=fps)
    return save_image(path, output)


def _check_savable(output: np.ndarray) -> None:
    if output.ndim not in (3, 4):
        raise ValueError(
            f"an output of shape {tuple(output.shape)} is neither an image (H, W, C) nor a video (F, H, W, C): "
            "save a waveform (channels, samples) to a .wav path"
        )


def save_outputs(
    paths: Sequence[Path], outputs: Sequence[np.ndarray], *, fps: float = 8.0, sample_rate: int | None = None
) -> list[Path]:
    """Save outputs all or nothing: one atomically, several (in one directory) staged and moved into place together.

    Args:
        paths: Destinations, e.g. from :func:`output_paths`.
        outputs: One output per path.
        fps: Frame rate of videos.
        sample_rate: Sample rate of waveforms saved to ``.wav`` paths (:func:`audio_sample_rate`).

    Returns:
        ``paths``.

    Raises:
        ValueError: If the counts differ, or several paths are not distinct files of one directory.
        OSError: If writing fails; nothing new is left behind (see :func:`fastdit.io.atomic_outputs`).
    """
    from fastdit.io import atomic_outputs

    if len(paths) != len(outputs):
        raise ValueError(f"save_outputs got {len(paths)} paths for {len(outputs)} outputs")
    if len(paths) == 1:
        return [save_output(paths[0], outputs[0], fps=fps, sample_rate=sample_rate)]
    from fastdit.io import AUDIO_SUFFIXES

    for path, output in zip(paths, outputs, strict=True):
        if Path(path).suffix.lower() not in AUDIO_SUFFIXES:
            _check_savable(output)
    with atomic_outputs(paths) as temps:
        for path, temp, output in zip(paths, temps, outputs, strict=True):
            _encode(temp, output, path.suffix, fps, sample_rate)
    return list(paths)
