"""``torch.compile`` for the transformer blocks, with cache decisions kept outside compiled code.

Each block's own computation is compiled as the ``compiled`` stage of its :class:`~fastdit.hooks.blocks.BlockRunner`,
beneath every fastdit layer: cache hooks (which read host values to decide) and parallel splits stay eager around
it. Repeated blocks share one compiled graph per block class and shape (dynamo caches by code object).

With ``Compile(outer=True)`` the transformer's other direct children — embedders, RoPE tables, the final norm and
projection — get a ``compiled`` stage of their own in the same way (:func:`outer_modules`): hooks on them (parallel
splits) stay eager around the compiled computation, as on a block.

With ``Compile(vae=True)`` each VAE's decoder module is compiled whole as well (:func:`apply_vae_compile`): it runs once
per image after the denoising loop, with no fastdit layer inside it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from fastdit.config import Compile
from fastdit.hooks import blocks as block_runner
from fastdit.hooks import layers
from fastdit.hooks.state import Applied

__all__ = ["apply_compile", "apply_vae_compile", "outer_modules", "vae_decoder"]


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


def outer_modules(transformer: torch.nn.Module, block_names: Sequence[str]) -> list[tuple[str, torch.nn.Module]]:
    """The transformer's direct children that hold none of its blocks (``block_names``, dotted paths), in order.

    Containers (``ModuleList`` / ``ModuleDict``) are left out: they have no computation of their own to compile.
    """
    holders = {name.split(".", 1)[0] for name in block_names}
    containers = (torch.nn.ModuleList, torch.nn.ModuleDict)
    return [
        (name, child)
        for name, child in transformer.named_children()
        if name not in holders and not isinstance(child, containers)
    ]


def vae_decoder(vae: torch.nn.Module) -> torch.nn.Module | None:
    """The module a VAE decodes latents with (its ``decoder`` submodule), or ``None`` when it has none."""
    decoder = getattr(vae, "decoder", None)
    return decoder if isinstance(decoder, torch.nn.Module) else None


def apply_vae_compile(vaes: Sequence[torch.nn.Module], config: Compile) -> Applied:
    """Compile the decoder of every VAE in ``vaes`` (``nn.Module.compile``: the module keeps its identity, so the
    pipeline's calls go through the compiled code); return the undo."""
    decoders = [vae_decoder(vae) for vae in vaes]
    for decoder in decoders:
        assert decoder is not None, "checked by the compile technique"
        decoder.compile(**_options(config))

    def restore() -> None:
        for decoder in decoders:
            decoder._compiled_call_impl = None  # what nn.Module.compile set: calls go to the eager forward again

    return Applied(restore)
