"""DBPrune: skip individual middle blocks whose input barely changed since they last ran.

Each middle block remembers the input it last computed on and the residual it produced. When its current input
differs from that one by less than ``threshold`` (relative L1, reduced over ranks), the block is skipped and its
residual re-added. Front and back blocks always compute, as in DBCache.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fastdit.cache.hooks import (
    BLOCK_HOOK,
    TRANSFORMER_HOOK,
    BlockSlot,
    FirstCallCheck,
    Groups,
    TransformerCacheHook,
    compute_checked,
    plan_slots,
)
from fastdit.cache.policy import Reducer, relative_l1
from fastdit.cache.reuse import ReuseStats
from fastdit.cache.state import BranchState, RunTracker
from fastdit.config import DBPrune
from fastdit.hooks import layers
from fastdit.hooks.args import ForwardArgs

__all__ = ["PruneEngine", "install"]


@dataclass
class _BlockMemory:
    hidden_in: torch.Tensor
    hidden_residual: torch.Tensor
    encoder_residual: torch.Tensor | None
    extras: tuple
    continuous: int = 0


class PruneEngine:
    """The pruning state of one transformer."""

    def __init__(self, config: DBPrune, slots: list[BlockSlot], reducer: Reducer | None) -> None:
        self.config = config
        self.slots = slots
        self.reducer = reducer
        self.tracker = RunTracker(separate_branches=True)
        self.reuse: ReuseStats | None = None  # the step-invariant modules' statistics (set by apply_cache)
        self.num_middle = sum(slot.role == "middle" for slot in slots)

    def begin_call(self, context: str, timestep: float | None, signature: tuple, key: int | None = None) -> None:
        state = self.tracker.begin_call(context, timestep, signature, key)
        state.blocks_total += len(self.slots)
        state.pruned.append(0)

    def end_call(self) -> None:
        """End a transformer call (it may have raised)."""
        self.tracker.end_call()

    def may_prune(self, state: BranchState, memory: _BlockMemory | None, hidden: torch.Tensor) -> bool:
        """Whether this block may be skipped now (same answer on every rank: the diff is reduced first)."""
        config = self.config
        if memory is None or state.step < config.warmup_steps or memory.hidden_in.shape != hidden.shape:
            return False
        if state.pruned[-1] + 1 > config.max_pruned_ratio * self.num_middle:
            return False
        if config.max_continuous_pruned_steps is not None and memory.continuous >= config.max_continuous_pruned_steps:
            return False
        return relative_l1(hidden, memory.hidden_in, self.reducer) < config.threshold


class BlockPruneHook(layers.LayerHook):
    """Computes a middle block, or re-adds its remembered residual (at ``Layer.SKIP``: it may skip the call)."""

    may_skip = True

    def __init__(self, engine: PruneEngine, slot: BlockSlot, module: torch.nn.Module) -> None:
        self.engine = engine
        self.slot = slot
        self._reader = ForwardArgs(module, (slot.group.hidden_arg, slot.group.encoder_arg))
        self._check = FirstCallCheck(slot)

    def around(self, forward: Callable[..., Any], module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        state = self.engine.tracker.active
        if state is None:
            return forward(*args, **kwargs)
        if self.slot.role != "middle":
            return compute_checked(state, self._check, forward, module, args, kwargs)
        group, pattern = self.slot.group, self.slot.pattern
        hidden = self._reader.get(group.hidden_arg, args, kwargs)
        encoder = self._reader.get(group.encoder_arg, args, kwargs) if pattern.takes_encoder else None
        memory: _BlockMemory | None = state.block_memory.get(self.slot.index)
        if self.engine.may_prune(state, memory, hidden):
            memory.continuous += 1
            state.pruned[-1] += 1
            hidden_out = hidden + memory.hidden_residual
            encoder_out = encoder + memory.encoder_residual if memory.encoder_residual is not None else encoder
            packed = pattern.pack(hidden_out, encoder_out)
            return (*packed, *memory.extras) if memory.extras else packed
        output = compute_checked(state, self._check, forward, module, args, kwargs)
        hidden_out, encoder_out = pattern.unpack(output)
        encoder_residual = None
        if encoder is not None and encoder_out is not None and encoder_out.shape == encoder.shape:
            encoder_residual = encoder_out - encoder
        state.block_memory[self.slot.index] = _BlockMemory(
            hidden, hidden_out - hidden, encoder_residual, pattern.extras(output)
        )
        return output


def install(
    transformer: torch.nn.Module,
    groups: Groups,
    config: DBPrune,
    timestep_arg: str | None,
    reducer: Reducer | None = None,
    unstepped: Mapping[str, tuple[Any, ...]] | None = None,
    timestep_reduce: str = "max",
) -> tuple[PruneEngine, Callable[[], None]]:
    """Install the transformer hook and one prune hook per block; return the engine and the undo."""
    slots = plan_slots(groups, config.fn, config.bn, owner=type(config).__name__)
    engine = PruneEngine(config, slots, reducer)
    track = TransformerCacheHook(engine, transformer, timestep_arg, unstepped, timestep_reduce)
    undo = [layers.install(transformer, layers.Layer.TRACK, TRANSFORMER_HOOK, track)]
    blocks = [block for _, group_blocks in groups for block in group_blocks]
    for slot, block in zip(slots, blocks, strict=True):
        undo.append(layers.install(block, layers.Layer.SKIP, BLOCK_HOOK, BlockPruneHook(engine, slot, block)))

    def remove() -> None:
        for fn in reversed(undo):
            fn()

    return engine, remove
