"""Resolve a model, load its pipeline, accelerate it and call it: what every front end (CLI, scripts, a server) drives.

Nothing here parses command lines, prints or times; :mod:`fastdit.bench` times and compares on top of it::

    source = resolve_model("flux", None)                  # or (None, None) for the built-in reference pipeline
    session = Session.load(source, device="cuda", dtype=torch.bfloat16)
    session.accelerate(cache=fastdit.FBCache(0.12))
    kwargs = call_arguments(session.pipeline_class, source.defaults, {"num_inference_steps": 28})
    image = session.call(Case("a cat", seed=0), kwargs)

Outputs are float32 arrays in [0, 1]: ``(H, W, C)`` for an image, ``(F, H, W, C)`` for a video. :meth:`Session.call`
runs one prompt per pipeline call with a generator seeded from its :class:`Case`, so an output depends on its prompt
and seed only.

Errors about a value the caller supplied raise :class:`fastdit.errors.FieldError`, which front ends map to their own
flags or request fields. The fields, by owner:

- ``"model"``: ``"name"`` (an unknown registry name; value ``None``: the reference pipeline is unavailable),
  ``"model_path"`` (a directory that is not a pipeline; value ``None``: a registered model without weights),
  ``"env:<VARIABLE>"`` (the same for a directory read from a preset's variable, e.g. ``"env:FLUX_DIR"``),
  ``"pipeline_class"`` (a class that cannot be imported);
- ``"call"``: a ``__call__`` parameter (``"height"``, ``"num_frames"``, ...) the pipeline does not take or cannot
  run as given.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

import fastdit
from fastdit.errors import FieldError
from fastdit.models.registry import get_preset

__all__ = [
    "CALL_OWNER",
    "MODEL_OWNER",
    "REFERENCE_MODEL",
    "Case",
    "ModelSource",
    "Session",
    "call_arguments",
    "call_parameters",
    "check_size",
    "default_steps",
    "frame_multiple",
    "import_pipeline_class",
    "is_video_pipeline",
    "output_paths",
    "resolve_model",
    "save_output",
    "size_multiple",
]

REFERENCE_MODEL = "reference"
"""The model name reports use for the built-in reference pipeline."""

MODEL_OWNER = "model"
"""The :attr:`~fastdit.errors.FieldError.owner` of errors about which model to load (see the module docstring)."""

CALL_OWNER = "call"
"""The :attr:`~fastdit.errors.FieldError.owner` of errors about a pipeline call's arguments."""


@dataclass(frozen=True)
class ModelSource:
    """Where a pipeline comes from and the call arguments it runs with by default.

    Attributes:
        name: Registry preset name, :data:`REFERENCE_MODEL`, or the directory when only a directory was given.
        pipeline_class: Fully qualified pipeline class, e.g. ``"diffusers.FluxPipeline"``.
        path: The local weights directory.
        defaults: Call arguments of the preset (steps, guidance, size, ...).
        reference: Whether this is the built-in reference pipeline.
    """

    name: str
    pipeline_class: str
    path: Path | None = None
    defaults: Mapping[str, Any] = field(default_factory=dict)
    reference: bool = False


def _weights_dir(text: str, field_name: str) -> Path:
    path = Path(text).expanduser()
    if not path.is_dir():
        raise FieldError(MODEL_OWNER, field_name, text, "no such directory")
    if not (path / "model_index.json").is_file():
        raise FieldError(MODEL_OWNER, field_name, text, "not a diffusers pipeline directory (no model_index.json)")
    return path


def _class_from_index(path: Path, text: str, field_name: str) -> str:
    try:
        index = json.loads((path / "model_index.json").read_text())
        return f"diffusers.{index['_class_name']}"
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise FieldError(MODEL_OWNER, field_name, text, f"unreadable model_index.json ({error})") from error


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
        path = _weights_dir(model_path, "model_path")
        return ModelSource(str(path), _class_from_index(path, model_path, "model_path"), path=path)
    try:
        preset, _ = get_preset(name)
    except LookupError:
        raise FieldError(MODEL_OWNER, "name", name, "not a registered model name") from None
    if model_path is not None:
        path = _weights_dir(model_path, "model_path")
    elif environ.get(preset.env_var):
        path = _weights_dir(environ[preset.env_var], f"env:{preset.env_var}")
    else:
        raise FieldError(
            MODEL_OWNER,
            "model_path",
            None,
            f"model {name!r} needs a local copy of {preset.hub_id or 'its pipeline'} (fastdit never downloads): "
            f"give its directory, or set the environment variable {preset.env_var}",
        )
    return ModelSource(name, preset.pipeline_class, path=path, defaults=dict(preset.defaults))


