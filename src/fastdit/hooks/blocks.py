"""The block runner: how a block's own computation runs beneath its layers — plain, compiled, or graphed.

Compilation and CUDA graphs do not replace a hook's compute function or the block's call: each block that either
technique touches gets one :class:`BlockRunner` at the bottom of its :class:`~fastdit.hooks.layers.LayerStack`, and
the techniques set its stages. Every layer above (cache decisions, parallel splits and gathers) stays eager Python
around it, so cache decisions never run inside compiled code and a graph never records a host decision::

    layers (cache, parallel) → runner: graphs( compiled( block's own forward ) )
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from fastdit.hooks import layers

__all__ = ["BlockRunner", "runner_of"]


class BlockRunner:
    """A block's computation: its original ``forward``, optionally compiled, optionally served from CUDA graphs.

    Attributes:
        plain: The block's own ``forward`` (beneath every fastdit layer).
        compiled: ``torch.compile`` of :attr:`plain`, or ``None``.
        graphs: A callable ``graphs(fn, *args, **kwargs)`` that runs ``fn`` from CUDA graphs, or ``None``.
    """

    def __init__(self, plain: Callable[..., Any]) -> None:
        self.plain = plain
        self.compiled: Callable[..., Any] | None = None
        self.graphs: Callable[..., Any] | None = None
        self._fn = plain
        self.remove: Callable[[], None] = lambda: None  # takes the runner off its module (set when installed)

    def _rebuild(self) -> None:
        fn = self.compiled or self.plain
        self._fn = fn if self.graphs is None else functools.partial(self.graphs, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **kwargs)

    @property
    def idle(self) -> bool:
        """Whether no stage is set (the runner computes exactly like the original forward)."""
        return self.compiled is None and self.graphs is None

    def set_stage(self, stage: str, value: Callable[..., Any] | None) -> None:
        """Set ``"compiled"`` or ``"graphs"`` (``None`` clears it)."""
        if stage not in ("compiled", "graphs"):
            raise ValueError(f"BlockRunner stage {stage!r}: must be 'compiled' or 'graphs'")
        setattr(self, stage, value)
        self._rebuild()


def runner_of(module: torch.nn.Module) -> BlockRunner | None:
    """The block runner installed on ``module``, if any."""
    stack = layers.stack_of(module)
    terminal = None if stack is None else stack.terminal
    return terminal if isinstance(terminal, BlockRunner) else None


def set_stage(module: torch.nn.Module, stage: str, value: Callable[..., Any]) -> Callable[[], None]:
    """Give ``module``'s runner (created on first use) the stage ``stage``; return the undo.

    The runner is removed again when its last stage is cleared, so an undone module has no fastdit state left.
    """
    runner = runner_of(module)
    if runner is None:
        runner = BlockRunner(layers.original_forward(module))
        runner.remove = layers.set_terminal(module, runner)
    if getattr(runner, stage) is not None:
        raise ValueError(f"{type(module).__name__} already has a {stage} stage")
    runner.set_stage(stage, value)

    def undo() -> None:
        runner.set_stage(stage, None)
        if runner.idle:
            runner.remove()

    return undo
