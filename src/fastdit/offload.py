"""Block offload: transformer blocks wait in host memory and come onto the device for their own call.

A streamed block's parameters and buffers live in (pinned) host memory; on the device the block holds empty
placeholders of the same dtype. Its hook at :attr:`~fastdit.hooks.layers.Layer.RESIDENT` — beneath every hook that
may skip the call — puts the weights in place, runs the block and lets them go, so a block that a cached step passes
through is never transferred.

While a block computes, the next streamed blocks that are *certain* to run are copied on a side stream. A block is
certain to run after another when every hook that could skip it would skip the other as well
(:meth:`~fastdit.hooks.layers.LayerHook.skip_group`): a cache's middle blocks compute together or not at all, so
they prefetch one another, and a front block never prefetches them (the last front block decides); blocks every step
runs are prefetched across the gap, and across the end of one transformer call into the next. The blocks every step
runs are also the first kept resident: then a cached step transfers nothing.

On the CPU a "transfer" is the host tensor itself (no copy): the mode checks the mechanics, not speed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fastdit.config import Offload
from fastdit.hooks import layers
from fastdit.hooks.state import Applied

__all__ = ["HOOK", "BlockStreamer", "apply_offload", "choose_resident", "move_components", "offload_device"]

HOOK = "offload"


@dataclass
class _Tensor:
    """One distinct tensor of a block: where it sits, its host copy and the device it came from."""

    owners: list[tuple[torch.nn.Module, str]]
    param: torch.nn.Parameter | None  # the parameter object (shared by every owner), or None for a buffer
    host: torch.Tensor
    origin: torch.device


class BlockWeights:
    """The parameters and buffers of one block, moved between host copies and device placeholders."""

    def __init__(self, block: torch.nn.Module, pin: bool) -> None:
        self.tensors: list[_Tensor] = []
        seen: dict[int, _Tensor] = {}
        for module in block.modules():
            for kind in ("_parameters", "_buffers"):
                for name, tensor in getattr(module, kind).items():
                    if tensor is None:
                        continue
                    entry = seen.get(id(tensor))
                    if entry is None:  # a tied tensor is moved once, for every module holding it
                        host = tensor.detach().to("cpu")
                        host = host.pin_memory() if pin else host
                        param = tensor if kind == "_parameters" else None
                        entry = seen[id(tensor)] = _Tensor([], param, host, tensor.device)
                        self.tensors.append(entry)
                    entry.owners.append((module, name))
        self.nbytes = sum(t.host.numel() * t.host.element_size() for t in self.tensors)

    def _set(self, entry: _Tensor, value: torch.Tensor) -> None:
        if entry.param is not None:
            entry.param.data = value
            return
        for module, name in entry.owners:
            module._buffers[name] = value

    def copy_to(self, device: torch.device) -> list[torch.Tensor]:
        """Device copies of every tensor (asynchronous from pinned memory on the current stream)."""
        return [t.host.to(device, non_blocking=True) for t in self.tensors]

    def install(self, values: Sequence[torch.Tensor]) -> None:
        """Put ``values`` (from :meth:`copy_to`) in place of the placeholders."""
        for entry, value in zip(self.tensors, values, strict=True):
            self._set(entry, value)

    def evict(self, device: torch.device) -> None:
        """Replace every tensor by an empty placeholder on ``device`` (dtype kept: modules read it)."""
        for entry in self.tensors:
            self._set(entry, torch.empty(0, dtype=entry.host.dtype, device=device))

    def restore(self) -> None:
        """Put every tensor back on the device it came from, with its original values."""
        for entry in self.tensors:
            self._set(entry, entry.host.to(entry.origin))


def skip_tokens(block: torch.nn.Module) -> frozenset[object]:
    """What may skip ``block``'s call: the skip group of every hook on it that may (empty: it always runs)."""
    stack = layers.stack_of(block)
    if stack is None:
        return frozenset()
    return frozenset(token for e in stack.entries if (token := e.hook.skip_group()) is not None)


def _spread(items: Sequence[int], count: int) -> list[int]:
    """``count`` of ``items`` evenly spaced (all of them when ``count >= len(items)``)."""
    if count >= len(items):
        return list(items)
    return [items[int((j + 0.5) * len(items) / count)] for j in range(count)]


