"""What ``fastdit inspect TARGET`` names, and the models and inputs it is inspected with.

A target is a registered model name or family, a diffusers transformer class name, ``module.path:Class``, or a local
model folder (``model_index.json``, ``transformer/config.json`` or ``config.json``; weights are never read). Its
structure is read from the full-size config built on ``meta``; one forward runs on a small CPU model: the family's tiny
pipeline (its first transformer call is captured) for registered classes, otherwise a scaled-down copy of the config
with inputs made from the forward's signature.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fastdit.models.base import ModelAdapter, qualified_name
from fastdit.models.registry import all_adapters, get_family, get_preset
from fastdit.modular import call_pipeline

__all__ = [
    "ForwardSetup",
    "Target",
    "TargetError",
    "build_meta",
    "call_function",
    "capture_tiny",
    "example_setup",
    "resolve_target",
]


class TargetError(ValueError):
    """A target that names nothing inspectable (reported as one line by the CLI)."""


@dataclass
class Target:
    """A resolved target.

    Attributes:
        spec: The target as given.
        kind: ``"model"``, ``"family"``, ``"class"``, ``"module"`` or ``"folder"``.
        cls: The transformer class.
        config: Constructor arguments of the full-size model (the folder's config, or the class defaults).
        config_source: Where :attr:`config` came from, for the report.
        adapter: The registered adapter of :attr:`cls`, ``None`` if unregistered.
    """

    spec: str
    kind: str
    cls: type
    config: dict[str, Any]
    config_source: str
    adapter: ModelAdapter | None


def _import_class(module: str, name: str, spec: str) -> type:
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise TargetError(f"cannot import {name!r} from {module!r} (target {spec!r}): {exc}") from None
    if not isinstance(cls, type) or not issubclass(cls, torch.nn.Module):
        raise TargetError(f"target {spec!r}: {module}.{name} is not a torch.nn.Module class")
    return cls


def _adapter_of(cls: type) -> ModelAdapter | None:
    name = qualified_name(cls)
    return next((a for a in all_adapters() if name in a.transformer_classes), None)


def _class_defaults(cls: type) -> dict[str, Any]:
    params = inspect.signature(cls.__init__).parameters.values()
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name: p.default for p in params if p.kind in named and p.default is not inspect.Parameter.empty}


def _from_class(spec: str, kind: str, cls: type) -> Target:
    return Target(spec, kind, cls, _class_defaults(cls), f"defaults of {cls.__name__}.__init__", _adapter_of(cls))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise TargetError(f"cannot read {path}: {exc}") from None


def _from_folder(spec: str, folder: Path) -> Target:
    config_path = next(
        (p for p in (folder / "transformer" / "config.json", folder / "config.json") if p.is_file()), None
    )
    if config_path is None:
        raise TargetError(f"folder {spec!r} has no transformer/config.json or config.json")
    config = _read_json(config_path)
    entry = None
    if (folder / "model_index.json").is_file():
        entry = _read_json(folder / "model_index.json").get("transformer")
    if isinstance(entry, list) and len(entry) == 2 and all(entry):
        module, name = entry
    elif "_class_name" in config:
        module, name = "diffusers", config["_class_name"]
    else:
        raise TargetError(f"{config_path} names no class (_class_name) and no model_index.json says which")
    cls = _import_class(module, name, spec)
    known = set(inspect.signature(cls.__init__).parameters)
    values = {k: v for k, v in config.items() if not k.startswith("_") and k in known}
    return Target(spec, "folder", cls, {**_class_defaults(cls), **values}, str(config_path), _adapter_of(cls))


def resolve_target(spec: str) -> Target:
    """Resolve ``spec`` to a :class:`Target`.

    Raises:
        TargetError: naming what ``spec`` failed to be.
    """
    if Path(spec).is_dir():
        return _from_folder(spec, Path(spec))
    if ":" in spec:
        module, _, name = spec.partition(":")
        return _from_class(spec, "module", _import_class(module, name, spec))
    for kind, lookup in (("model", get_preset), ("family", get_family)):
        try:
            found = lookup(spec)
        except LookupError:
            continue
        adapter = found[1] if isinstance(found, tuple) else found
        module, _, name = adapter.transformer_classes[0].rpartition(".")
        target = _from_class(spec, kind, _import_class(module, name, spec))
        target.adapter = adapter
        return target
    if re.fullmatch(r"[A-Za-z_][\w.]*", spec):
        module, _, name = spec.rpartition(".")
        try:
            found = getattr(importlib.import_module(module or "diffusers"), name)
        except (ImportError, AttributeError):
            found = None
        if found is not None:
            return _from_class(spec, "class", _import_class(module or "diffusers", name, spec))
    raise TargetError(
        f"unknown target {spec!r}: not a registered model or family (see `fastdit list`), a diffusers transformer "
        "class, module.path:Class, or a folder with a config"
    )


def build_meta(target: Target, fill: dict[str, Any] | None = None) -> tuple[torch.nn.Module | None, str | None]:
    """The full-size model on ``meta`` (no memory, no weights), or ``None`` and why it could not be built.

    Args:
        target: The resolved target.
        fill: Values for the config entries that are ``None`` (class defaults that leave a size open), tried when
            the plain config fails; :attr:`Target.config` and :attr:`Target.config_source` then record them.
    """
    try:
        with torch.device("meta"):
            return target.cls(**target.config), None
    except Exception as exc:  # a constructor that needs a value its defaults leave open; retry below
        problem = f"{type(exc).__name__}: {exc}"
    filled = {k: fill[k] for k, v in target.config.items() if v is None and fill and fill.get(k) is not None}
    if not filled:
        return None, problem
    try:
        with torch.device("meta"):
            model = target.cls(**{**target.config, **filled})
    except Exception as exc:  # the tiny model stands in for the structure
        return None, f"{problem}; with {sorted(filled)} filled: {type(exc).__name__}: {exc}"
    target.config.update(filled)
    target.config_source += f" ({', '.join(sorted(filled))} from the tiny model, the defaults leave them open)"
    return model, None


@dataclass
class ForwardSetup:
    """A small model and one call of it.

    Attributes:
        model: The CPU model the forward runs on.
        args, kwargs: The call.
        source: How they were obtained, for the report.
        context: Call arguments of the pipeline that produced the call (sizes), if any.
    """

    model: torch.nn.Module
    args: tuple
    kwargs: dict[str, Any]
    source: str
    context: dict[str, Any]


class _CapturedError(Exception):
    """Stops a tiny pipeline at its first transformer call."""


def capture_tiny(adapter: ModelAdapter) -> ForwardSetup:
    tiny = adapter.tiny()
    pipe = tiny.build()
    pipe.set_progress_bar_config(disable=True)
    name, model = next(
        (n, m)
        for n, m in pipe.components.items()
        if isinstance(m, torch.nn.Module) and qualified_name(type(m)) in adapter.transformer_classes
    )
    seen: dict[str, Any] = {}

    def grab(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        seen["call"] = (args, kwargs)
        raise _CapturedError

    handle = model.register_forward_pre_hook(grab, with_kwargs=True)
    kwargs = {**tiny.call_kwargs, "output_type": "latent"}
    try:
        torch.manual_seed(0)
        with torch.no_grad():
            call_pipeline(pipe, **kwargs, generator=torch.Generator().manual_seed(0))
    except _CapturedError:
        pass
    finally:
        handle.remove()
    if "call" not in seen:
        raise RuntimeError(f"the tiny {adapter.family!r} pipeline never called its {name}")
    args, call_kwargs = seen["call"]
    context = {k: v for k, v in tiny.call_kwargs.items() if k in ("height", "width", "num_frames")}
    return ForwardSetup(
        model.eval(), args, call_kwargs, f"first transformer call of the tiny {tiny.name!r} pipeline", context
    )


def call_function(spec: str, what: str) -> Any:
    """Import ``module.path:function`` and call it with no arguments (a user's example or pipeline builder).

    Raises:
        TargetError: naming ``what``: the function cannot be imported, or calling it raised.
    """
    module, _, name = spec.partition(":")
    try:
        function = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise TargetError(f"{what}: cannot import {name!r} from {module!r}: {exc}") from None
    try:
        return function()
    except Exception as exc:  # the user's function: its failure is reported as the target's
        raise TargetError(f"{what}: calling it raised {type(exc).__name__}: {exc}") from None


def example_setup(spec: str, target: Target) -> ForwardSetup:
    """The model and call an example function ``module.path:function`` gives: ``(model, kwargs)`` or
    ``(model, args, kwargs)``, a small instance of the target's class and one call of it (for models whose inputs
    cannot be made from the signature).

    Raises:
        TargetError: the function cannot be imported, returns something else, or a model of another class.
    """
    result = call_function(spec, f"--example {spec!r}")
    if not isinstance(result, tuple) or len(result) not in (2, 3) or not isinstance(result[0], torch.nn.Module):
        raise TargetError(f"--example {spec!r}: expected (model, kwargs) or (model, args, kwargs), got {result!r:.80}")
    model, args, kwargs = (result[0], (), result[1]) if len(result) == 2 else result
    if not issubclass(type(model), target.cls):
        raise TargetError(f"--example {spec!r}: gives a {type(model).__name__}, not a {target.cls.__name__}")
    return ForwardSetup(model.eval(), tuple(args), dict(kwargs), f"the call {spec} gives", {})


def scaled_config(config: dict[str, Any]) -> dict[str, Any]:
    """A small copy of ``config``: two layers per list, few heads (the query:key-value ratio kept), narrow widths."""
    out = dict(config)
    ints = {k: v for k, v in config.items() if isinstance(v, int) and not isinstance(v, bool)}
    heads_key = next((k for k in ("num_attention_heads", "num_heads", "heads", "n_heads") if k in ints), None)
    kv_key = next((k for k in ("num_key_value_heads", "num_kv_heads", "kv_heads", "n_kv_heads") if k in ints), None)
    for key, value in ints.items():
        if re.fullmatch(r"(num_(\w+_)?layers|depth|num_blocks|n_layers)", key):
            out[key] = min(value, 2)
    heads = ints.get(heads_key) if heads_key else None
    if heads and kv_key and ints[kv_key]:
        g = math.gcd(heads, ints[kv_key])
        out[heads_key], out[kv_key] = heads // g * min(g, 2), ints[kv_key] // g * min(g, 2)
    elif heads:
        out[heads_key] = min(heads, 4)
    head_dim_key = next((k for k in ("attention_head_dim", "head_dim", "dim_head") if k in ints), None)
    # A list of ints summing to the head dim (RoPE axes) ties it: keep both rather than rescale the axes.
    tied = head_dim_key and any(
        isinstance(v, (list, tuple)) and v and all(isinstance(i, int) for i in v) and sum(v) == ints[head_dim_key]
        for v in config.values()
    )
    if head_dim_key and not tied:
        out[head_dim_key] = min(ints[head_dim_key], 16)
    width_key = next((k for k in ("hidden_size", "dim", "d_model", "model_dim", "inner_dim") if k in ints), None)
    if width_key and heads_key and not head_dim_key:
        out[width_key] = out[heads_key] * 16
    return out
