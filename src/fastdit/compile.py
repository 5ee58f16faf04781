"""``torch.compile`` for the transformer blocks, with cache decisions kept outside compiled code.

Each block's own computation is compiled as the ``compiled`` stage of its :class:`~fastdit.hooks.blocks.BlockRunner`,
beneath every fastdit layer: cache hooks (which read host values to decide) and parallel splits stay eager around
it. Repeated blocks share one compiled graph per block class and shape (dynamo caches by code object).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from fastdit.config import Compile
from fastdit.hooks import blocks as block_runner
from fastdit.hooks import layers
from fastdit.hooks.state import Applied

__all__ = ["apply_compile"]


def _options(config: Compile) -> dict:
    return {"backend": config.backend, "mode": config.mode, "fullgraph": config.fullgraph, "dynamic": config.dynamic}


def apply_compile(modules: Sequence[torch.nn.Module], config: Compile) -> Applied:
    """Compile the computation of every module in ``modules`` (the transformer's blocks); return the undo."""
    undo: list[Callable[[], None]] = []
    for module in modules:
        compiled = torch.compile(layers.original_forward(module), **_options(config))
        undo.append(block_runner.set_stage(module, "compiled", compiled))

    def restore() -> None:
        for fn in reversed(undo):
            fn()

    return Applied(restore)
