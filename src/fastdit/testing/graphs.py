"""A stand-in for ``torch.cuda.CUDAGraph`` that runs on any device, for tests of code served by CUDA graphs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils import _pytree as pytree

__all__ = ["RecordingGraph"]


class RecordingGraph:
    """Same contract as a CUDA graph: ``replay`` recomputes from the tensors seen at capture and writes into the
    outputs returned at capture. Code that forgets to copy new inputs into the captured ones, or hands out the
    graph's own outputs, computes wrong results with it as it would on a GPU.
    """

    def capture(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` once (a CUDA capture only records; running is harmless here) and keep its outputs."""
        self.fn = fn
        self.outputs = fn()
        return self.outputs

    def replay(self) -> None:
        """Recompute and write into the captured outputs."""
        for kept, fresh in zip(pytree.tree_leaves(self.outputs), pytree.tree_leaves(self.fn()), strict=True):
            kept.copy_(fresh)