def import_pipeline_class(qualified: str) -> type:
    """Import ``"package.Class"`` (e.g. ``"diffusers.FluxPipeline"``).

    Raises:
        FieldError: Owner ``"model"``, field ``"pipeline_class"``: the module or class does not exist.
    """
    module_name, _, class_name = qualified.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as error:
        raise FieldError(MODEL_OWNER, "pipeline_class", qualified, f"cannot be imported: {error}") from error


def call_parameters(pipeline_class: type) -> dict[str, inspect.Parameter]:
    """The keyword parameters of a pipeline's ``__call__`` (what a call may pass)."""
    parameters = inspect.signature(pipeline_class.__call__).parameters
    return {name: p for name, p in parameters.items() if name != "self" and p.kind is not p.VAR_POSITIONAL}


def is_video_pipeline(pipeline_class: type) -> bool:
    """Whether the pipeline produces videos (it takes a number of frames)."""
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
    """One output to generate: a prompt (``None`` for pipelines without one) and the seed of its noise."""

    prompt: str | None
    seed: int = 0


def _to_array(item: Any) -> np.ndarray:
    if isinstance(item, torch.Tensor):
        item = item.detach().float().cpu().numpy()
    if isinstance(item, (list, tuple)):  # a video as a list of PIL frames or arrays
        return np.stack([_to_array(frame) for frame in item])
    array = np.asarray(item)
    if array.dtype == np.uint8:
        return array.astype(np.float32) / 255.0
    return np.clip(array.astype(np.float32), 0.0, 1.0)


def _outputs(result: Any) -> list[np.ndarray]:
    batch = result.frames if hasattr(result, "frames") else result.images
    return [_to_array(item) for item in batch]


def _generator(seed: int) -> torch.Generator:
    # A CPU generator gives the same noise on every device, so a GPU run is comparable to a CPU one.
    return torch.Generator("cpu").manual_seed(seed)


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
    """

    def __init__(self, pipe: Any, source: ModelSource, device: torch.device | str) -> None:
        self.pipe = pipe
        self.source = source
        self.device = torch.device(device)
        self._accelerated = False

    @classmethod
    def load(
        cls, source: ModelSource, *, device: torch.device | str, dtype: torch.dtype, progress: bool = False
    ) -> Session:
        """Load ``source`` onto ``device`` in ``dtype`` (local files only).

        Args:
            source: From :func:`resolve_model`.
            device: Where every component goes.
            dtype: Parameter dtype.
            progress: Show the loading bars and the pipeline's progress bar over denoising steps.
        """
        device = torch.device(device)
        with _loading_bars(progress):
            if source.reference:
                from fastdit.reference import load_reference_pipeline

                pipe = load_reference_pipeline(device, dtype)
            else:
                pipeline_class = import_pipeline_class(source.pipeline_class)
                pipe = pipeline_class.from_pretrained(source.path, dtype=dtype, local_files_only=True).to(device)
        pipe.set_progress_bar_config(disable=not progress, leave=False)
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
            A float32 array in [0, 1], ``(H, W, C)`` or ``(F, H, W, C)``.
        """
        call = dict(kwargs)
        if case.prompt is not None:
            call["prompt"] = case.prompt
        call["generator"] = _generator(case.seed)
        return _outputs(self.pipe(**call))[0]

    def call_batch(self, cases: Sequence[Case], kwargs: Mapping[str, Any]) -> list[np.ndarray]:
        """Generate several outputs in one pipeline call, each from a generator seeded with its case's seed.

        Each output's noise depends on its seed only, but an accelerated pipeline decides for the call as a whole
        (a cache computes or skips a step for every item at once), so outputs may depend on the other cases.

        Raises:
            ValueError: If ``cases`` is empty, or several cases lack a prompt (pipelines without one take the batch
                size in their own ways: call them one case at a time).
        """
        if len(cases) == 1:
            return [self.call(cases[0], kwargs)]
        prompts = [case.prompt for case in cases]
        if not cases or None in prompts:
            raise ValueError(f"a batch needs one or more cases, each with a prompt; got prompts {prompts}")
        call = {**kwargs, "prompt": prompts, "generator": [_generator(case.seed) for case in cases]}
        return _outputs(self.pipe(**call))


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
