"""A stand-in for ``torch.cuda.CUDAGraph`` that runs on any device, for tests of code served by CUDA graphs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
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
        """Recompute and write into the captured outputs.

        Raises:
            AssertionError: an output that is not a tensor (a size, ``None``) differs from the captured one: a real
                graph would hand out the captured value, so it must be fixed by the call's signature.
        """
        for kept, fresh in zip(pytree.tree_leaves(self.outputs), pytree.tree_leaves(self.fn()), strict=True):
            if isinstance(kept, torch.Tensor):
                kept.copy_(fresh)
            else:
                assert kept == fresh, (
                    f"a non-tensor output changed between calls of one signature: {kept!r} -> {fresh!r}"
                )
