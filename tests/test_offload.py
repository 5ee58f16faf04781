"""Block offload: streamed blocks compute exactly as resident ones, skipped blocks move nothing, disable restores.

On the CPU a transfer is the host tensor itself, so outputs must be bit-identical to the plain pipeline; the
transfer counts show what a cached step moves. Speed and memory on a GPU are a benchmark
(``benchmarks/offload_flux.py``).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
import torch

import fastdit
from fastdit.diagnostics.family_ladder import RungSpec, assert_rows, forced_cache, run_family_ladder
from fastdit.hooks import layers
from fastdit.offload import BlockStreamer, choose_resident
from fastdit.testing.distributed import get_pool
from fastdit.testing.pipelines import build_tiny, run_tiny

STEPS = 3


@functools.lru_cache(maxsize=2)
def _built(family: str) -> tuple[Any, Any]:
    return build_tiny(family)


def _run(family: str, **options: Any) -> tuple[np.ndarray, dict[str, Any] | None]:
    pipe, tiny = _built(family)
    if not options:
        return run_tiny(pipe, tiny, num_inference_steps=STEPS), None
    fastdit.accelerate(pipe, **options)
    try:
        out = run_tiny(pipe, tiny, num_inference_steps=STEPS)
        return out, fastdit.summary(pipe).transformers["transformer"]
    finally:
        fastdit.disable(pipe)


def _blocks(family: str) -> list[torch.nn.Module]:
    from fastdit.components import walk

    pipe, _ = _built(family)
    return [block for _, block in walk(pipe).denoisers[0].blocks()]


@pytest.mark.parametrize("family", ["flux", "wan", "sd3", "hunyuan_video"])
def test_every_block_streamed_is_bit_identical_and_disable_restores(family: str) -> None:
    pipe, _ = _built(family)
    state = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    expected, _ = _run(family)
    calls = []
    handles = [b.register_forward_pre_hook(lambda *_: calls.append(1)) for b in _blocks(family)]
    try:
        out, info = _run(family, offload=fastdit.Offload())
    finally:
        for handle in handles:
            handle.remove()
    assert np.array_equal(out, expected)
    stats = info["offload"]
    assert stats["streamed_blocks"] == len(_blocks(family)) and stats["resident_blocks"] == 0
    # Each block call moved its weights once; the prefetches into the call after the last one were let go, or are
    # still in flight for the next pipeline call.
    assert stats["transfers"] == len(calls) + stats["dropped_prefetches"] + stats["in_flight"]
    assert stats["in_flight"] <= 2
    assert stats["on_demand"] == 1  # only the very first block waited for its copy
    after = pipe.transformer.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], v) for k, v in state.items())
    assert all(layers.stack_of(block) is None for block in _blocks(family))


@pytest.mark.parametrize("bn", [0, 1])
def test_a_cached_step_transfers_nothing_when_the_blocks_it_runs_are_resident(bn: int) -> None:
    cache = forced_cache(bn)
    expected, plain = _run("flux", cache=cache)
    resident = 1 + bn  # the front and back blocks: those every step runs
    out, info = _run("flux", cache=cache, offload=fastdit.Offload(resident_blocks=resident))
    assert np.array_equal(out, expected)
    stats, computed = info["offload"], STEPS - plain["cache"]["num_cached_steps"]
    assert plain["cache"]["num_cached_steps"] > 0
    assert stats["resident_blocks"] == resident
    # Only computed steps move weights, and only the middle blocks' (front blocks do not prefetch them: the last
    # front block decides whether they run).
    assert stats["transfers"] == stats["streamed_blocks"] * computed
    assert stats["on_demand"] == computed and stats["dropped_prefetches"] == 0


def test_offload_composes_with_compiled_blocks_and_block_pruning() -> None:
    cache = forced_cache(0)
    expected, _ = _run("flux", cache=cache, compile=fastdit.Compile(backend="eager"))
    out, _ = _run("flux", cache=cache, compile=fastdit.Compile(backend="eager"), offload=fastdit.Offload())
    assert np.array_equal(out, expected)
    prune = fastdit.DBPrune(fn=1, bn=0, threshold=0.5, warmup_steps=1)
    expected, _ = _run("flux", cache=prune)
    out, info = _run("flux", cache=prune, offload=fastdit.Offload())
    assert np.array_equal(out, expected)
    assert info["offload"]["transfers"] > 0


def test_resident_blocks_are_those_every_step_runs_then_spread() -> None:
    middle = frozenset({"cache"})
    tokens = [frozenset(), middle, middle, middle, middle, middle, frozenset()]
    assert choose_resident(tokens, 1) == {0}
    assert choose_resident(tokens, 2) == {0, 6}
    assert choose_resident(tokens, 3) == {0, 6, 3}
    assert choose_resident(tokens, 4) == {0, 6, 2, 4}


def test_prefetch_follows_only_blocks_certain_to_run() -> None:
    middle, alone = frozenset({"cache"}), frozenset({"prune-3"})
    tokens = [frozenset(), frozenset(), middle, alone, middle, frozenset()]
    streamer = BlockStreamer(dict.fromkeys(range(6)), tokens, torch.device("cpu"), prefetch=2)
    assert streamer.successors(0) == [1, 5]  # not the middle blocks: the front decides whether they run
    assert streamer.successors(2) == [4, 5]  # a middle block's group-mates run with it; block 3 decides alone
    assert streamer.successors(5) == [0, 1]  # past the last block: the next call's first blocks
    streamer.prefetch = 1
    assert streamer.successors(1) == [5]


def test_offload_refuses_what_it_cannot_compose_with() -> None:
    pipe, _ = _built("flux")
    with pytest.raises(ValueError, match=r"offload=Offload\(.*\): flux|transformer has \d+ blocks"):
        fastdit.accelerate(pipe, offload=fastdit.Offload(resident_blocks=100))
    with pytest.raises(ValueError, match=r"a CUDA graph replays fixed weight addresses"):
        fastdit.accelerate(pipe, offload=fastdit.Offload(), cuda_graph=fastdit.CudaGraph())
    with pytest.raises(ValueError, match=r"tensor parallelism shards the weights"):
        fastdit.accelerate(pipe, offload=fastdit.Offload(), parallel=fastdit.Parallel(tp=2))
    with pytest.raises(ValueError, match=r"Offload.prefetch=-1: must be an integer >= 0"):
        fastdit.Offload(prefetch=-1)
    with pytest.raises(TypeError, match=r"offload=3: expected Offload or None"):
        fastdit.accelerate(pipe, offload=3)
    assert fastdit.api.context_of(pipe) is None


@pytest.mark.distributed
def test_offload_with_context_and_cfg_parallel_matches_one_process() -> None:
    dist2 = get_pool(2)
    specs = [
        RungSpec("ulysses2-offload", {"ulysses": 2}, offload=0),
        RungSpec("ring2-offload-cache", {"ring": 2}, cache_bn=0, offload=1),
    ]
    assert_rows(dist2.run(run_family_ladder, "flux", "flux", specs, {"num_inference_steps": STEPS}, timeout=300))
    specs = [RungSpec("cfg2-offload-cache", {"cfg": 2}, cache_bn=0, offload=1)]
    assert_rows(dist2.run(run_family_ladder, "sd3", "sd3", specs, {"num_inference_steps": STEPS}, timeout=300))
