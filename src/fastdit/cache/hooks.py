"""DBCache as removable hooks on the transformer and on each block (the model's own loop keeps running).

Roles, in block order across every block list of the adapter:

* **front** (the first ``fn`` blocks) always compute; the last front block measures the front residual and decides
  whether the middle blocks compute this step.
* **middle** blocks, grouped into one *segment* per block list, either compute (and the segment stores its residual)
  or pass their inputs through, the segment's last block adding the cached (or TaylorSeer-predicted) residual.
* **back** (the last ``bn`` blocks) always compute and repair the approximation.

Because the loop of the model is untouched, any work the model does between blocks still happens, and code that
reads ``transformer_blocks`` still finds the original modules.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.hooks.hooks import BaseState, StateManager

from fastdit.cache.policy import Reducer, decide
from fastdit.cache.state import BranchState, RunTracker, SegmentMemory
from fastdit.cache.taylorseer import taylor_predict, taylor_update
from fastdit.config import DBCache
from fastdit.models.base import BlockGroup, ForwardPattern

__all__ = ["BLOCK_HOOK", "TRANSFORMER_HOOK", "BlockSlot", "CacheEngine"]

TRANSFORMER_HOOK = "fastdit_cache_transformer"
BLOCK_HOOK = "fastdit_cache_block"


class _NoState(BaseState):
    def reset(self, *args: Any, **kwargs: Any) -> None:
        pass


class _ContextProbe(StateManager):
    """Receives the context diffusers pipelines announce with ``transformer.cache_context(name, ...)``."""

    def __init__(self) -> None:
        super().__init__(_NoState)

    @property
    def name(self) -> str:
        return self._context.name if self._context is not None else "default"


@dataclass(frozen=True)
class BlockSlot:
    """Where one block sits in the cache plan."""

    index: int
    role: str  # "front" | "middle" | "back"
    group: BlockGroup
    segment: int = -1
    last_in_segment: bool = False
    last_front: bool = False


class _ArgReader:
    """Reads named arguments from a block call, whether passed by position or keyword."""

    def __init__(self, block: torch.nn.Module, names: tuple[str, ...]) -> None:
        params = list(inspect.signature(type(block).forward).parameters)[1:]
        self._positions = {name: params.index(name) for name in names if name in params}

    def get(self, name: str, args: tuple, kwargs: dict) -> Any:
        if name in kwargs:
            return kwargs[name]
        position = self._positions.get(name)
        return args[position] if position is not None and position < len(args) else None


class CacheEngine:
    """The cache of one transformer: its plan, run tracker and decision settings."""

    def __init__(self, config: DBCache, slots: list[BlockSlot], reducer: Reducer | None = None) -> None:
        self.config = config
        self.slots = slots
        self.reducer = reducer
        self.tracker = RunTracker(separate_branches=config.separate_cfg is not False)

    @property
    def num_blocks(self) -> int:
        return len(self.slots)

    def begin_call(self, context: str, timestep: float | None, signature: tuple) -> None:
        state = self.tracker.begin_call(context, timestep, signature)
        state.blocks_total += self.num_blocks
        state.computing = True

    def decide(self, state: BranchState, residual: torch.Tensor) -> None:
        decide(self.config, state, residual, self.reducer)


class TransformerCacheHook(ModelHook):
    """Tells the engine where each transformer call begins (context, branch, step, new run)."""

    _is_stateful = True

    def __init__(self, engine: CacheEngine, timestep_arg: str | None) -> None:
        super().__init__()
        self.engine = engine
        self.probe = _ContextProbe()
        self.timestep_arg = timestep_arg
        self._reader: _ArgReader | None = None

    def initialize_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        self._reader = _ArgReader(module, (self.timestep_arg,) if self.timestep_arg else ())
        return module

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        timestep = None
        if self.timestep_arg:
            value = self._reader.get(self.timestep_arg, args, kwargs)
            if isinstance(value, torch.Tensor):
                # Some pipelines pass one timestep per token or frame, with conditioning tokens pinned at 0: the
                # largest entry is the one that follows the schedule.
                timestep = float(value.max())
            elif isinstance(value, (int, float)):
                timestep = float(value)
        signature = tuple(tuple(a.shape) for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
        self.engine.begin_call(self.probe.name, timestep, signature)
        return args, kwargs

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        self.engine.tracker.end_call()
        return output

    def reset_state(self, module: torch.nn.Module) -> torch.nn.Module:
        self.engine.tracker.reset()
        return module


class BlockCacheHook(ModelHook):
    """Runs, skips or repairs one block according to its :class:`BlockSlot` and the step's decision."""

    def __init__(self, engine: CacheEngine, slot: BlockSlot) -> None:
        super().__init__()
        self.engine = engine
        self.slot = slot
        self.compute_fn: Any = None  # set by apply_compile; None runs the original forward
        self._reader: _ArgReader | None = None

    def initialize_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        self._reader = _ArgReader(module, (self.slot.group.hidden_arg, self.slot.group.encoder_arg))
        return module

    def _compute(self, state: BranchState, args: tuple, kwargs: dict) -> Any:
        state.blocks_computed += 1
        return (self.compute_fn or self.fn_ref.original_forward)(*args, **kwargs)

    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        state = self.engine.tracker.active
        if state is None:  # called outside a transformer forward: nothing to cache
            return (self.compute_fn or self.fn_ref.original_forward)(*args, **kwargs)
        slot = self.slot
        group = slot.group
        hidden = self._reader.get(group.hidden_arg, args, kwargs)
        if slot.role == "front":
            if state.front_entered_step != state.step:  # first front block called in this step
                state.front_hidden_in, state.front_entered_step = hidden, state.step
            output = self._compute(state, args, kwargs)
            if slot.last_front:
                self._decide(state, output)
            return output
        if slot.role == "back":
            return self._compute(state, args, kwargs)
        encoder = self._reader.get(group.encoder_arg, args, kwargs) if group.pattern.takes_encoder else None
        memory = state.segment(slot.segment)
        if memory.entered_step != state.step:  # first middle block of this segment called in this step
            memory.hidden_in, memory.encoder_in, memory.entered_step = hidden, encoder, state.step
        if state.computing:
            output = self._compute(state, args, kwargs)
            state.block_memory[slot.index] = group.pattern.extras(output)
            if slot.last_in_segment:
                self._remember(state, memory, output)
            return output
        return self._replay(state, memory, hidden, encoder)

    def _decide(self, state: BranchState, output: Any) -> None:
        hidden_out, _ = self.slot.group.pattern.unpack(output)
        hidden_in = state.front_hidden_in if state.front_entered_step == state.step else None
        if hidden_in is None or hidden_out.shape != hidden_in.shape:
            raise ValueError(
                f"DBCache.fn={self.engine.config.fn}: the hidden stream changes shape across the front blocks "
                f"({None if hidden_in is None else tuple(hidden_in.shape)} -> {tuple(hidden_out.shape)}); "
                "choose fn within the first block list"
            )
        self.engine.decide(state, hidden_out - hidden_in)

    def _remember(self, state: BranchState, memory: SegmentMemory, output: Any) -> None:
        pattern: ForwardPattern = self.slot.group.pattern
        hidden_out, encoder_out = pattern.unpack(output)
        memory.hidden_residual = hidden_out - memory.hidden_in
        memory.encoder_out = encoder_out
        memory.encoder_residual = None
        if encoder_out is not None and memory.encoder_in is not None and encoder_out.shape == memory.encoder_in.shape:
            memory.encoder_residual = encoder_out - memory.encoder_in
        taylor = self.engine.config.taylorseer
        if taylor is not None:
            memory.taylor = taylor_update(
                memory.taylor, memory.taylor_step, memory.hidden_residual, state.step, taylor.order
            )
            if memory.encoder_residual is not None:
                memory.taylor_encoder = taylor_update(
                    memory.taylor_encoder, memory.taylor_step, memory.encoder_residual, state.step, taylor.order
                )
            memory.taylor_step = state.step

    def _replay(
        self, state: BranchState, memory: SegmentMemory, hidden: torch.Tensor, encoder: torch.Tensor | None
    ) -> Any:
        pattern = self.slot.group.pattern
        extras = state.block_memory.get(self.slot.index, ())
        encoder_out = encoder if pattern.takes_encoder else memory.encoder_out
        if self.slot.last_in_segment:
            hidden = memory.hidden_in + self._residual(memory, state.step, encoder=False)
            if memory.encoder_residual is not None:
                encoder_out = memory.encoder_in + self._residual(memory, state.step, encoder=True)
            elif pattern.returns_encoder:
                encoder_out = memory.encoder_out if memory.encoder_out is None else encoder_out
        packed = pattern.pack(hidden, encoder_out)
        return (*packed, *extras) if extras else packed

    def _residual(self, memory: SegmentMemory, step: int, *, encoder: bool) -> torch.Tensor:
        coefficients = memory.taylor_encoder if encoder else memory.taylor
        if self.engine.config.taylorseer is not None and len(coefficients) > 1:
            return taylor_predict(coefficients, memory.taylor_step, step)
        return memory.encoder_residual if encoder else memory.hidden_residual


