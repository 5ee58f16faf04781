"""CUDA graphs over transformer calls: signatures, warm-up, static inputs, output copies, limits, errors.

On CPU :class:`~fastdit.testing.graphs.RecordingGraph` stands in for ``torch.cuda.CUDAGraph`` with the same
contract, so a hook that forgot to copy new inputs into the captured ones, or that handed out the graph's own
outputs, fails these tests.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import fastdit
from fastdit.context import context_of
from fastdit.cuda_graph import apply_cuda_graph
from fastdit.diagnostics.family_ladder import forced_teacache
from fastdit.errors import FieldError
from fastdit.hooks import layers
from fastdit.testing.graphs import RecordingGraph
from fastdit.testing.pipelines import build_tiny, run_tiny


class Doubler(torch.nn.Module):
    """Output depends on the tensor, a scalar argument, and a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor, shift: float = 0.0, extra: Any = None) -> tuple[torch.Tensor]:
        return (x * self.weight + shift,)


def _graphed(module: torch.nn.Module, **config: Any) -> Any:
    return apply_cuda_graph(module, fastdit.CudaGraph(**config), new_graph=RecordingGraph)


def _blocks(pipe: Any) -> list[tuple[str, torch.nn.Module]]:
    from fastdit.components import walk

    return walk(pipe).denoisers[0].blocks()


@torch.no_grad()
def test_replays_with_new_inputs_after_warmup() -> None:
    module = Doubler()
    graphed = _graphed(module, warmup=2)
    for i in range(5):
        x = torch.full((3,), float(i))
        torch.testing.assert_close(module(x)[0], x * 2, rtol=0, atol=0)
    assert graphed.state.stats() == {"graphs": 1, "replays": 3, "eager_calls": 2}


@torch.no_grad()
def test_outputs_are_copies_the_next_replay_cannot_overwrite() -> None:
    module = Doubler()
    _graphed(module, warmup=1)
    module(torch.zeros(2))  # warm-up
    first = module(torch.ones(2))[0]
    second = module(torch.full((2,), 5.0))[0]
    torch.testing.assert_close(first, torch.full((2,), 2.0))
    torch.testing.assert_close(second, torch.full((2,), 10.0))


@torch.no_grad()
def test_each_signature_gets_its_own_graph() -> None:
    module = Doubler()
    graphed = _graphed(module, warmup=1)
    double = torch.ones(2, dtype=torch.float64)
    calls = [(torch.ones(2), 0.0), (torch.ones(3), 0.0), (torch.ones(2), 1.0), (double, 0.0)]
    for x, shift in calls * 3:
        torch.testing.assert_close(module(x, shift)[0], x * 2 + shift)
    assert graphed.state.stats() == {"graphs": 4, "replays": 8, "eager_calls": 4}


@torch.no_grad()
def test_signatures_beyond_max_graphs_run_without_graph(caplog: pytest.LogCaptureFixture) -> None:
    module = Doubler()
    graphed = _graphed(module, warmup=1, max_graphs=1)
    with caplog.at_level(logging.WARNING, logger="fastdit.cuda_graph"):
        for n in (2, 2, 3, 3, 3):
            torch.testing.assert_close(module(torch.ones(n))[0], torch.full((n,), 2.0))
    assert graphed.state.stats() == {"graphs": 1, "replays": 1, "eager_calls": 4}
    assert "max_graphs" in caplog.text


@torch.no_grad()
def test_unhashable_argument_is_refused_naming_the_option() -> None:
    module = Doubler()
    _graphed(module)
    with pytest.raises(TypeError, match=r"CudaGraph.*bytearray"):
        module(torch.ones(2), 0.0, bytearray(b"x"))


def test_calls_with_autograd_run_without_graph() -> None:
    module = Doubler()
    graphed = _graphed(module, warmup=1)
    for _ in range(3):
        out = module(torch.ones(2))[0]
    out.sum().backward()
    assert module.weight.grad is not None
    assert graphed.state.stats() == {"graphs": 0, "replays": 0, "eager_calls": 3}


