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

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fastdit.cache.forecast import forecast_predict, forecast_update
from fastdit.cache.policy import Reducer, check_run_length, decide
from fastdit.cache.reuse import ReuseStats
from fastdit.cache.state import BranchState, RunTracker, SegmentMemory
from fastdit.cache.steptime import TimestepReader
from fastdit.cache.taylorseer import taylor_position
from fastdit.config import DBCache, MagCache, TeaCache
from fastdit.errors import FastditWarning, FieldsError
from fastdit.hooks import layers
from fastdit.hooks.args import ForwardArgs, UnsteppedCalls
from fastdit.models.base import BlockGroup, ForwardPattern, LatentLayout
from fastdit.models.validate import AdapterError, bind_block_args, check_block_call

__all__ = ["BLOCK_HOOK", "TRANSFORMER_HOOK", "BlockSlot", "CacheEngine"]

TRANSFORMER_HOOK = "cache.transformer"
# More consecutive calls at one timestep than any guidance scheme makes (cond, uncond, skip-layer, image guidance).
_MAX_BRANCHES = 8
BLOCK_HOOK = "cache.block"
INTERLEAVED_HOOK = "cache.interleaved"


@dataclass(frozen=True)
class BlockSlot:
    """Where one block sits in the cache plan."""

    index: int
    role: str  # "front" | "middle" | "back"
    group: BlockGroup
    pattern: ForwardPattern  # this block's own (the group's, or its override)
    position: int = 0  # index within its group's list
    segment: int = -1
    last_in_segment: bool = False
    last_front: bool = False

    @property
    def name(self) -> str:
        """The block's path, e.g. ``transformer_blocks.3``."""
        return f"{self.group.path}.{self.position}"

    @property
    def passes_through(self) -> bool:
        """Whether a cached step passes this block's input through (a middle block that is not its segment's last)."""
        return self.role == "middle" and not self.last_in_segment


class CacheEngine:
    """The cache of one transformer: its plan, run tracker and decision settings."""

    def __init__(
        self, config: DBCache | MagCache | TeaCache, slots: list[BlockSlot], reducer: Reducer | None = None
    ) -> None:
        self.config = config
        self.slots = slots
        self.reducer = reducer
        self.tracker = RunTracker(separate_branches=config.separate_cfg is not False)
        self.reuse: ReuseStats | None = None  # the step-invariant modules' statistics (set by apply_cache)

    @property
    def num_blocks(self) -> int:
        return len(self.slots)

    def begin_call(self, context: str, timestep: float | None, signature: tuple, key: int | None = None) -> None:
        """Start a transformer call: find its branch and step; refuse a step the step mask does not cover.

        Raises:
            FieldError: ``StepMask.num_steps`` is shorter than the run (the whole scheduled run, checked at its
                first step, or the step counter, which is equal on every rank).
        """
        state = self.tracker.begin_call(context, timestep, signature, key)
        mask = self.config.step_mask
        if state.step == 0 and self.tracker.schedule is not None:
            scheduled = self.tracker.schedule()
            if scheduled is not None:
                check_run_length(mask, scheduled)
        check_run_length(mask, state.step + 1, reached=True)
        state.blocks_total += self.num_blocks
        state.computing = True

    @property
    def reads_latent(self) -> bool:
        """Whether :meth:`observe_latent` wants each call's noisy latent (a policy measuring the latent itself)."""
        return False

    def observe_latent(self, latent: Any, layout: LatentLayout, family: str = "") -> None:
        """A transformer call began with the noisy latent ``latent`` (laid out as ``layout`` declares, by the adapter
        of ``family``), whole on every rank: read only when :attr:`reads_latent`."""

    def enter_stack(self, state: BranchState, hidden: torch.Tensor) -> None:
        """The step's first block is called with ``hidden``; a policy that decides on the stack's input does it here.

        DBCache decides after its front blocks (:meth:`decide`), so nothing happens here.
        """

    def decide(self, state: BranchState, residual: torch.Tensor) -> None:
        decide(self.config, state, residual, self.reducer)

    def end_call(self) -> None:
        """End a transformer call (it may have raised)."""
        self.tracker.end_call()


