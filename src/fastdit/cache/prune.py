"""DBPrune: skip individual middle blocks whose input barely changed since they last ran.

Each middle block remembers the input it last computed on and the residual it produced. When its current input
differs from that one by less than ``threshold`` (relative L1, reduced over ranks), the block is skipped and its
residual re-added. Front and back blocks always compute, as in DBCache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from diffusers.hooks import HookRegistry, ModelHook

from fastdit.cache.hooks import BLOCK_HOOK, TRANSFORMER_HOOK, BlockSlot, TransformerCacheHook, _ArgReader, plan_slots
from fastdit.cache.policy import Reducer, relative_l1
from fastdit.cache.state import BranchState, RunTracker
from fastdit.config import DBPrune
from fastdit.models.base import BlockGroup

__all__ = ["PruneEngine", "install", "uninstall"]


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
        self.num_middle = sum(slot.role == "middle" for slot in slots)

    def begin_call(self, context: str, timestep: float | None, signature: tuple) -> None:
        state = self.tracker.begin_call(context, timestep, signature)
        state.blocks_total += len(self.slots)
        state.pruned.append(0)

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


class BlockPruneHook(ModelHook):
    """Computes a middle block, or re-adds its remembered residual."""

    def __init__(self, engine: PruneEngine, slot: BlockSlot) -> None:
        super().__init__()
        self.engine = engine
        self.slot = slot
        self.compute_fn: Any = None
        self._reader: _ArgReader | None = None

    def initialize_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        self._reader = _ArgReader(module, (self.slot.group.hidden_arg, self.slot.group.encoder_arg))
        return module

    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        forward = self.compute_fn or self.fn_ref.original_forward
        state = self.engine.tracker.active
        if state is None:
            return forward(*args, **kwargs)
        if self.slot.role != "middle":
            state.blocks_computed += 1
            return forward(*args, **kwargs)
        group = self.slot.group
        hidden = self._reader.get(group.hidden_arg, args, kwargs)
        encoder = self._reader.get(group.encoder_arg, args, kwargs) if group.pattern.takes_encoder else None
        memory: _BlockMemory | None = state.block_memory.get(self.slot.index)
        if self.engine.may_prune(state, memory, hidden):
            memory.continuous += 1
            state.pruned[-1] += 1
            hidden_out = hidden + memory.hidden_residual
            encoder_out = encoder + memory.encoder_residual if memory.encoder_residual is not None else encoder
            packed = group.pattern.pack(hidden_out, encoder_out)
            return (*packed, *memory.extras) if memory.extras else packed
        state.blocks_computed += 1
        output = forward(*args, **kwargs)
        hidden_out, encoder_out = group.pattern.unpack(output)
        encoder_residual = None
        if encoder is not None and encoder_out is not None and encoder_out.shape == encoder.shape:
            encoder_residual = encoder_out - encoder
        state.block_memory[self.slot.index] = _BlockMemory(
            hidden, hidden_out - hidden, encoder_residual, group.pattern.extras(output)
        )
        return output


def install(
    transformer: torch.nn.Module,
    groups: list[tuple[BlockGroup, torch.nn.ModuleList]],
    config: DBPrune,
    timestep_arg: str | None,
    reducer: Reducer | None = None,
) -> PruneEngine:
    """Register the transformer hook and one prune hook per block."""
    slots = plan_slots(groups, config.fn, config.bn)
    engine = PruneEngine(config, slots, reducer)
    HookRegistry.check_if_exists_or_initialize(transformer).register_hook(
        TransformerCacheHook(engine, timestep_arg), TRANSFORMER_HOOK
    )
    blocks = [block for _, group_blocks in groups for block in group_blocks]
    for slot, block in zip(slots, blocks, strict=True):
        HookRegistry.check_if_exists_or_initialize(block).register_hook(BlockPruneHook(engine, slot), BLOCK_HOOK)
    return engine


def uninstall(transformer: torch.nn.Module, groups: list[tuple[BlockGroup, torch.nn.ModuleList]]) -> None:
    """Remove the hooks :func:`install` registered."""
    from fastdit.cache.hooks import uninstall as uninstall_cache

    uninstall_cache(transformer, groups)