def choose_resident(tokens: Sequence[frozenset[object]], count: int) -> set[int]:
    """The blocks that stay on the device: those every step runs first (leading ones first), then evenly spaced
    among the rest (a resident block between streamed ones gives their copies time)."""
    always = [i for i, t in enumerate(tokens) if not t]
    rest = [i for i, t in enumerate(tokens) if t]
    chosen = always[:count]  # the first ones when not all fit: the first block of a call then never waits
    return set(chosen) | set(_spread(rest, count - len(chosen)))


@dataclass
class _Stats:
    transfers: int = 0
    transferred_bytes: int = 0
    on_demand: int = 0
    dropped_prefetches: int = 0


@dataclass
class BlockStreamer:
    """The streamed blocks of one transformer and the copies in flight.

    Attributes:
        weights: Per block index (call order), its weights when streamed; resident blocks are absent.
        tokens: Per block index, what may skip it (:func:`skip_tokens`).
        device: Where the blocks compute.
        prefetch: Streamed blocks copied ahead.
        resident_bytes: Bytes of the resident blocks.
    """

    weights: dict[int, BlockWeights]
    tokens: list[frozenset[object]]
    device: torch.device
    prefetch: int
    resident_bytes: int = 0
    stats: _Stats = field(default_factory=_Stats)
    _inflight: dict[int, tuple[list[torch.Tensor], Any]] = field(default_factory=dict)
    _stream: Any = None
    _active: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(self.device)

    def _issue(self, index: int) -> tuple[list[torch.Tensor], Any]:
        weights = self.weights[index]
        self.stats.transfers += 1
        self.stats.transferred_bytes += weights.nbytes
        if self._stream is None:
            return weights.copy_to(self.device), None
        with torch.cuda.stream(self._stream):
            values = weights.copy_to(self.device)
            event = torch.cuda.Event()
            event.record(self._stream)
        return values, event

    def successors(self, index: int) -> list[int]:
        """The streamed blocks certain to run after ``index``, in call order, up to :attr:`prefetch` of them.

        Past the last block the scan wraps to the next call's first blocks, for blocks every call runs only.
        """
        own, count, out = self.tokens[index], len(self.tokens), []
        for step in range(1, count):
            j = index + step
            wrapped = j >= count
            j %= count
            tokens = self.tokens[j]
            if (wrapped and tokens) or not tokens <= own:
                continue
            if j in self.weights:
                out.append(j)
                if len(out) == self.prefetch:
                    break
        return out

    def active(self, index: int) -> bool:
        """Whether block ``index``'s weights are in place (its call, or a use from outside it, is running)."""
        return self._active.get(index, 0) > 0

    def enter(self, index: int, *, prefetch: bool = True) -> None:
        """Before block ``index`` computes: its weights in place, and the copies of what follows started."""
        self._active[index] = self._active.get(index, 0) + 1
        if self._active[index] > 1:  # already in place: a use from outside it, nested in its own call or vice versa
            return
        pending = self._inflight.pop(index, None)
        if pending is None:
            self.stats.on_demand += 1
            pending = self._issue(index)
        values, event = pending
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for value in values:  # allocated on the side stream, used on this one: freed only after this work
                value.record_stream(current)
        self.weights[index].install(values)
        if not prefetch:
            return
        wanted = self.successors(index)
        for stale in [j for j in self._inflight if j not in wanted]:
            self._drop(stale)
        for j in wanted:
            if j not in self._inflight:
                self._inflight[j] = self._issue(j)

    def leave(self, index: int) -> None:
        """After block ``index`` computed: its device copies let go (reused once the work queued on them ran)."""
        self._active[index] -= 1
        if self._active[index] == 0:
            self.weights[index].evict(self.device)

    def _drop(self, index: int) -> None:
        self._inflight.pop(index)
        self.stats.dropped_prefetches += 1

    def drop_prefetches(self) -> None:
        """Let go of every copy in flight (the end of a pipeline call, or a call that raised)."""
        for index in list(self._inflight):
            self._drop(index)

    def summary(self) -> dict[str, Any]:
        """Plain data for :func:`fastdit.summary`: the layout and the transfers since :func:`apply_offload`."""
        return {
            "device": str(self.device),
            "streamed_blocks": len(self.weights),
            "resident_blocks": len(self.tokens) - len(self.weights),
            "streamed_bytes": sum(w.nbytes for w in self.weights.values()),
            "resident_bytes": self.resident_bytes,
            "prefetch": self.prefetch,
            **vars(self.stats),
            "in_flight": len(self._inflight),
        }