def plan_slots(groups: list[tuple[BlockGroup, torch.nn.ModuleList]], fn: int, bn: int) -> list[BlockSlot]:
    """Assign each block its role (front / middle / back) and middle segment."""
    total = sum(len(blocks) for _, blocks in groups)
    if fn + bn >= total:
        raise ValueError(f"DBCache(fn={fn}, bn={bn}): leaves no middle block to cache in a model of {total} blocks")
    slots: list[BlockSlot] = []
    index = 0
    for group_index, (group, blocks) in enumerate(groups):
        middle = [i for i in range(index, index + len(blocks)) if fn <= i < total - bn]
        for i in range(index, index + len(blocks)):
            if i < fn:
                slots.append(BlockSlot(index=i, role="front", group=group, last_front=i == fn - 1))
            elif i >= total - bn:
                slots.append(BlockSlot(index=i, role="back", group=group))
            else:
                slots.append(
                    BlockSlot(
                        index=i,
                        role="middle",
                        group=group,
                        segment=group_index,
                        last_in_segment=i == middle[-1],
                    )
                )
        index += len(blocks)
    return slots


def install(
    transformer: torch.nn.Module,
    groups: list[tuple[BlockGroup, torch.nn.ModuleList]],
    config: DBCache,
    timestep_arg: str | None,
    reducer: Reducer | None = None,
) -> CacheEngine:
    """Register the transformer hook and one block hook per block; return the engine."""
    slots = plan_slots(groups, config.fn, config.bn)
    engine = CacheEngine(config, slots, reducer)
    registry = HookRegistry.check_if_exists_or_initialize(transformer)
    registry.register_hook(TransformerCacheHook(engine, timestep_arg), TRANSFORMER_HOOK)
    blocks = [block for _, group_blocks in groups for block in group_blocks]
    for slot, block in zip(slots, blocks, strict=True):
        HookRegistry.check_if_exists_or_initialize(block).register_hook(BlockCacheHook(engine, slot), BLOCK_HOOK)
    if hasattr(registry, "invalidate_child_registries_cache"):
        registry.invalidate_child_registries_cache()  # so cache_context reaches hooks registered after it ran
    return engine


def uninstall(transformer: torch.nn.Module, groups: list[tuple[BlockGroup, torch.nn.ModuleList]]) -> None:
    """Remove every hook :func:`install` registered."""
    HookRegistry.check_if_exists_or_initialize(transformer).remove_hook(TRANSFORMER_HOOK, recurse=False)
    for _, blocks in groups:
        for block in blocks:
            HookRegistry.check_if_exists_or_initialize(block).remove_hook(BLOCK_HOOK, recurse=False)
