"""What an applier returns: the function that undoes it, and the state it created (for summaries and inspection)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Applied"]


@dataclass
class Applied:
    """The result of one ``apply_<technique>`` call.

    Calling it undoes the technique (so ``undo = apply_x(...); undo()`` reads naturally).

    Attributes:
        undo: Removes everything the applier installed.
        state: What the technique keeps while installed (a cache engine, CUDA graphs, a split layout), or ``None``.
    """

    undo: Callable[[], None]
    state: Any = None

    def __call__(self) -> None:
        self.undo()
