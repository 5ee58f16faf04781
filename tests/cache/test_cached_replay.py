"""A cached DBCache step is exactly its definition, bit for bit, written out by hand here with plain forward hooks.

In a computed step every middle segment (the middle blocks of one block list) remembers its residual, ``output −
input``, per stream; in a cached step the front blocks compute, each middle block but the segment's last returns its
own inputs, and the segment's last returns ``segment input + remembered residual``; the back blocks compute. The
reference below lets the plain model compute everything and replaces the middle blocks' outputs through forward hooks,
so it shares no code with the cache's hooks: any change to how they pass blocks through has to keep these equalities.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import fastdit
from fastdit.models.flux import tiny_transformer
from tests.cache.toy_dit import TOY_ADAPTER, ToyDiT, sample

# How a block list's calls carry the streams: (hidden, encoder) of a call's arguments, a block output made of them,
# and (hidden, encoder) of a block's output.
Streams = Callable[[tuple, dict], tuple[torch.Tensor, torch.Tensor | None]]
Pack = Callable[[torch.Tensor, torch.Tensor | None], Any]
Unpack = Callable[[Any], tuple[torch.Tensor, torch.Tensor | None]]
Segment = tuple[list[torch.nn.Module], Streams, Pack, Unpack]


class HandCache:
    """DBCache on a static mask, by its definition, for the segments ``segments`` (lists of blocks, in order)."""

    def __init__(self, segments: list[Segment], compute: set[int]) -> None:
        self.segments = segments
        self.compute = compute
        self.residuals: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.step = -1
        self.branch = 0
        self._inputs: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._handles: list[Any] = []
        for index, (blocks, streams, pack, unpack) in enumerate(segments):
            self._handles.append(blocks[0].register_forward_pre_hook(self._enter(index, streams), with_kwargs=True))
            for position, block in enumerate(blocks):
                last = position == len(blocks) - 1
                hook = self._leave(index, streams, pack, unpack, last)
                self._handles.append(block.register_forward_hook(hook, with_kwargs=True))

    def call(self, step: int, branch: int = 0) -> None:
        """The next model call is ``branch`` of ``step``."""
        self.step, self.branch = step, branch

    def _enter(self, index: int, streams: Streams) -> Callable[..., None]:
        def hook(_module: Any, args: tuple, kwargs: dict) -> None:
            self._inputs[index] = streams(args, kwargs)

        return hook

    def _leave(self, index: int, streams: Streams, pack: Pack, unpack: Unpack, last: bool) -> Callable[..., Any]:
        def hook(_module: Any, args: tuple, kwargs: dict, output: Any) -> Any:
            hidden_in, encoder_in = self._inputs[index]
            key = (index, self.branch)
            if self.step in self.compute:
                if last:
                    hidden_out, encoder_out = unpack(output)
                    encoder_residual = None if encoder_in is None else encoder_out - encoder_in
                    self.residuals[key] = (hidden_out - hidden_in, encoder_residual)
                return output
            if not last:
                return pack(*streams(args, kwargs))  # its own inputs, passed through
            hidden_residual, encoder_residual = self.residuals[key]
            encoder = None if encoder_in is None else encoder_in + encoder_residual
            return pack(hidden_in + hidden_residual, encoder)

        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def flux_streams(_args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return kwargs["hidden_states"], kwargs["encoder_hidden_states"]


def flux_pack(hidden: torch.Tensor, encoder: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    return encoder, hidden  # FLUX's blocks return (encoder, hidden)


def flux_unpack(output: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return output[1], output[0]


def flux_inputs() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {
        "hidden_states": torch.randn(1, 16, 16, generator=g),
        "encoder_hidden_states": torch.randn(1, 6, 32, generator=g),
        "pooled_projections": torch.randn(1, 32, generator=g),
        "img_ids": torch.zeros(16, 3),
        "txt_ids": torch.zeros(6, 3),
        "guidance": torch.full((1,), 3.5),
        "return_dict": False,
    }


STEPS = 7
COMPUTE = (0, 3)


def flux_calls(model: torch.nn.Module, hand: HandCache | None = None) -> list[torch.Tensor]:
    kwargs = flux_inputs()
    outputs = []
    with torch.no_grad():
        for step in range(STEPS):
            if hand is not None:
                hand.call(step)
            timestep = torch.full((1,), 1.0 - step / STEPS)
            outputs.append(model(timestep=timestep, **kwargs)[0])
    return outputs


def mask_cache(fn: int, bn: int) -> fastdit.DBCache:
    mask = fastdit.StepMask(compute_steps=COMPUTE, policy="static")
    return fastdit.DBCache(fn=fn, bn=bn, warmup_steps=0, step_mask=mask)


@pytest.mark.parametrize(("fn", "bn"), [(1, 0), (1, 2), (3, 0)], ids=["F1B0", "F1B2", "F3B0"])
def test_a_flux_cached_step_is_its_definition(fn: int, bn: int) -> None:
    model = tiny_transformer(0, num_layers=2, num_single_layers=4, guidance=True)
    blocks = [*model.transformer_blocks, *model.single_transformer_blocks]
    middle = set(range(fn, len(blocks) - bn))
    lists = (list(range(2)), list(range(2, len(blocks))))
    segments = [([blocks[i] for i in ids if i in middle], flux_streams, flux_pack, flux_unpack) for ids in lists]
    hand = HandCache([s for s in segments if s[0]], set(COMPUTE))
    try:
        expected = flux_calls(model, hand)
    finally:
        hand.remove()
    fastdit.accelerate(model, cache=mask_cache(fn, bn))
    try:
        got = flux_calls(model)
        assert fastdit.summary(model).num_cached_steps == STEPS - len(COMPUTE)
    finally:
        fastdit.disable(model)
    for step, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert torch.equal(a, b), f"step {step}"


@pytest.mark.parametrize("cfg", [False, True], ids=["one-branch", "cfg"])
def test_a_positional_single_stream_cached_step_is_its_definition(cfg: bool) -> None:
    """The toy DiT calls its blocks positionally and works between them; under CFG each branch keeps its own."""
    torch.manual_seed(0)
    model = ToyDiT(depth=6).eval()
    layers = list(model.layers)[1:-1]  # F1B1

    def streams(args: tuple, kwargs: dict) -> tuple[torch.Tensor, None]:
        return args[0], None

    hand = HandCache([(layers, streams, lambda hidden, _encoder: hidden, lambda out: (out, None))], set(COMPUTE))
    calls = [0]
    branches = 2 if cfg else 1

    def count(*_: Any) -> None:  # the hand cache learns each call's step and branch from the call count
        hand.call(calls[0] // branches, calls[0] % branches)
        calls[0] += 1

    handle = model.register_forward_pre_hook(count)
    try:
        expected = sample(model, steps=STEPS, cfg=cfg)
    finally:
        handle.remove()
        hand.remove()
    mask = fastdit.StepMask(compute_steps=COMPUTE, policy="static")
    fastdit.accelerate(model, cache=fastdit.DBCache(fn=1, bn=1, warmup_steps=0, step_mask=mask), adapter=TOY_ADAPTER)
    try:
        got = sample(model, steps=STEPS, cfg=cfg)
        assert fastdit.summary(model).num_cached_steps == branches * (STEPS - len(COMPUTE))
    finally:
        fastdit.disable(model)
    assert torch.equal(expected, got)
