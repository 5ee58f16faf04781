"""The nesting contract: hooks nest by layer whatever the installation order, and skipping hooks stay innermost."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch

from fastdit.hooks import layers
from fastdit.hooks.blocks import runner_of, set_stage
from fastdit.hooks.layers import Layer, LayerHook


class Linear(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


class Recorder(LayerHook):
    def __init__(self, name: str, log: list[str], skip: bool = False) -> None:
        self.name, self.log, self.skip = name, log, skip
        self.may_skip = skip

    def around(self, inner: Callable[..., Any], module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        self.log.append(f"enter {self.name}")
        out = args[0] if self.skip else inner(*args, **kwargs)
        self.log.append(f"leave {self.name}")
        return out


ORDER = [Layer.BRANCH, Layer.CHECK, Layer.GRAPH, Layer.TRACK, Layer.PARALLEL_INPUT, Layer.PARALLEL_OUTPUT, Layer.SKIP]


@pytest.mark.parametrize("permutation", list(itertools.permutations(range(len(ORDER))))[::97])
def test_nesting_follows_the_table_not_the_installation_order(permutation: tuple[int, ...]) -> None:
    module, log = Linear(), []
    undo = [
        layers.install(module, ORDER[i], ORDER[i].name, Recorder(ORDER[i].name, log, skip=ORDER[i] is Layer.SKIP))
        for i in permutation
    ]
    module(torch.zeros(1))
    assert log == [f"enter {layer.name}" for layer in ORDER] + [f"leave {layer.name}" for layer in reversed(ORDER)]
    assert [layer for layer in Layer if layer.may_skip] == [Layer.BRANCH, Layer.SKIP]  # outermost and innermost
    assert [name for _, name in layers.stack_of(module).names()] == [layer.name for layer in ORDER]
    for fn in undo:
        fn()
    assert layers.stack_of(module) is None
    assert torch.equal(module(torch.zeros(1)), torch.ones(1))


def test_a_skipping_hook_never_hides_a_transform_that_must_run() -> None:
    """A gather installed before the cache still runs on a step the cache skips (the cache × CP bug)."""
    module, log = Linear(), []
    layers.install(module, Layer.PARALLEL_OUTPUT, "gather", Recorder("gather", log))
    layers.install(module, Layer.SKIP, "cache", Recorder("cache", log, skip=True))
    assert torch.equal(module(torch.zeros(1)), torch.zeros(1))  # skipped the computation...
    assert log == ["enter gather", "enter cache", "leave cache", "leave gather"]  # ...not the gather


@pytest.mark.parametrize("layer", [layer for layer in Layer if not layer.may_skip])
def test_a_hook_that_may_skip_is_refused_outside_the_skip_layers(layer: Layer) -> None:
    module = Linear()
    with pytest.raises(ValueError, match=r"may skip the call.*Layer\.SKIP"):
        layers.install(module, layer, "cache", Recorder("cache", [], skip=True))
    assert layers.stack_of(module) is None or not layers.stack_of(module).entries


def test_same_layer_keeps_installation_order_and_names_are_unique() -> None:
    module, log = Linear(), []
    layers.install(module, Layer.PARALLEL_INPUT, "split", Recorder("split", log))
    layers.install(module, Layer.PARALLEL_INPUT, "count", Recorder("count", log))
    module(torch.zeros(1))
    assert log[:2] == ["enter split", "enter count"]
    with pytest.raises(ValueError, match="already installed"):
        layers.install(module, Layer.TRACK, "split", Recorder("x", log))


def test_runner_stages_sit_beneath_every_layer_and_undo_in_any_order() -> None:
    module, log = Linear(), []
    layers.install(module, Layer.SKIP, "cache", Recorder("cache", log))

    def graphs(fn: Callable[..., Any], *args: Any) -> Any:
        log.append("graph")
        return fn(*args)

    def compiled(x: torch.Tensor) -> torch.Tensor:
        log.append("compiled")
        return x + 1

    undo_compile = set_stage(module, "compiled", compiled)
    undo_graph = set_stage(module, "graphs", graphs)
    assert torch.equal(module(torch.zeros(1)), torch.ones(1))
    assert log == ["enter cache", "graph", "compiled", "leave cache"]
    undo_compile()
    assert runner_of(module) is not None
    undo_graph()
    assert runner_of(module) is None


def test_pipeline_context_and_reset_reach_the_stack() -> None:
    from diffusers import FluxTransformer2DModel

    from fastdit.models.flux import tiny_transformer

    module: FluxTransformer2DModel = tiny_transformer(0)
    seen, resets = [], []

    class Probe(LayerHook):
        def around(self, inner: Callable[..., Any], mod: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            seen.append(layers.announced_context(mod))
            return inner(*args, **kwargs)

        def reset(self) -> None:
            resets.append(True)

    layers.install(module, Layer.TRACK, "probe", Probe())
    inputs = {
        "hidden_states": torch.randn(1, 4, 16),
        "encoder_hidden_states": torch.randn(1, 3, 32),
        "pooled_projections": torch.randn(1, 32),
        "timestep": torch.tensor([0.5]),
        "img_ids": torch.zeros(4, 3),
        "txt_ids": torch.zeros(3, 3),
    }
    with torch.no_grad(), module.cache_context("uncond"):
        module(**inputs)
    with torch.no_grad():
        module(**inputs)
    module._reset_stateful_cache()
    assert seen == ["uncond", "default"] and resets == [True]


def test_removing_the_last_hook_leaves_no_instance_forward_behind() -> None:
    module, log = Linear(), []
    undo = layers.install(module, Layer.TRACK, "a", Recorder("a", log))
    assert "forward" in vars(module)  # the registry's wrapper, while installed
    undo()
    assert "forward" not in vars(module) and not hasattr(module, "_diffusers_hook")
    # A class-level patch made after disable reaches the module (an instance attribute would hide it).
    original = Linear.forward
    try:
        Linear.forward = lambda self, x: x + 2
        assert torch.equal(module(torch.zeros(1)), torch.full((1,), 2.0))
    finally:
        Linear.forward = original


def test_an_instance_forward_set_before_install_is_kept() -> None:
    module, log = Linear(), []
    module.forward = lambda x: x + 3
    undo = layers.install(module, Layer.TRACK, "a", Recorder("a", log))
    undo()
    assert torch.equal(module(torch.zeros(1)), torch.full((1,), 3.0))


def test_announce_reaches_the_stack_of_a_module_without_cache_contexts() -> None:
    """CFG parallelism announces a paired branch with :func:`layers.announce` where the transformer has no
    ``cache_context`` (not a diffusers ``CacheMixin``): the hooks beneath read it, and it ends with the block."""
    module = torch.nn.Linear(2, 2)
    seen = []

    class Probe(LayerHook):
        def around(self, inner: Callable[..., Any], mod: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            seen.append(layers.announced_context(mod))
            return inner(*args, **kwargs)

    remove = layers.install(module, Layer.TRACK, "probe", Probe())
    assert not hasattr(module, "cache_context")
    with torch.no_grad():
        with layers.announce(module, "uncond"):
            module(torch.zeros(1, 2))
        module(torch.zeros(1, 2))
    remove()
    with layers.announce(module, "cond"):  # nothing installed: nothing to announce to
        pass
    assert seen == ["uncond", "default"]


class _DiffusersRecorder:
    """A diffusers ``ModelHook`` that logs its pre- and post-forward (another library's hook on the same module)."""

    def __new__(cls, name: str, log: list[str]) -> Any:
        from diffusers.hooks import ModelHook

        class Hook(ModelHook):
            def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
                log.append(f"enter {name}")
                return args, kwargs

            def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
                log.append(f"leave {name}")
                return output

        return Hook()


@pytest.mark.parametrize("first", ["fastdit", "diffusers"])
def test_diffusers_hooks_beside_the_stack_keep_running_as_the_stack_changes(first: str) -> None:
    """The stack's ``forward`` skips the registry's wrapper around it: a diffusers hook registered on top (or
    beneath) still runs and nests with layers installed after it; removing both leaves the plain module."""
    from diffusers.hooks import HookRegistry

    module, log = Linear(), []
    registry = HookRegistry.check_if_exists_or_initialize(module)
    if first == "diffusers":
        registry.register_hook(_DiffusersRecorder("other", log), "other")
    undo_a = layers.install(module, Layer.TRACK, "a", Recorder("a", log))
    if first == "fastdit":
        registry.register_hook(_DiffusersRecorder("other", log), "other")
    undo_b = layers.install(module, Layer.SKIP, "b", Recorder("b", log))  # a change of the stack after both
    assert torch.equal(module(torch.zeros(1)), torch.ones(1))
    inner = ["enter a", "enter b", "leave b", "leave a"]
    outer = ["enter other", *inner, "leave other"] if first == "fastdit" else None
    assert log == (outer or ["enter a", "enter b", "enter other", "leave other", "leave b", "leave a"])
    log.clear()
    undo_b()
    module(torch.zeros(1))
    assert log == (["enter other", "enter a", "leave a", "leave other"] if first == "fastdit"
                   else ["enter a", "enter other", "leave other", "leave a"])  # fmt: skip
    if first == "diffusers":
        return  # removing a hook beneath another one rewires the registry's references wrongly: diffusers' own matter
    log.clear()
    registry.remove_hook("other", recurse=False)
    module(torch.zeros(1))
    assert log == ["enter a", "leave a"]
    log.clear()
    undo_a()
    assert torch.equal(module(torch.zeros(1)), torch.ones(1)) and log == []
    assert "forward" not in vars(module)
