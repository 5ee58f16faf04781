"""The ranks that compute one sample must get equal inputs: a per-rank seed raises on every rank, with the fix named,
at the first transformer call of each run — also when CUDA graphs serve the calls (the check runs outside them)."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
import torch

import fastdit
from fastdit.context import context_of
from fastdit.hooks import layers
from fastdit.testing.distributed import DistributedTestError, WorkerPool
from fastdit.testing.graphs import RecordingGraph

pytestmark = pytest.mark.distributed

TINY_CALL = {"prompt": "a cat", "num_inference_steps": 2, "max_sequence_length": 16, "height": 32, "width": 32}


@functools.lru_cache(maxsize=1)
def _tiny_pipeline() -> Any:
    from fastdit.models.flux import tiny_flux

    pipe = tiny_flux(0)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _call(pipe: Any, seed: int) -> np.ndarray:
    return pipe(**TINY_CALL, generator=torch.Generator().manual_seed(seed), output_type="np").images


class _Graph(RecordingGraph):
    """Marks the time a graph captures or replays, when no host read may happen on a GPU."""

    recording = False

    def capture(self, fn: Any) -> Any:
        _Graph.recording = True
        try:
            return super().capture(fn)
        finally:
            _Graph.recording = False

    def replay(self) -> None:
        _Graph.recording = True
        try:
            super().replay()
        finally:
            _Graph.recording = False


# --- worker functions ---


def _seeded(rank: int, world_size: int, seeds: list[int]) -> dict[str, Any]:
    pipe = _tiny_pipeline()
    fastdit.accelerate(pipe, parallel=fastdit.Parallel(ulysses=world_size))
    try:
        first = _call(pipe, seeds[rank])
        second = _call(pipe, seeds[rank])
        hook = context_of(pipe).state("input_check", "transformer")
        return {"image": first, "same": np.array_equal(first, second), "checks": hook.checks}
    finally:
        fastdit.disable(pipe)


def _graphed(rank: int, world_size: int, second_seeds: list[int]) -> dict[str, Any]:
    """Whole-call graphs (CPU stand-in): run 1 warms up, captures and replays; run 2 starts on a replay."""
    from fastdit.cuda_graph import apply_cuda_graph
    from fastdit.parallel import input_check

    pipe = _tiny_pipeline()
    fastdit.accelerate(pipe, parallel=fastdit.Parallel(ulysses=world_size))
    graphs = apply_cuda_graph(pipe.transformer, fastdit.CudaGraph(scope="call", warmup=1), new_graph=_Graph)
    inside: list[bool] = []
    original = input_check.check_same_inputs

    def watched(*args: Any, **kwargs: Any) -> None:
        inside.append(_Graph.recording)
        original(*args, **kwargs)

    input_check.check_same_inputs = watched
    try:
        _call(pipe, 0)
        stats = graphs.state.stats()
        error = None
        try:
            _call(pipe, second_seeds[rank])
        except ValueError as exc:
            error = str(exc)
        names = [name for _, name in layers.stack_of(pipe.transformer).names()]
        return {"stats": stats, "inside": inside, "error": error, "names": names}
    finally:
        input_check.check_same_inputs = original
        graphs.undo()
        fastdit.disable(pipe)


# --- tests ---


def test_same_seed_on_every_rank_passes_once_per_run(dist2: WorkerPool) -> None:
    results = dist2.run(_seeded, [7, 7])
    np.testing.assert_array_equal(results[0]["image"], results[1]["image"])
    assert all(r["same"] and r["checks"] == 2 for r in results)  # two pipeline calls, one check each


def test_a_seed_per_rank_raises_on_every_rank_naming_the_fix(dist2: WorkerPool) -> None:
    with pytest.raises(DistributedTestError) as info:
        dist2.run(_seeded, [0, 1])
    assert sorted(info.value.failures) == [0, 1] and not info.value.unfinished
    messages = {failure.message for failure in info.value.failures.values()}
    assert len(messages) == 1  # the same words on every rank, from the reduced values alone
    (message,) = messages
    assert message.startswith("transformer: the 2 ranks that compute one sample together got different inputs")
    assert "hidden_states" in message and "encoder_hidden_states" not in message  # the prompt is the same
    assert "same seed" in message and "manual_seed(seed)" in message
    assert set(info.value.exc_types.values()) == {"ValueError"}


@pytest.mark.parametrize(("seeds", "fails"), [([0, 0], False), ([0, 1], True)])
def test_the_check_runs_outside_a_whole_call_graph(dist2: WorkerPool, seeds: list[int], fails: bool) -> None:
    """Never inside a capture or a replay; and a run whose first call replays a graph is still checked."""
    results = dist2.run(_graphed, seeds)
    for result in results:
        assert result["names"][:2] == ["parallel.input_check", "cuda_graph"]  # CHECK outside GRAPH
        assert result["stats"]["graphs"] == 1 and result["stats"]["replays"] > 0
        assert result["inside"] == [False, False]
        assert (result["error"] is not None) == fails
        if fails:
            assert "got different inputs (hidden_states)" in result["error"]
