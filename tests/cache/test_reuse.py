"""Step-invariant modules: served from their kept output only while their inputs are the same, bit for bit."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

import fastdit
from fastdit.cache import apply_cache
from fastdit.cache.reuse import install_reuse
from fastdit.config import DBCache
from fastdit.hooks import layers
from fastdit.models import registry
from fastdit.models.base import StepInvariant
from fastdit.models.flux import tiny_flux
from fastdit.models.validate import AdapterError, check_adapter
from fastdit.testing.distributed import WorkerPool, get_pool
from fastdit.testing.pipelines import build_tiny, run_tiny
from tests.cache.toy_dit import TOY_ADAPTER, ToyDiT

_CALL = {"prompt": "a cat", "height": 32, "width": 32, "num_inference_steps": 4, "max_sequence_length": 16}


class _Joined(nn.Module):
    """``forward(a, b)``: an embedding of ``cat(a, b)``, a new tensor every call (like FLUX's rotary table)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.embed(torch.cat([a, b]))


def _images(pipe, **kwargs) -> torch.Tensor:
    return pipe(**_CALL, **kwargs, generator=torch.Generator().manual_seed(0), output_type="pt").images


def _served(pipe) -> dict[str, dict[str, int]]:
    return fastdit.summary(pipe).to_dict()["transformers"]["transformer"]["cache"]["step_invariant"]["modules"]


def test_flux_rotary_table_and_text_projection_are_served_bit_for_bit() -> None:
    pipe = tiny_flux(0)
    expected = _images(pipe)
    fastdit.accelerate(pipe, cache=DBCache(fn=1, bn=0, threshold=0.0))
    assert torch.equal(_images(pipe), expected)
    assert _served(pipe) == {n: {"served": 3, "calls": 4} for n in ("pos_embed", "context_embedder")}
    assert "step-invariant modules served: pos_embed 3/4, context_embedder 3/4" in str(fastdit.summary(pipe))
    fastdit.disable(pipe)
    assert layers.stack_of(pipe.transformer.pos_embed) is None


def test_true_cfg_keeps_one_entry_per_branch() -> None:
    pipe = tiny_flux(0)
    kwargs = {"true_cfg_scale": 2.0, "negative_prompt": "a dog"}
    expected = _images(pipe, **kwargs)
    fastdit.accelerate(pipe, cache=DBCache(fn=1, bn=0, threshold=0.0))
    assert torch.equal(_images(pipe, **kwargs), expected)
    # Eight calls: each branch computes at its first step (its own ids and prompt embeddings) and is served after.
    assert _served(pipe)["context_embedder"] == {"served": 6, "calls": 8}
    assert _served(pipe)["pos_embed"] == {"served": 6, "calls": 8}


def test_compiled_outer_modules_are_served_around_their_compiled_stage() -> None:
    pipe = tiny_flux(0)
    expected = _images(pipe)
    fastdit.accelerate(
        pipe, cache=DBCache(fn=1, bn=0, threshold=0.0), compile=fastdit.Compile(backend="eager", outer=True)
    )
    assert torch.equal(_images(pipe), expected)
    assert _served(pipe) == {n: {"served": 3, "calls": 4} for n in ("pos_embed", "context_embedder")}


def test_a_new_run_computes_again() -> None:
    """The same prompt embeddings in a second call, the weights changed in between (a LoRA fused, say): the new run
    drops what the last one kept, even where the pipeline never resets its hooks."""
    pipe = tiny_flux(0)
    prompt_embeds, pooled, _ = pipe.encode_prompt(prompt="a cat", prompt_2=None, max_sequence_length=16)
    call = {"height": 32, "width": 32, "num_inference_steps": 4, "output_type": "pt"}
    call |= {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}

    def images():
        return pipe(**call, generator=torch.Generator().manual_seed(0)).images

    fastdit.accelerate(pipe, cache=DBCache(fn=1, bn=0, threshold=0.0))
    hook = layers.stack_of(pipe.transformer.context_embedder).get("fastdit.cache.reuse")
    hook.reset = lambda: None  # as a pipeline that never resets its hooks leaves them
    images()
    with torch.no_grad():
        pipe.transformer.context_embedder.weight.mul_(0.5)
    served = images()
    fastdit.disable(pipe)
    torch.testing.assert_close(served, images(), rtol=0, atol=0)


def test_a_pipeline_call_lets_the_kept_tensors_go() -> None:
    pipe = tiny_flux(0)
    fastdit.accelerate(pipe, cache=DBCache(fn=1, bn=0, threshold=0.0))
    _images(pipe)
    hook = layers.stack_of(pipe.transformer.context_embedder).get("fastdit.cache.reuse")
    assert hook._entries == []  # diffusers resets stateful hooks at the end of a call


def _own_args_hook(module: nn.Module):
    stats, undo = install_reuse(_Root(module), [StepInvariant("inner")])
    return stats.counts["inner"], undo


class _Root(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.inner(a, b)


def test_same_objects_are_served_and_anything_else_computes() -> None:
    module = _Joined()
    counts, undo = _own_args_hook(module)
    a, b = torch.randn(2, 4), torch.randn(3, 4)
    with torch.no_grad():
        first = module(a, b)
        assert module(a, b) is first
        assert counts == [1, 2]
        assert module(a.clone(), b) is not first  # equal values, another tensor: never compared on the device
        a.add_(1.0)  # changed in place: its version moved
        torch.testing.assert_close(module(a, b), module.embed(torch.cat([a, b])), rtol=0, atol=0)
    assert counts[0] == 1
    undo()
    assert layers.stack_of(module) is None


def test_an_output_changed_in_place_is_computed_again() -> None:
    module = _Joined()
    counts, _ = _own_args_hook(module)
    a, b = torch.randn(2, 4), torch.randn(3, 4)
    with torch.no_grad():
        first = module(a, b)
        first.mul_(0.0)  # a consumer wrote into the kept output
        again = module(a, b)
    assert again is not first and counts == [0, 2]
    torch.testing.assert_close(again, module.embed(torch.cat([a, b])), rtol=0, atol=0)


def test_inference_tensors_are_never_served() -> None:
    module = _Joined()
    counts, _ = _own_args_hook(module)
    with torch.inference_mode():
        a, b = torch.randn(2, 4), torch.randn(3, 4)
        first = module(a, b)
        assert module(a, b) is not first
    assert counts == [0, 2]


def test_a_graph_capture_computes(monkeypatch: pytest.MonkeyPatch) -> None:
    module = _Joined()
    counts, _ = _own_args_hook(module)
    a, b = torch.randn(2, 4), torch.randn(3, 4)
    with torch.no_grad():
        first = module(a, b)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        assert module(a, b) is not first  # a graph must record the computation it replays
    assert counts == [0, 2]


class _RootCall(nn.Module):
    """``forward(a, b)`` passes ``a`` sliced (a new tensor every call) to ``inner``."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, a: torch.Tensor, b: torch.Tensor, width: int = 4) -> torch.Tensor:
        return self.inner(a[:, :width], b)


def test_a_module_read_from_transformer_inputs_is_served_on_the_same_inputs() -> None:
    inner = _Joined()
    root = _RootCall(inner)
    stats, _ = install_reuse(root, [StepInvariant("inner", inputs=("a", "b"))])
    a, b = torch.randn(2, 6), torch.randn(3, 4)
    with torch.no_grad():
        first = root(a, b)
        assert root(a, b) is first
        assert root(a, b.clone()) is not first  # a declared input is another tensor
        assert root(a, b) is first  # both entries kept
        assert inner(a[:, :4], b) is not first  # outside a transformer call: nothing to compare with
    assert stats.counts["inner"] == [2, 5]


def test_the_module_arguments_shape_guards_declared_inputs() -> None:
    inner = nn.Identity()
    root = _Narrowing(inner)
    stats, _ = install_reuse(root, [StepInvariant("inner", inputs=("a",))])
    a = torch.randn(2, 6)
    with torch.no_grad():
        first = root(a, 4)
        assert root(a, 4) is first
        assert root(a, 3).shape == (2, 3)  # the same input, but the module's own argument has another shape
    assert stats.counts["inner"] == [1, 3]


class _Narrowing(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, a: torch.Tensor, width: int) -> torch.Tensor:
        return self.inner(a[:, :width])


class _TwoCalls(nn.Module):
    """``forward(a)`` calls ``inner`` twice per call on two tensors of one shape built from ``a``."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return self.inner(a + 1.0) - self.inner(a * 2.0)


def test_a_module_called_twice_per_call_keeps_one_entry_per_call() -> None:
    root = _TwoCalls()
    a = torch.randn(2, 4)
    with torch.no_grad():
        expected = root(a)
        stats, _ = install_reuse(root, [StepInvariant("inner", inputs=("a",))])
        first, second = root(a), root(a)
    assert stats.counts["inner"] == [2, 4]
    torch.testing.assert_close(first, expected, rtol=0, atol=0)
    torch.testing.assert_close(second, expected, rtol=0, atol=0)


class _PerBlock(nn.Module):
    """One projection per block, each applied to its own fixed tensor (Bria FIBO's caption projections)."""

    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.proj = nn.ModuleList(nn.Linear(4, 4) for _ in range(depth))

    def forward(self, layers_in: list[torch.Tensor]) -> torch.Tensor:
        return sum(proj(x) for proj, x in zip(self.proj, layers_in, strict=True))


def test_a_pattern_serves_every_module_it_matches() -> None:
    root = _PerBlock()
    stats, _ = install_reuse(root, [StepInvariant("proj.*")])
    inputs = [torch.randn(2, 4) for _ in range(3)]
    with torch.no_grad():
        expected = root(inputs)
        torch.testing.assert_close(root(inputs), expected, rtol=0, atol=0)
    assert stats.counts == {f"proj.{i}": [1, 2] for i in range(3)}


def test_the_toy_family_without_declarations_reports_none() -> None:
    applied = apply_cache(ToyDiT(), TOY_ADAPTER.cache_plan, DBCache(fn=1, bn=0))
    assert applied.state.reuse is None
    applied.undo()


def test_check_adapter_refuses_unknown_modules_and_inputs() -> None:
    transformer = tiny_flux(0).transformer
    adapter = registry.adapter_for(transformer)
    check_adapter(transformer, adapter)
    for rules, message in [
        ((StepInvariant("transformer_blocks.0.attn"),), "inside the block list"),
        ((StepInvariant("pos_embed", inputs=("ids",)),), "not parameters"),
    ]:
        with pytest.raises(AdapterError, match=message):
            check_adapter(transformer, dataclasses.replace(adapter, step_invariant=rules))


@pytest.fixture(scope="module")
def dist2() -> WorkerPool:
    return get_pool(2)


def test_a_module_this_configuration_lacks_is_left_out_not_refused() -> None:
    transformer = tiny_flux(0).transformer
    adapter = registry.adapter_for(transformer)
    lacking = dataclasses.replace(adapter, step_invariant=(StepInvariant("no_such_module"), StepInvariant("none.*")))
    check_adapter(transformer, lacking)  # some modules exist only in some configurations
    stats, undo = install_reuse(transformer, lacking.step_invariant)
    assert stats.skipped == {
        "no_such_module": "no such module in this transformer",
        "none.*": "matches no module in this transformer",
    }
    assert not stats.counts
    undo()


def _left_out(root: nn.Module, module: str) -> str | None:
    stats, undo = install_reuse(root, [StepInvariant(module)])
    undo()
    return stats.skipped.get(module)


def test_modules_with_parallel_work_inside_are_left_out() -> None:
    class _RoutedProcessor:
        _parallel_config = object()  # its attention is dispatched to a parallel backend

    split_input = _Root(nn.Linear(4, 4))
    layers.install(split_input.inner, layers.Layer.PARALLEL_INPUT, "split", layers.LayerHook())
    assert "context parallelism runs inside it" in _left_out(split_input, "inner")

    gathering_child = _Root(_Root(nn.Linear(4, 4)))
    layers.install(gathering_child.inner.inner, layers.Layer.PARALLEL_OUTPUT, "gather", layers.LayerHook())
    assert "context parallelism runs inside it" in _left_out(gathering_child, "inner")

    routed = _Root(nn.Linear(4, 4))
    routed.inner.processor = _RoutedProcessor()
    assert "context parallelism runs inside it" in _left_out(routed, "inner")

    split_output = _Root(nn.Linear(4, 4))
    layers.install(split_output.inner, layers.Layer.PARALLEL_OUTPUT, "split", layers.LayerHook())
    assert _left_out(split_output, "inner") is None  # a split of its own output runs around the lookup


def _sharded_reason(rank: int, world_size: int) -> dict[str, str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world_size,))
    root = _Root(parallelize_module(nn.Linear(4, 8), mesh, ColwiseParallel()))
    stats, _ = install_reuse(root, [StepInvariant("inner")])
    return stats.skipped


@pytest.mark.distributed
def test_tensor_parallel_weights_are_left_out(dist2: WorkerPool) -> None:
    for skipped in dist2.run(_sharded_reason):
        assert "tensor parallelism" in skipped["inner"]


_TRUE_CFG = {"true_cfg_scale": 2.0, "negative_prompt": "a dog"}


def _family_under(rank: int, world_size: int, family: str, parallel: fastdit.Parallel | None):
    pipe, tiny = build_tiny(family)
    fastdit.accelerate(pipe, cache=DBCache(fn=1, bn=0, threshold=0.0), parallel=parallel)
    extra = _TRUE_CFG if parallel.cfg > 1 else {}
    try:  # the workers serve later tests: leave nothing installed (the attention routing is module-wide)
        images = run_tiny(pipe, tiny, num_inference_steps=4, **extra)
        return images, fastdit.summary(pipe).transformers["transformer"]["cache"]["step_invariant"]
    finally:
        fastdit.disable(pipe)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("family", "parallel"),
    [
        ("flux", fastdit.Parallel(ulysses=2)),
        ("flux", fastdit.Parallel(tp=2)),
        ("flux", fastdit.Parallel(cfg=2)),
        ("bria_fibo", fastdit.Parallel(ulysses=2)),
    ],
    ids=["flux-ulysses", "flux-tp", "flux-cfg", "bria_fibo-ulysses"],
)
def test_under_parallelism_every_rank_is_served_and_matches_one_process(dist2: WorkerPool, family, parallel) -> None:
    pipe, tiny = build_tiny(family)
    expected = run_tiny(pipe, tiny, num_inference_steps=4, **(_TRUE_CFG if parallel.cfg > 1 else {}))
    for images, invariant in dist2.run(_family_under, family, parallel, timeout=120):
        # Served from each rank's own shard: the ids are split beneath the lookup, an output split around it.
        assert not invariant["skipped"]
        assert all(counts["served"] > 0 for counts in invariant["modules"].values()), invariant
        np.testing.assert_allclose(images, expected, rtol=1e-4, atol=1e-4)
