"""``torch.compile`` for the transformer blocks, with cache decisions kept outside compiled code.

When a cache is installed, its block hook calls a compiled copy of the block's own ``forward``: the hook (which reads
host values to decide) stays eager, the block's tensor work is compiled. Without a cache the whole block is compiled.
Repeated blocks share one compiled graph per block class and shape (dynamo caches by code object).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from diffusers.hooks import HookRegistry

from fastdit.cache.hooks import BLOCK_HOOK
from fastdit.config import Compile
from fastdit.models.base import ModelAdapter
from fastdit.models.validate import block_lists

__all__ = ["apply_compile"]


def _options(config: Compile) -> dict:
    return {"backend": config.backend, "mode": config.mode, "fullgraph": config.fullgraph, "dynamic": config.dynamic}


def apply_compile(transformer: torch.nn.Module, adapter: ModelAdapter, config: Compile) -> Callable[[], None]:
    """Compile every block of ``transformer``; return a function that restores eager execution."""
    undo: list[Callable[[], None]] = []
    for _, blocks in block_lists(transformer, adapter):
        for block in blocks:
            registry = getattr(block, "_diffusers_hook", None)
            hook = registry.get_hook(BLOCK_HOOK) if isinstance(registry, HookRegistry) else None
            if hook is not None:
                hook.compute_fn = torch.compile(hook.fn_ref.original_forward, **_options(config))
                undo.append(lambda hook=hook: setattr(hook, "compute_fn", None))
            else:
                block.compile(**_options(config))
                undo.append(lambda block=block: setattr(block, "_compiled_call_impl", None))

    def restore() -> None:
        for fn in undo:
            fn()

    return restore
