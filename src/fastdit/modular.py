"""diffusers ModularPipelines driven like ``DiffusionPipeline``\\ s: their call parameters, one call, loading.

A ModularPipeline (``diffusers.modular_pipelines``) is a sequence of blocks sharing a ``PipelineState``; diffusers
0.42 serves several models through one only (MiniMax-H3, Wan-Animate-2, MiniMax Music 3). What fastdit reads of a
pipeline it finds there too — its modules in ``components``, its schedulers as attributes — so ``accelerate``, the
component walk and step caching need nothing of their own. Three things differ, and this module bridges them:

- **Call parameters.** ``__call__`` is ``(state, output, **kwargs)``; the parameters a call may pass are the inputs
  its blocks declare (:func:`call_parameters`, read from the class's default blocks without building a pipeline).
- **Outputs.** A call returns the ``PipelineState``; :func:`call_pipeline` returns what a ``DiffusionPipeline`` would:
  an object whose ``frames`` (videos), ``images`` or ``audios`` hold the decoded batch. The decoders take no
  ``output_type="latent"``: such a call runs every block and returns the denoised latents the state holds instead
  (:data:`LATENT_OUTPUTS`; the decoded output where it holds none).
- **Loading.** A directory holds ``modular_model_index.json`` (or a plain ``model_index.json``); ``from_pretrained``
  reads the specs and :func:`load` then loads the components (``load_components``), local files only.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

__all__ = [
    "DECODED_OUTPUTS",
    "INDEX_FILE",
    "LATENT_OUTPUTS",
    "call_parameters",
    "call_pipeline",
    "decoded_output",
    "index_components",
    "is_modular",
    "load",
    "set_progress_bar_config",
]

INDEX_FILE = "modular_model_index.json"
"""The index file ``ModularPipeline.save_pretrained`` writes (a plain ``model_index.json`` loads as well)."""

DECODED_OUTPUTS = {"videos": "frames", "images": "images", "audios": "audios", "audio": "audios"}
"""Output names of ModularPipelines (their blocks' ``outputs``), in order of preference, and the attribute of a
``DiffusionPipeline`` output that holds the same thing: a MiniMax-H3 call outputs ``videos`` and ``audio``, and is
read as a video pipeline."""

LATENT_OUTPUTS = ("latents", "latent_chunks")
"""State values a call with ``output_type="latent"`` returns, the first one the state holds: the denoised latents
(MiniMax Music 3 denoises in windows: the list of its windows' latents)."""


def _modular_base() -> type | None:
    try:
        from diffusers.modular_pipelines import ModularPipeline
    except ImportError:  # a diffusers without modular pipelines
        return None
    return ModularPipeline


def is_modular(pipeline: Any) -> bool:
    """Whether ``pipeline`` (a pipeline or a pipeline class) is a diffusers ModularPipeline."""
    base = _modular_base()
    cls = pipeline if isinstance(pipeline, type) else type(pipeline)
    return base is not None and issubclass(cls, base)


@functools.cache
def _default_blocks(pipeline_class: type) -> Any:
    """The blocks a ``pipeline_class()`` would run (its ``default_blocks_name``), built once per class."""
    name = getattr(pipeline_class, "default_blocks_name", None)
    if not name:
        raise ValueError(f"{pipeline_class.__name__} names no default blocks (default_blocks_name)")
    return getattr(importlib.import_module("diffusers"), name)()


def _blocks(pipeline: Any) -> Any:
    """The blocks of a pipeline instance (its own), or of a class (its default blocks)."""
    if isinstance(pipeline, type):
        return _default_blocks(pipeline)
    return pipeline._blocks  # the instance's blocks themselves: ``.blocks`` returns a deep copy


def call_parameters(pipeline: Any) -> dict[str, inspect.Parameter]:
    """The keyword parameters a call of ``pipeline`` (an instance or a class) may pass: its blocks' inputs.

    An input without a default is given ``None`` as its default, which is what the pipeline fills it with.
    """
    parameters = {}
    for param in _blocks(pipeline).inputs:
        if param.name is None:  # a ``kwargs_type`` group (denoiser input fields): filled by the blocks themselves
            continue
        parameters[param.name] = inspect.Parameter(param.name, inspect.Parameter.KEYWORD_ONLY, default=param.default)
    return parameters


def decoded_output(pipeline: Any) -> str:
    """The name of the decoded output of ``pipeline`` (an instance or a class): the first of
    :data:`DECODED_OUTPUTS` its blocks list.

    Raises:
        ValueError: The blocks list none of them.
    """
    names = [param.name for param in _blocks(pipeline).outputs]
    for name in DECODED_OUTPUTS:
        if name in names:
            return name
    cls = pipeline if isinstance(pipeline, type) else type(pipeline)
    raise ValueError(f"{cls.__name__} outputs {names}: none of {list(DECODED_OUTPUTS)}, which fastdit reads")


def call_pipeline(pipeline: Any, **kwargs: Any) -> Any:
    """Call ``pipeline`` and return its result as a ``DiffusionPipeline`` returns it.

    A ``DiffusionPipeline`` (anything that is no ModularPipeline) is called as it is. A ModularPipeline returns an
    object with one attribute, named after :data:`DECODED_OUTPUTS` (``frames``, ``images`` or ``audios``), holding
    its decoded output; with ``output_type="latent"`` the first of :data:`LATENT_OUTPUTS` the state holds instead
    (the decoders run, in their default output type), or the decoded output where the state keeps no latents
    (Wan-Animate-2 decodes each segment inside its loop).
    """
    if not is_modular(pipeline):
        return pipeline(**kwargs)
    name = decoded_output(pipeline)
    latent = kwargs.get("output_type") == "latent"
    if latent:
        kwargs.pop("output_type")
    accepted = call_parameters(pipeline)
    unknown = sorted(k for k in kwargs if k not in accepted)
    if unknown:  # the pipeline would only warn and drop them
        raise TypeError(f"{type(pipeline).__name__} does not take {', '.join(unknown)}")
    state = pipeline(**kwargs)
    if not latent:
        return SimpleNamespace(**{DECODED_OUTPUTS[name]: state.get(name)})
    for latent_name in LATENT_OUTPUTS:
        value = state.get(latent_name)
        if value is not None:
            return SimpleNamespace(**{DECODED_OUTPUTS[name]: value})
    # Wan-Animate-2 decodes each segment inside its loop and keeps no latents in the state: its output stands in.
    return SimpleNamespace(**{DECODED_OUTPUTS[name]: state.get(name)})


def set_progress_bar_config(pipeline: Any, **kwargs: Any) -> None:
    """``pipeline.set_progress_bar_config(**kwargs)``, reaching a ModularPipeline's nested loops too.

    A ModularPipeline passes the configuration to its top-level blocks only, and a denoise loop sits one level down
    (MiniMax Music 3's window loop), so every block of the tree that has a progress bar gets it here.
    """
    pipeline.set_progress_bar_config(**kwargs)
    if not is_modular(pipeline):
        return
    pending = list(pipeline._blocks.sub_blocks.values())
    while pending:
        block = pending.pop()
        if hasattr(block, "set_progress_bar_config"):
            block.set_progress_bar_config(**kwargs)
        pending.extend(getattr(block, "sub_blocks", {}).values())


def _module_spec(spec: Any) -> bool:
    hint = getattr(spec, "type_hint", None)
    return isinstance(hint, type) and issubclass(hint, torch.nn.Module)


def load(pipeline_class: type, path: Path, dtype: torch.dtype) -> Any:
    """``pipeline_class`` from the local directory ``path``, every component loaded, modules in ``dtype``.

    Raises:
        ValueError: A component of the index did not load (its folder missing, a broken file): ``load_components``
            only logs such a failure and leaves the component ``None``.
    """
    pipe = pipeline_class.from_pretrained(str(path), local_files_only=True)
    specs = pipe._component_specs
    pretrained = [name for name in pipe.pretrained_component_names if specs[name].pretrained_model_name_or_path]
    dtypes = {name: dtype for name in pretrained if _module_spec(specs[name])}
    if pretrained:
        pipe.load_components(names=pretrained, local_files_only=True, dtype=dtypes)
    missing = [name for name in pretrained if getattr(pipe, name, None) is None]
    if missing:
        raise ValueError(f"components {', '.join(missing)} did not load from {path}")
    return pipe


def index_components(index: Mapping[str, Any]) -> dict[str, tuple[str, str, str]]:
    """The components a ``modular_model_index.json`` lists: name -> (library, class, folder).

    An entry is ``[library, class, spec]``; its folder is the spec's ``subfolder`` (its name if none).
    """
    found = {}
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, list) or len(entry) != 3:
            continue
        library, class_name, spec = entry
        if isinstance(library, str) and isinstance(class_name, str) and isinstance(spec, Mapping):
            found[name] = (library, class_name, spec.get("subfolder") or name)
    return found
