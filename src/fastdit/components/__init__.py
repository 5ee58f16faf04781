"""The component walk: a pipeline's modules found by kind — denoisers, text encoders, VAEs — each kind from its own
exact registry (fully qualified class name → entry; duplicate registration raises).

Denoisers come from the model-adapter registry (:mod:`fastdit.models.registry`). Text encoders and VAEs have their
own registries here (:mod:`fastdit.components.registry`), which is where text-encoder and VAE techniques find the
classes they know. A module of no registered kind is ``"other"`` and no technique touches it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from fastdit.components.registry import component_kind
from fastdit.models.base import ModelAdapter, qualified_name
from fastdit.models.registry import adapter_for

__all__ = ["Component", "Components", "walk"]

DENOISER = "denoiser"


@dataclass(frozen=True)
class Component:
    """One module of the target, with its kind and (for denoisers) its adapter."""

    name: str
    module: torch.nn.Module
    kind: str
    adapter: ModelAdapter | None = None

    def blocks(self) -> list[tuple[str, torch.nn.Module]]:
        """``(path.index, block)`` of every block of a denoiser, in execution order."""
        from fastdit.models.validate import block_lists

        assert self.adapter is not None, "blocks() of a component without an adapter"
        return [
            (f"{g.path}.{i}", b) for g, blocks in block_lists(self.module, self.adapter) for i, b in enumerate(blocks)
        ]


@dataclass(frozen=True)
class Components:
    """Every module component of a target, in the pipeline's order.

    Attributes:
        items: The module components.
        pipeline: The pipeline they belong to (``None`` when the target is a bare module).
    """

    items: tuple[Component, ...]
    pipeline: Any = None

    def of(self, kind: str) -> list[Component]:
        """The components of ``kind``."""
        return [c for c in self.items if c.kind == kind]

    @property
    def denoisers(self) -> list[Component]:
        """The components fastdit accelerates with its denoiser techniques."""
        return self.of(DENOISER)

    @property
    def owner(self) -> str:
        """What the components belong to, for messages: the pipeline's class, or "a bare transformer"."""
        return "a bare transformer" if self.pipeline is None else type(self.pipeline).__name__

    def __iter__(self) -> Iterator[Component]:
        return iter(self.items)


def _serves(adapter: ModelAdapter, module: torch.nn.Module) -> bool:
    return qualified_name(type(module)) in adapter.transformer_classes


def _classify(name: str, module: torch.nn.Module, adapter: ModelAdapter | None) -> Component:
    found = adapter if adapter is not None and _serves(adapter, module) else adapter_for(module)
    if found is not None:
        return Component(name, module, DENOISER, found)
    return Component(name, module, component_kind(type(module)))


def walk(target: Any, adapter: ModelAdapter | None = None) -> Components:
    """Find the components of ``target`` (a diffusers pipeline or one ``nn.Module``) by kind.

    Args:
        target: A pipeline (anything with a ``components`` dict) or a transformer module.
        adapter: Use this adapter for the modules it serves (third-party models), or for a bare module.

    Raises:
        ValueError: ``target`` is neither, or no component is a denoiser fastdit has an adapter for.
    """
    if isinstance(target, torch.nn.Module):
        found = adapter or adapter_for(target)
        if found is None:
            raise ValueError(
                f"no adapter is registered for {qualified_name(type(target))}; pass adapter=ModelAdapter(...) or "
                "register one (docs/adding_a_model.md)"
            )
        return Components((Component("transformer", target, DENOISER, found),))
    components = getattr(target, "components", None)
    if not isinstance(components, dict):
        raise ValueError(f"target={type(target).__name__}: expected a diffusers pipeline or a torch.nn.Module")
    items = tuple(_classify(n, m, adapter) for n, m in components.items() if isinstance(m, torch.nn.Module))
    result = Components(items, pipeline=target)
    if not result.denoisers:
        names = {c.name: type(c.module).__name__ for c in items}
        raise ValueError(f"no component of {type(target).__name__} has a fastdit adapter: {names}")
    return result