@torch.no_grad()
def test_capture_failure_names_the_option() -> None:
    class Failing(RecordingGraph):
        def capture(self, fn: Callable[[], Any]) -> Any:
            raise RuntimeError("operation not permitted when stream is capturing")

    module = Doubler()
    apply_cuda_graph(module, fastdit.CudaGraph(warmup=1), new_graph=Failing)
    module(torch.ones(2))
    with pytest.raises(RuntimeError, match=r"CudaGraph.*stream is capturing"):
        module(torch.ones(2))


def test_tiny_flux_pipeline_is_bit_identical_and_undo_restores() -> None:
    pipe, tiny = build_tiny("flux")
    steps = 4  # replays past the capturing call read new inputs
    baseline = run_tiny(pipe, tiny, num_inference_steps=steps)
    undo = _graphed(pipe.transformer, warmup=1)
    graphed = run_tiny(pipe, tiny, num_inference_steps=steps)
    assert undo.state.stats() == {"graphs": 1, "replays": steps - 1, "eager_calls": 1}
    np.testing.assert_array_equal(graphed, baseline)
    undo()
    assert layers.stack_of(pipe.transformer) is None
    np.testing.assert_array_equal(run_tiny(pipe, tiny, seed=1), run_tiny(build_tiny("flux")[0], tiny, seed=1))


def test_accelerate_refuses_cpu_model_and_whole_call_graphs_with_a_cache() -> None:
    pipe, _ = build_tiny("flux")
    with pytest.raises(ValueError, match=r"CudaGraph.device=.cpu.: the transformer must be on a CUDA device"):
        fastdit.accelerate(pipe, cuda_graph=fastdit.CudaGraph())
    assert context_of(pipe) is None
    assert layers.stack_of(pipe.transformer) is None
    whole_call = fastdit.Compile(cuda_graph=True, graph_scope="call")
    with pytest.raises(ValueError, match=r"scope='call'.*cache"):
        fastdit.accelerate(pipe, cache=fastdit.FBCache(), compile=whole_call)
    with pytest.raises(ValueError, match=r"scope='call'.*cache"):
        fastdit.accelerate(pipe, cache=fastdit.FBCache(), cuda_graph=fastdit.CudaGraph(scope="call"))


def test_block_graphs_run_inside_the_cache_hooks() -> None:
    """Cache + per-block graphs: same output as the cache alone, graphs replayed only for the blocks computed."""
    pipe, tiny = build_tiny("flux")
    steps = 6
    mask = fastdit.StepMask(compute_steps=(0, 1, 3), policy="static")
    cache = fastdit.DBCache(fn=1, bn=1, warmup_steps=0, step_mask=mask)
    fastdit.accelerate(pipe, cache=cache)
    expected = run_tiny(pipe, tiny, num_inference_steps=steps)
    expected_computed = fastdit.summary(pipe).transformers["transformer"]["cache"]["blocks_computed"]
    config = fastdit.CudaGraph(warmup=1)
    undo = apply_cuda_graph(pipe.transformer, config, blocks=_blocks(pipe), cached=True, new_graph=RecordingGraph)
    try:
        graphed = run_tiny(pipe, tiny, num_inference_steps=steps)
        stats = undo.state.stats()
        computed = fastdit.summary(pipe).transformers["transformer"]["cache"]["blocks_computed"]
    finally:
        undo()
        fastdit.disable(pipe)
    np.testing.assert_array_equal(graphed, expected)
    assert computed == expected_computed < steps * 3  # tiny flux: 3 blocks; cached steps skip the middle one
    # Every computed block call went through its graph: the first one of each block warms up, the rest replay.
    assert stats["eager_calls"] == 3 and stats["replays"] == computed - 3
    assert stats["graphs"] == 3


