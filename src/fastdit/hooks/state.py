"""What an applier returns: the function that undoes it, and the state it created (for summaries and inspection);
and how an applier keeps an original parameter it replaces (:func:`park_on_host`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Applied", "park_on_host"]


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


def park_on_host(param: torch.nn.Parameter) -> Callable[[], None]:
    """Move a kept original parameter off the accelerator while a replacement computes in its place (so the
    replacement does not cost device memory twice); the returned undo moves it back, the same object."""
    device = param.device
    if device.type == "cpu":
        return lambda: None
    param.data = param.data.to("cpu")

    def undo() -> None:
        param.data = param.data.to(device)

    return undo
