"""Exact registries: transformer class name → adapter, CLI model name → (preset, adapter).

Family modules (every non-infrastructure module of ``fastdit.models``) are imported on first lookup; each calls
:func:`register` once at import. Lookups are exact (fully qualified class name); nothing matches by prefix.
"""

from __future__ import annotations

import importlib
import pkgutil
import threading

import torch

from fastdit.models.base import ModelAdapter, ModelPreset, qualified_name

__all__ = [
    "adapter_for",
    "all_adapters",
    "all_presets",
    "family_modules",
    "get_family",
    "get_preset",
    "register",
    "unregister",
]

# Modules of this package that are infrastructure; every other module in ``fastdit.models`` is a family file.
# Adding a family therefore means adding one file and nothing else.
_INFRASTRUCTURE = frozenset({"base", "registry", "validate"})


def family_modules() -> list[str]:
    """Names of the family modules shipped in ``fastdit.models``."""
    import fastdit.models as package

    return sorted(
        m.name
        for m in pkgutil.iter_modules(package.__path__)
        if not m.ispkg and not m.name.startswith("_") and m.name not in _INFRASTRUCTURE
    )


_BY_CLASS: dict[str, ModelAdapter] = {}
_BY_FAMILY: dict[str, ModelAdapter] = {}
_PRESETS: dict[str, tuple[ModelPreset, ModelAdapter]] = {}
_LOCK = threading.RLock()
_loaded = False


def register(adapter: ModelAdapter) -> ModelAdapter:
    """Register ``adapter`` under each of its transformer classes, its family and its presets.

    Raises:
        ValueError: if a class, family or preset name is already registered.
    """
    with _LOCK:
        if adapter.family in _BY_FAMILY:
            raise ValueError(f"family {adapter.family!r} is already registered")
        for name in adapter.transformer_classes:
            if name in _BY_CLASS:
                raise ValueError(f"transformer class {name!r} is already registered by {_BY_CLASS[name].family!r}")
        for preset in adapter.presets:
            if preset.name in _PRESETS:
                raise ValueError(f"model name {preset.name!r} is already registered")
        _BY_FAMILY[adapter.family] = adapter
        for name in adapter.transformer_classes:
            _BY_CLASS[name] = adapter
        for preset in adapter.presets:
            _PRESETS[preset.name] = (preset, adapter)
    return adapter


def unregister(family: str) -> None:
    """Remove a family (used by tests that register throw-away adapters)."""
    with _LOCK:
        adapter = _BY_FAMILY.pop(family)
        for name in adapter.transformer_classes:
            _BY_CLASS.pop(name, None)
        for preset in adapter.presets:
            _PRESETS.pop(preset.name, None)


def _load_families() -> None:
    global _loaded
    with _LOCK:
        if _loaded:
            return
        _loaded = True
        for module in family_modules():
            importlib.import_module(f"fastdit.models.{module}")


def adapter_for(transformer: torch.nn.Module) -> ModelAdapter | None:
    """The adapter registered for ``type(transformer)`` exactly, or ``None``."""
    _load_families()
    return _BY_CLASS.get(qualified_name(type(transformer)))


def get_family(family: str) -> ModelAdapter:
    """The adapter of a family by name."""
    _load_families()
    try:
        return _BY_FAMILY[family]
    except KeyError:
        raise LookupError(f"unknown family {family!r}; known: {sorted(_BY_FAMILY)}") from None


def get_preset(name: str) -> tuple[ModelPreset, ModelAdapter]:
    """The CLI preset called ``name`` and its adapter."""
    _load_families()
    try:
        return _PRESETS[name]
    except KeyError:
        raise LookupError(f"unknown model {name!r}; run `fastdit list` for the registered names") from None


def all_adapters() -> list[ModelAdapter]:
    """Every registered adapter, sorted by family."""
    _load_families()
    return [_BY_FAMILY[k] for k in sorted(_BY_FAMILY)]


def all_presets() -> list[tuple[ModelPreset, ModelAdapter]]:
    """Every CLI preset with its adapter, sorted by name."""
    _load_families()
    return [_PRESETS[k] for k in sorted(_PRESETS)]