def test_block_graphs_run_inside_teacache() -> None:
    """TeaCache (``fn=0``) + per-block graphs: the decision reads the first block's input before that block's graph
    runs; same output and steps as TeaCache alone, graphs replayed only for the blocks of the computed steps."""
    pipe, tiny = build_tiny("flux")
    steps = 5
    fastdit.accelerate(pipe, cache=forced_teacache())
    expected = run_tiny(pipe, tiny, num_inference_steps=steps)
    expected_info = fastdit.summary(pipe).transformers["transformer"]["cache"]
    config = fastdit.CudaGraph(warmup=1)
    undo = apply_cuda_graph(pipe.transformer, config, blocks=_blocks(pipe), cached=True, new_graph=RecordingGraph)
    try:
        graphed = run_tiny(pipe, tiny, num_inference_steps=steps)
        stats = undo.state.stats()
        info = fastdit.summary(pipe).transformers["transformer"]["cache"]
    finally:
        undo()
        fastdit.disable(pipe)
    np.testing.assert_array_equal(graphed, expected)
    (branch,) = info["branches"].values()
    assert branch["cached_steps"] == [1, 2, 4] and info["branches"] == expected_info["branches"]
    # Steps 0 and 3 computed the 3 blocks: each block warms up once, then replays.
    assert info["blocks_computed"] == 6
    assert stats == {"graphs": 3, "replays": 3, "eager_calls": 3}


def test_data_dependent_attention_lengths_refuse_graphs_before_anything() -> None:
    pipe, _ = build_tiny("mochi")
    with pytest.raises(ValueError, match=r"cuda_graph=CudaGraph.*mochi.*depend on the data"):
        fastdit.accelerate(pipe, parallel=fastdit.Parallel(ulysses=2), compile=fastdit.Compile(cuda_graph=True))
    assert context_of(pipe) is None


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"cuda_graph": True, "mode": "reduce-overhead"}, "mode"),
        ({"graph_warmup": 0}, "graph_warmup"),
        ({"max_graphs": 0}, "max_graphs"),
        ({"cuda_graph": 1}, "cuda_graph"),
        ({"graph_scope": "steps"}, "graph_scope"),
    ],
)
def test_config_names_bad_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(FieldError) as info:
        fastdit.Compile(**kwargs)
    assert info.value.owner == "Compile"
    assert field in getattr(info.value, "fields", {info.value.field: None})


@pytest.mark.parametrize(
    ("kwargs", "field"), [({"scope": "steps"}, "scope"), ({"warmup": 0}, "warmup"), ({"max_graphs": 1.0}, "max_graphs")]
)
def test_cuda_graph_config_names_bad_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(FieldError) as info:
        fastdit.CudaGraph(**kwargs)
    assert (info.value.owner, info.value.field) == ("CudaGraph", field)


def test_graphs_without_compile_run_no_dynamo(monkeypatch: pytest.MonkeyPatch) -> None:
    """CudaGraph alone graphs the eager blocks: torch.compile is never called."""
    calls = []
    monkeypatch.setattr(torch, "compile", lambda *a, **k: calls.append(a))
    pipe, tiny = build_tiny("flux")
    expected = run_tiny(pipe, tiny, num_inference_steps=3)
    undo = apply_cuda_graph(
        pipe.transformer, fastdit.CudaGraph(scope="blocks", warmup=1), blocks=_blocks(pipe), new_graph=RecordingGraph
    )
    try:
        graphed = run_tiny(pipe, tiny, num_inference_steps=3)
    finally:
        undo()
    np.testing.assert_array_equal(graphed, expected)
    assert calls == [] and undo.state.stats()["replays"] == 6


@pytest.mark.gpu
def test_cuda_graph_pipeline_matches_eager_on_gpu() -> None:
    pipe, tiny = build_tiny("flux")
    pipe.to("cuda")
    baseline = run_tiny(pipe, tiny)
    fastdit.accelerate(pipe, cuda_graph=fastdit.CudaGraph(warmup=1))
    graphed = run_tiny(pipe, tiny)
    assert fastdit.summary(pipe).transformers["transformer"]["cuda_graph"]["replays"] > 0
    np.testing.assert_allclose(graphed, baseline, atol=1e-5)