class TransformerCacheHook(layers.LayerHook):
    """Tells the engine where each transformer call begins (context, branch, step, new run).

    Sits at :attr:`~fastdit.hooks.layers.Layer.TRACK`: outside the parallel splits, so every rank reads the same
    global timestep and shapes and counts steps alike.
    """

    def __init__(
        self,
        engine: Any,
        module: torch.nn.Module,
        timestep_arg: str | None,
        unstepped: Mapping[str, tuple[Any, ...]] | None = None,
        timestep_reduce: str = "max",
        latent: LatentLayout | None = None,
        family: str = "",
    ) -> None:
        self.engine = engine
        self._family = family
        self.timestep_arg = timestep_arg
        self._times = TimestepReader(torch.amin if timestep_reduce == "min" else torch.amax, type(module).__name__)
        # The latent is read here, outside the parallel splits: every rank sees all of it.
        self._latent = latent if latent is not None and getattr(engine, "reads_latent", False) else None
        names = [name for name in (timestep_arg, None if self._latent is None else self._latent.arg) if name]
        self._reader = ForwardArgs(module, names)
        self._unstepped = UnsteppedCalls(module, unstepped)
        self._marks_unstepped = bool(self._unstepped)
        self._stack: layers.LayerStack | None = None  # found at the first call (see :meth:`around`)
        self._owner = type(module).__name__
        self._last: Any = None
        self._repeats = 0
        self._warned = False

    def _timestep(self, value: Any, context: str) -> tuple[float | None, int | None]:
        """The call's timestep and, when the scheduler clock gave it, its step index (see :class:`TimestepReader`)."""
        key = None
        if isinstance(value, torch.Tensor):
            # Some pipelines pass one timestep per token or frame, with conditioning tokens pinned at 0: the
            # largest entry is the one that follows the schedule (the smallest where the family says so: MiniMax-H3's
            # keyframe rows stay pinned near clean on a rising schedule, :attr:`ModelAdapter.timestep_reduce`).
            tracker = self.engine.tracker
            timestep, key = self._times.read(value, tracker.clock, context)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            timestep = float(value)
        else:
            timestep = None
            if self.timestep_arg is not None:
                self._warn(f"received {type(value).__name__} for it, not a number or tensor")
        marker = timestep if key is None else ("step", key)
        self._repeats = self._repeats + 1 if marker is not None and marker == self._last else 0
        self._last = marker
        if self._repeats == _MAX_BRANCHES:
            where = f"the same value {timestep:g}" if key is None else f"scheduler step index {key}"
            self._warn(f"read {where} in {_MAX_BRANCHES + 1} consecutive calls")
        return timestep, key

    def _warn(self, what: str) -> None:
        # The run tracker tells steps, CFG branches and new runs apart by the timestep: without a usable one,
        # consecutive runs merge (warm-up lost) and same-step calls read as ever more branches (nothing cached).
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"{self._owner}: timestep_arg={self.timestep_arg!r} {what}, so it does not follow the sampler's "
                "schedule: fastdit cannot tell where runs and CFG branches begin. Name the forward parameter that "
                "carries the timestep in the adapter, or call fastdit.reset(model) before each run",
                FastditWarning,
                stacklevel=2,
            )

    def around(self, inner: Callable[..., Any], module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if self._marks_unstepped and self._unstepped(args, kwargs):
            # No call begins: the block hooks find no active step and compute, and no step, branch or run counts it.
            return inner(*args, **kwargs)
        # The timestep's own shape is left out: MiniMax-H3 passes the distinct noise levels of its rows, one entry
        # at the first step (all rows at 0) and two after it; every other model's batch shows in its inputs anyway.
        timestep = self._reader.get(self.timestep_arg, args, kwargs) if self.timestep_arg else None
        signature = tuple(
            [tuple(a.shape) for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a is not timestep]
        )
        stack = self._stack
        if stack is None:
            # The module's stack holds this hook, so it stays the module's stack while the hook is installed.
            stack = self._stack = layers.stack_of(module)
        context = "default" if stack is None else stack.probe.name  # :func:`layers.announced_context`
        try:  # a refused call ends too: no block hook may think it runs inside it
            step_time, key = self._timestep(timestep, context)
            self.engine.begin_call(context, step_time, signature, key)
            if self._latent is not None:
                latent = self._reader.get(self._latent.arg, args, kwargs)
                self.engine.observe_latent(latent, self._latent, self._family)
            return inner(*args, **kwargs)
        finally:
            self.engine.end_call()

    def reset(self) -> None:
        self._times.check()  # the run is over: its device timesteps are read without holding anything up
        self.engine.tracker.reset()
        self._last, self._repeats = None, 0  # a new run may start at the last one's timestep (one-step samplers)


class BlockCacheHook(layers.LayerHook):
    """Runs, skips or repairs one block according to its :class:`BlockSlot` and the step's decision.

    Sits at :attr:`~fastdit.hooks.layers.Layer.SKIP`: on a cached step it returns without calling what it wraps,
    so it nests inside every parallel transform on the block (a gather at the last block still runs).
    """

    may_skip = True

    def __init__(self, engine: CacheEngine, slot: BlockSlot, module: torch.nn.Module) -> None:
        self.engine = engine
        self.slot = slot
        group, pattern = slot.group, slot.pattern
        self._reader = ForwardArgs(module, (group.hidden_arg, group.encoder_arg))
        self._check = FirstCallCheck(slot)
        # Everything a call asks of the slot, its pattern and the engine, looked up once: a cached step calls the
        # hook of every block it skips (56 of FLUX's 57), so each lookup is paid ~60 times per transformer call.
        self._tracker = engine.tracker
        self._hidden_arg = group.hidden_arg
        self._hidden_at = self._reader.positions[group.hidden_arg]
        self._takes_encoder = pattern.takes_encoder
        self._encoder_arg = group.encoder_arg
        self._encoder_at = self._reader.positions[group.encoder_arg]
        self._pack = _packer(pattern)
        self._passes_through = slot.passes_through
        self._segment = slot.segment
        self._index = slot.index

    def skip_group(self) -> object | None:
        # Front and back blocks always compute; the middle blocks compute, or pass through, together in one call.
        return self.engine if self.slot.role == "middle" else None

    def around(self, inner: Callable[..., Any], module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        state = self._tracker.active
        if state is None:  # called outside a transformer forward: nothing to cache
            return inner(*args, **kwargs)
        if self._passes_through and not state.computing:
            memory = state.segments.get(self._segment)
            if memory is not None and memory.entered_step == state.step:
                # A cached step, past its segment's first called block (which recorded the segment's input, and
                # the stack's entry before it): the block's output is its own input, so nothing else is read, set
                # or decided — what :meth:`_replay` returns for it, without the general path's bookkeeping.
                name = self._hidden_arg
                hidden = kwargs[name] if name in kwargs else _positional(args, self._hidden_at)
                if self._takes_encoder:
                    name = self._encoder_arg
                    encoder = kwargs[name] if name in kwargs else _positional(args, self._encoder_at)
                else:
                    encoder = memory.encoder_out
                packed = self._pack(hidden, encoder)
                extras = state.block_memory.get(self._index)
                return (*packed, *extras) if extras else packed
        return self._route(state, inner, module, args, kwargs)

    def _route(
        self, state: BranchState, inner: Callable[..., Any], module: torch.nn.Module, args: tuple, kwargs: dict
    ) -> Any:
        """Every call but a passed-through one in a cached step: by the block's role and the step's decision."""
        slot = self.slot
        hidden = self._reader.get(self._hidden_arg, args, kwargs)
        if state.stack_entered_step != state.step:  # the first block called in this step, front or middle
            state.stack_entered_step = state.step
            self.engine.enter_stack(state, hidden)
        role = slot.role
        if role == "front":
            if state.front_entered_step != state.step:  # first front block called in this step
                state.front_hidden_in, state.front_entered_step = hidden, state.step
            output = compute_checked(state, self._check, inner, module, args, kwargs)
            if slot.last_front:
                self._decide(state, output)
            return output
        if role == "back":
            return compute_checked(state, self._check, inner, module, args, kwargs)
        encoder = self._reader.get(self._encoder_arg, args, kwargs) if self._takes_encoder else None
        memory = state.segment(self._segment)
        if memory.entered_step != state.step:  # first middle block of this segment called in this step
            memory.hidden_in, memory.encoder_in, memory.entered_step = hidden, encoder, state.step
        if state.computing:
            output = compute_checked(state, self._check, inner, module, args, kwargs)
            state.block_memory[self._index] = slot.pattern.extras(output)
            if slot.last_in_segment:
                self._remember(state, memory, output)
            return output
        return self._replay(state, memory, hidden, encoder)

    def _decide(self, state: BranchState, output: Any) -> None:
        hidden_out, _ = self.slot.pattern.unpack(output)
        hidden_in = state.front_hidden_in if state.front_entered_step == state.step else None
        if hidden_in is None or hidden_out.shape != hidden_in.shape:
            raise ValueError(
                f"DBCache.fn={self.engine.config.fn}: the hidden stream changes shape across the front blocks "
                f"({None if hidden_in is None else tuple(hidden_in.shape)} -> {tuple(hidden_out.shape)}); "
                "choose fn within the first block list"
            )
        self.engine.decide(state, hidden_out - hidden_in)

    def _remember(self, state: BranchState, memory: SegmentMemory, output: Any) -> None:
        hidden_out, encoder_out = self.slot.pattern.unpack(output)
        memory.hidden_residual = hidden_out - memory.hidden_in
        memory.encoder_out = encoder_out
        memory.encoder_residual = None
        if encoder_out is not None and memory.encoder_in is not None and encoder_out.shape == memory.encoder_in.shape:
            memory.encoder_residual = encoder_out - memory.encoder_in
        taylor = self.engine.config.taylorseer
        if taylor is not None:
            position = taylor_position(taylor, state.step, state.timestep)
            forecast_update(taylor, memory.forecast, memory.hidden_residual, position, state.step)
            if memory.encoder_residual is not None:
                forecast_update(taylor, memory.forecast_encoder, memory.encoder_residual, position, state.step)

    def _replay(
        self, state: BranchState, memory: SegmentMemory, hidden: torch.Tensor, encoder: torch.Tensor | None
    ) -> Any:
        pattern = self.slot.pattern
        extras = state.block_memory.get(self.slot.index, ())
        encoder_out = encoder if pattern.takes_encoder else memory.encoder_out
        if self.slot.last_in_segment:
            hidden = memory.hidden_in + self._residual(memory, state, encoder=False)
            if memory.encoder_residual is not None:
                encoder_out = memory.encoder_in + self._residual(memory, state, encoder=True)
            elif pattern.returns_encoder:
                encoder_out = memory.encoder_out if memory.encoder_out is None else encoder_out
        packed = pattern.pack(hidden, encoder_out)
        return (*packed, *extras) if extras else packed

    def _residual(self, memory: SegmentMemory, state: BranchState, *, encoder: bool) -> torch.Tensor:
        forecast = memory.forecast_encoder if encoder else memory.forecast
        taylor = self.engine.config.taylorseer
        if taylor is not None and forecast.ready:
            return forecast_predict(taylor, forecast, taylor_position(taylor, state.step, state.timestep))
        return memory.encoder_residual if encoder else memory.hidden_residual


def plan_slots(
    groups: list[tuple[BlockGroup, torch.nn.ModuleList]],
    fn: int,
    bn: int,
    *,
    owner: str = "DBCache",
    where: tuple[str, str] | None = None,
) -> list[BlockSlot]:
    """Assign each block its role (front / middle / back) and middle segment.

    Raises:
        FieldsError: ``fn + bn`` leaves no middle block (``owner`` is the config class; ``where`` is the model's
            component and class names, for the message).
    """
    total = sum(len(blocks) for _, blocks in groups)
    if fn + bn >= total:
        model = f"{where[0]} ({where[1]}, {total} blocks)" if where else f"a model of {total} blocks"
        raise FieldsError(
            owner, {"fn": fn, "bn": bn}, f"leaves no middle block to cache in {model}: fn + bn must be below {total}"
        )
    slots: list[BlockSlot] = []
    index = 0
    for group_index, (group, blocks) in enumerate(groups):
        middle = [i for i in range(index, index + len(blocks)) if fn <= i < total - bn]
        for i in range(index, index + len(blocks)):
            where = {"group": group, "pattern": group.pattern_at(i - index, len(blocks)), "position": i - index}
            if i < fn:
                slots.append(BlockSlot(index=i, role="front", last_front=i == fn - 1, **where))
            elif i >= total - bn:
                slots.append(BlockSlot(index=i, role="back", **where))
            else:
                slots.append(
                    BlockSlot(
                        index=i,
                        role="middle",
                        **where,
                        segment=group_index,
                        last_in_segment=i == middle[-1],
                    )
                )
        index += len(blocks)
    return slots


def _positional(args: tuple, position: int | None) -> Any:
    """The argument at ``position`` (``None``: the parameter is not located), or ``None`` if the call has fewer
    (:meth:`ForwardArgs.get` for an argument not passed by keyword)."""
    return args[position] if position is not None and position < len(args) else None


def _hidden_only(hidden: torch.Tensor, encoder: torch.Tensor | None) -> Any:
    return hidden


def _hidden_first(hidden: torch.Tensor, encoder: torch.Tensor | None) -> Any:
    return hidden, encoder


def _encoder_first(hidden: torch.Tensor, encoder: torch.Tensor | None) -> Any:
    return encoder, hidden


def _packer(pattern: ForwardPattern) -> Callable[[torch.Tensor, torch.Tensor | None], Any]:
    """:meth:`ForwardPattern.pack` of ``pattern`` as a plain function (no enum property is read per call)."""
    if not pattern.returns_encoder:
        return _hidden_only
    return _encoder_first if pattern.encoder_first else _hidden_first


def _compute(state: BranchState, inner: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    state.blocks_computed += 1
    return inner(*args, **kwargs)


class FirstCallCheck:
    """The declared pattern of one block checked against its first computed call (a wrong one garbles silently).

    Runs once per block, eagerly, before the block's output is used: shapes, the returned structure, and for two
    streams of equal shape whether they come back the other way round.
    """

    def __init__(self, slot: BlockSlot) -> None:
        self.slot = slot
        self.pending = True

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self.pending = False
        slot = self.slot
        try:
            bound = bind_block_args(module, args, kwargs)
        except TypeError as exc:
            raise AdapterError(
                f"block {slot.name}: its call does not bind to {type(module).__name__}.forward: {exc}"
            ) from None
        problem = check_block_call(slot.group, slot.pattern, bound, output)
        if problem is not None:
            raise AdapterError(
                f"block {slot.name} ({type(module).__name__}, declared pattern {slot.pattern.value}): {problem}; "
                "fix the adapter's BlockGroup (pattern, pattern_overrides, hidden_arg, encoder_arg)"
            )


def compute_checked(
    state: BranchState,
    check: FirstCallCheck,
    inner: Callable[..., Any],
    module: torch.nn.Module,
    args: tuple,
    kwargs: dict,
) -> Any:
    """Compute a block (counted), checking its declared pattern at its first call."""
    output = _compute(state, inner, args, kwargs)
    if check.pending:
        check(module, args, kwargs, output)
    return output


class InterleavedSkipHook(layers.LayerHook):
    """A block of an interleaved list (:attr:`BlockGroup.interleaved`) whose output a cached step discards.

    The loop runs block ``i`` of the interleaved list right after block ``i`` of the cached group. When the group's
    block passes its input through on a cached step, the segment's last block replaces the stream by ``input +
    residual``, so whatever the interleaved block computed in between is thrown away: it passes its input through
    too (the same output, less compute).
    """

    may_skip = True

    def __init__(
        self, engine: CacheEngine, slot: BlockSlot, group: BlockGroup, pattern: ForwardPattern, module: torch.nn.Module
    ) -> None:
        self.engine = engine
        self.slot = slot
        self.group = group
        self.pattern = pattern
        self._reader = ForwardArgs(module, (group.hidden_arg, group.encoder_arg))
        # Looked up once, not per call (as for :class:`BlockCacheHook`).
        self._tracker = engine.tracker
        self._passes_through = slot.passes_through
        self._takes_encoder = pattern.takes_encoder
        self._pack = _packer(pattern)

    def skip_group(self) -> object | None:
        # Skipped exactly when the cached group's middle blocks pass through: the same decision.
        return self.engine if self.slot.passes_through else None

    def around(self, inner: Callable[..., Any], module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        state = self._tracker.active
        if state is None or state.computing or not self._passes_through:
            return inner(*args, **kwargs)
        group = self.group
        hidden = self._reader.get(group.hidden_arg, args, kwargs)
        encoder = self._reader.get(group.encoder_arg, args, kwargs) if self._takes_encoder else None
        return self._pack(hidden, encoder)


Groups = list[tuple[BlockGroup, torch.nn.ModuleList]]


def install(
    transformer: torch.nn.Module,
    groups: Groups,
    config: DBCache | MagCache | TeaCache,
    timestep_arg: str | None,
    reducer: Reducer | None = None,
    interleaved: Groups | None = None,
    unstepped: Mapping[str, tuple[Any, ...]] | None = None,
    engine_class: type[CacheEngine] | None = None,
    timestep_reduce: str = "max",
    latent: LatentLayout | None = None,
    family: str = "",
) -> tuple[CacheEngine, Callable[[], None]]:
    """Install the transformer hook and one block hook per block; return the engine and the undo.

    Args:
        transformer: The denoiser.
        groups: Its block lists (resolved), in execution order.
        config: The cache settings.
        timestep_arg: The ``forward`` parameter carrying the timestep.
        reducer: Sums small tensors across the ranks that share a sample.
        interleaved: Per group, the resolved :attr:`BlockGroup.interleaved` list (or ``None``), same order.
        unstepped: Arguments marking calls that are no denoising step (:attr:`ModelAdapter.unstepped_calls`).
        engine_class: The engine deciding each step (``None``: :class:`CacheEngine`, DBCache's residual test).
        timestep_reduce: Which entry of a timestep tensor follows the schedule (:attr:`ModelAdapter.timestep_reduce`).
        latent: Where the noisy latent arrives (:attr:`ModelAdapter.latent`), for an engine that reads it.
        family: The adapter's family, for messages.
    """
    slots = plan_slots(groups, config.fn, config.bn, owner=type(config).__name__)
    engine = (engine_class or CacheEngine)(config, slots, reducer)
    undo = [
        layers.install(
            transformer,
            layers.Layer.TRACK,
            TRANSFORMER_HOOK,
            TransformerCacheHook(engine, transformer, timestep_arg, unstepped, timestep_reduce, latent, family),
        )
    ]
    blocks = [block for _, group_blocks in groups for block in group_blocks]
    for slot, block in zip(slots, blocks, strict=True):
        undo.append(layers.install(block, layers.Layer.SKIP, BLOCK_HOOK, BlockCacheHook(engine, slot, block)))
    undo += _install_interleaved(engine, groups, interleaved or [None] * len(groups), slots)
    return engine, _undo_all(undo)


def _install_interleaved(
    engine: CacheEngine, groups: Groups, interleaved: list, slots: list[BlockSlot]
) -> list[Callable[[], None]]:
    undo = []
    start = 0
    for (_, blocks), companion in zip(groups, interleaved, strict=True):
        if companion is not None:
            group, companion_blocks = companion
            for i, block in enumerate(companion_blocks):
                pattern = group.pattern_at(i, len(companion_blocks))
                hook = InterleavedSkipHook(engine, slots[start + i], group, pattern, block)
                undo.append(layers.install(block, layers.Layer.SKIP, INTERLEAVED_HOOK, hook))
        start += len(blocks)
    return undo


def _undo_all(undo: list[Callable[[], None]]) -> Callable[[], None]:
    def remove() -> None:
        for fn in reversed(undo):
            fn()

    return remove