class ResidentHook(layers.LayerHook):
    """Brings a streamed block's weights in for its call and lets them go after it."""

    def __init__(self, streamer: BlockStreamer, index: int) -> None:
        self.streamer = streamer
        self.index = index

    def around(self, inner: Any, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        self.streamer.enter(self.index)
        try:
            return inner(*args, **kwargs)
        finally:
            self.streamer.leave(self.index)

    def reset(self) -> None:
        self.streamer.drop_prefetches()


class _OutsideUse:
    """Brings a streamed block's weights in when one of its modules is called outside the block's own call.

    Some models reach into a block from their root forward (DiT embeds the timestep with
    ``transformer_blocks[0].norm1.emb``): the first such module called while the block is away loads it, and it
    goes again when that module returns. Inside the block's call the check is one dictionary read.
    """

    def __init__(self, streamer: BlockStreamer, index: int) -> None:
        self.streamer = streamer
        self.index = index
        self.owner: torch.nn.Module | None = None

    def pre(self, module: torch.nn.Module, args: Any) -> None:
        if self.owner is None and not self.streamer.active(self.index):
            self.owner = module
            self.streamer.enter(self.index, prefetch=False)

    def post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.owner is module:
            self.owner = None
            self.streamer.leave(self.index)


def _guard_outside_uses(block: torch.nn.Module, streamer: BlockStreamer, index: int) -> Callable[[], None]:
    """Hook every module of ``block`` that holds weights, so a call from outside the block finds them."""
    use = _OutsideUse(streamer, index)
    handles = []
    for module in block.modules():
        if module is not block and (module._parameters or module._buffers):
            handles += [module.register_forward_pre_hook(use.pre), module.register_forward_hook(use.post)]

    def remove() -> None:
        for handle in handles:
            handle.remove()

    return remove


def offload_device(config: Offload, current: torch.device) -> torch.device:
    """Where an offloaded pipeline computes: the configured device, else CUDA when there is one, else ``current``."""
    if config.device is not None:
        return torch.device(config.device)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return current


def _bytes(module: torch.nn.Module) -> int:
    tensors = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def move_components(components: Iterable[Any], device: torch.device) -> Callable[[], None]:
    """Move every module component (``.module``) to ``device``; return the undo (each back to where it was)."""
    moved = []
    for item in components:
        param = next(item.module.parameters(), None)
        if param is not None and param.device != device:
            moved.append((item.module, param.device))
            item.module.to(device)

    def undo() -> None:
        for module, origin in reversed(moved):
            module.to(origin)

    return undo


def apply_offload(blocks: Sequence[torch.nn.Module], config: Offload, device: torch.device) -> Applied:
    """Stream ``blocks`` (one transformer's, in call order) from host memory; the undo, the streamer as state.

    Install this after every technique whose hooks may skip a block (their skip groups choose what stays resident
    and what is prefetched); the caller moves the rest of the model to ``device``.
    """
    tokens = [skip_tokens(block) for block in blocks]
    resident = choose_resident(tokens, config.resident_blocks)
    pin = config.pin_memory and device.type == "cuda"
    weights = {i: BlockWeights(block, pin) for i, block in enumerate(blocks) if i not in resident}
    resident_bytes = sum(_bytes(blocks[i]) for i in resident)
    streamer = BlockStreamer(weights, tokens, device, config.prefetch, resident_bytes)
    undo = []
    for index, w in weights.items():
        w.evict(device)
        undo.append(layers.install(blocks[index], layers.Layer.RESIDENT, HOOK, ResidentHook(streamer, index)))
        undo.append(_guard_outside_uses(blocks[index], streamer, index))

    def restore() -> None:
        streamer.drop_prefetches()
        for fn in reversed(undo):
            fn()
        for w in weights.values():
            w.restore()

    return Applied(restore, streamer)
