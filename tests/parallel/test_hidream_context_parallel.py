"""HiDream under context parallelism: where the plan splits.

The plan splits inside every block (the inner block below the ``HiDreamBlock`` wrapper): double-stream blocks their
image and text streams and the RoPE table per segment, single-stream blocks their joint sequence. The generic family
test checks the outputs, with and without a step cache (whose hooks sit on the wrappers, whole tensors on both sides);
these check the split really happens where the plan says.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

import fastdit
from fastdit.hooks import layers
from fastdit.testing.distributed import WorkerPool
from fastdit.testing.pipelines import build_tiny, run_tiny

pytestmark = pytest.mark.distributed


@functools.lru_cache(maxsize=1)
def _built() -> tuple[Any, Any]:
    return build_tiny("hidream", "hidream")


def _lengths(rank: int, world_size: int) -> dict[str, list[Any]]:
    """Sequence lengths the first block of each kind sees on this rank under Ulysses over all ranks (one step)."""
    pipe, tiny = _built()
    transformer = pipe.transformer
    seen: dict[str, list[Any]] = {k: [] for k in ("double_wrapper", "double", "double_out", "single_wrapper", "single")}
    seen["single_out"] = []

    def lengths(kwargs: dict[str, Any]) -> tuple[int, ...]:
        streams = (kwargs["hidden_states"], kwargs["encoder_hidden_states"], kwargs["image_rotary_emb"])
        return tuple(t.shape[1] for t in streams if t is not None)

    fastdit.accelerate(pipe, parallel=fastdit.Parallel(ulysses=world_size))
    double, single = transformer.double_stream_blocks[0], transformer.single_stream_blocks[0]

    class Probe(layers.LayerHook):
        """At Layer.SKIP, where a cache hook sits: sees what the block's own computation receives."""

        def __init__(self, key: str) -> None:
            self.key = key

        def pre(self, module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            seen[self.key].append(lengths(kwargs))
            return args, kwargs

    probed = [
        (double, "double_wrapper"),
        (double.block, "double"),
        (single, "single_wrapper"),
        (single.block, "single"),
    ]
    undo = [layers.install(m, layers.Layer.SKIP, "probe", Probe(key)) for m, key in probed]
    # PyTorch forward hooks run outside the whole layer stack: they see the module's final output.
    handles = [
        double.register_forward_hook(lambda m, a, out: seen["double_out"].append(tuple(t.shape[1] for t in out))),
        single.register_forward_hook(lambda m, a, out: seen["single_out"].append(out.shape[1])),
    ]
    try:
        run_tiny(pipe, tiny, num_inference_steps=1)
    finally:
        for handle in handles:
            handle.remove()
        for fn in undo:
            fn()
        fastdit.disable(pipe)
    return seen


def test_every_block_splits_inside_its_wrapper(dist2: WorkerPool) -> None:
    expected = _lengths(0, 1)
    [(image, text, rope)] = expected["double"]
    assert rope == image + text  # one RoPE table over [image, text]
    [(joint, joint_rope)] = expected["single"]
    assert joint_rope == joint
    for rank, seen in enumerate(dist2.run(_lengths, timeout=180)):
        # The wrappers (where a cache hooks) get and return whole streams...
        assert seen["double_wrapper"] == [(image, text, rope)]
        assert seen["double_out"] == [(image, text)]  # both elements of (image, text) gathered
        assert seen["single_wrapper"] == [(joint, joint)]
        assert seen["single_out"] == [joint]
        # ...their inner blocks a shard of each stream, the RoPE table cut per [image, text] segment.
        image_r, text_r = (image + 1 - rank) // 2, (text + 1 - rank) // 2
        assert seen["double"] == [(image_r, text_r, image_r + text_r)]
        assert seen["single"] == [((joint + 1 - rank) // 2,) * 2]
