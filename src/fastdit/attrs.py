"""Dotted attribute paths on module trees, shared by the model vocabulary and the parallel plans."""

from __future__ import annotations

from typing import Any

__all__ = ["resolve_attr"]


def resolve_attr(root: Any, path: str) -> Any:
    """Follow a dotted attribute path (``"a.b.0"``; integers index sequences)."""
    obj = root
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj
