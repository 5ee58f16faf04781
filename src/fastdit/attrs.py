"""Dotted attribute paths on module trees, shared by the model vocabulary and the parallel plans."""

from __future__ import annotations

from typing import Any

__all__ = ["expand_path", "is_pattern", "resolve_attr"]


def resolve_attr(root: Any, path: str) -> Any:
    """Follow a dotted attribute path (``"a.b.0"``; integers index sequences)."""
    obj = root
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def is_pattern(path: str) -> bool:
    """Whether ``path`` has a ``*`` component (it names every attribute path it matches, not one)."""
    return "*" in path.split(".")


def expand_path(root: Any, path: str) -> list[str]:
    """The submodule paths of ``root`` (an ``nn.Module``) that ``path`` matches, in ``named_modules`` order.

    A ``*`` component matches any one path component (``"down_blocks.*.attentions.*.transformer_blocks"``); a path
    without one matches itself if it exists. The result may be empty.
    """
    parts = path.split(".")
    found = []
    for name, _ in root.named_modules():
        names = name.split(".") if name else []
        if len(names) == len(parts) and all(p in ("*", n) for p, n in zip(parts, names, strict=True)):
            found.append(name)
    return found