@pytest.mark.gpu
def test_block_graphs_with_a_cache_match_the_cache_alone_on_gpu() -> None:
    pipe, tiny = build_tiny("flux")
    pipe.to("cuda")
    mask = fastdit.StepMask(compute_steps=(0, 1, 3), policy="static")
    cache = fastdit.DBCache(fn=1, bn=1, warmup_steps=0, step_mask=mask)
    fastdit.accelerate(pipe, cache=cache)
    expected = run_tiny(pipe, tiny, num_inference_steps=6)
    fastdit.disable(pipe)
    fastdit.accelerate(pipe, cache=cache, cuda_graph=fastdit.CudaGraph(warmup=1))
    graphed = run_tiny(pipe, tiny, num_inference_steps=6)
    info = fastdit.summary(pipe).transformers["transformer"]
    assert info["cuda_graph"]["replays"] == info["cache"]["blocks_computed"] - 3
    np.testing.assert_allclose(graphed, expected, atol=1e-5)


@pytest.mark.gpu
def test_block_graphs_with_teacache_match_teacache_alone_on_gpu() -> None:
    pipe, tiny = build_tiny("flux")
    pipe.to("cuda")
    fastdit.accelerate(pipe, cache=forced_teacache())
    expected = run_tiny(pipe, tiny, num_inference_steps=5)
    fastdit.disable(pipe)
    fastdit.accelerate(pipe, cache=forced_teacache(), cuda_graph=fastdit.CudaGraph(warmup=1))
    graphed = run_tiny(pipe, tiny, num_inference_steps=5)
    info = fastdit.summary(pipe).transformers["transformer"]
    assert info["cache"]["num_cached_steps"] == 3
    assert info["cuda_graph"]["replays"] == info["cache"]["blocks_computed"] - 3
    np.testing.assert_allclose(graphed, expected, atol=1e-5)


def test_block_graphs_stay_outside_compiled_blocks() -> None:
    """Graphs per block without a cache wrap the compiled call: dynamo never traces the graph bookkeeping."""
    import torch._dynamo

    from fastdit.cuda_graph import GraphedCalls

    torch._dynamo.reset()
    pipe, tiny = build_tiny("flux")
    expected = run_tiny(pipe, tiny, num_inference_steps=3)
    fastdit.accelerate(pipe, compile=fastdit.Compile(backend="eager"))
    config = fastdit.CudaGraph(scope="blocks", warmup=1)
    undo = apply_cuda_graph(pipe.transformer, config, blocks=_blocks(pipe), new_graph=RecordingGraph)
    try:
        graphed = run_tiny(pipe, tiny, num_inference_steps=3)
        stats = undo.state.stats()
    finally:
        undo()
        fastdit.disable(pipe)
    entries = torch._C._dynamo.eval_frame._debug_get_cache_entry_list
    traced = sum(len(entries(f.__code__)) for f in (GraphedCalls.__call__, GraphedCalls._capture_when_due))
    torch._dynamo.reset()
    np.testing.assert_allclose(graphed, expected, atol=1e-6)
    assert stats == {"graphs": 3, "replays": 6, "eager_calls": 3}
    assert traced == 0


def test_modules_reading_on_the_host_refuse_a_whole_call_graph_up_front() -> None:
    """Lumina 2's RoPE embedder sizes its outputs by the prompt mask's lengths read on the host, which a graph of the
    whole call would freeze (and a capture cannot do): refused before anything is applied, naming the module."""
    pipe, _ = build_tiny("lumina2")
    with pytest.raises(ValueError, match=r"rope_embedder read tensor values on the host.*scope='blocks'"):
        fastdit.accelerate(pipe, cuda_graph=fastdit.CudaGraph())
    assert context_of(pipe) is None
    with pytest.raises(ValueError, match=r"rope_embedder"):
        fastdit.accelerate(pipe, compile=fastdit.Compile(cuda_graph=True, graph_scope="call"))
    assert context_of(pipe) is None


def test_the_recording_stand_in_refuses_non_tensor_outputs_that_change() -> None:
    """A real graph hands out the captured non-tensor outputs: the stand-in fails when a call's differ."""
    sizes = iter(range(10))
    module = torch.nn.Identity()
    module.forward = lambda x: (x * 2, next(sizes))  # a size read from somewhere other than the signature
    undo = apply_cuda_graph(module, fastdit.CudaGraph(warmup=1), new_graph=RecordingGraph)
    try:
        with torch.no_grad():
            module(torch.ones(2))  # warm-up
            with pytest.raises(AssertionError, match="non-tensor output changed"):
                module(torch.ones(2))  # captured, then replayed
    finally:
        undo()
