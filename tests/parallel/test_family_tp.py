"""Every family with a tensor-parallel plan: its tiny pipelines split over gloo ranks equal the single-process output.

Plans are discovered from the registry, so a family file that gains ``tp_plan`` is covered here without touching
this file. Each pipeline runs split over 2 ranks (per-rank parameter bytes as planned, ``disable`` bit-identical),
under a step cache that serves steps from the cache with and without a back block, and its plan is checked on the
``meta`` device for a degree that divides and one that does not.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
import torch

import fastdit
from fastdit.components import walk
from fastdit.models.registry import all_adapters, get_family
from fastdit.parallel.plan import match_modules
from fastdit.parallel.tp_plan import Colwise, parent_of, plan_layers, resolve_tp_plan, segment_sizes
from fastdit.testing.distributed import WorkerPool
from fastdit.testing.pipelines import build_tiny, run_tiny

pytestmark = pytest.mark.distributed

# Float32 on CPU: splitting reorders the sums of the row-wise layers only.
TOLERANCE = 1e-4

CASES = [
    (adapter.family, tiny.name)
    for adapter in all_adapters()
    if adapter.tp_plan is not None
    for tiny in adapter.tiny_pipelines
]
IDS = [f"{f}-{v}" for f, v in CASES]
FAMILIES = sorted({family for family, _ in CASES})


@functools.lru_cache(maxsize=4)
def _built(family: str, variant: str) -> tuple[Any, Any]:
    return build_tiny(family, variant)


def _denoisers(pipe: Any) -> dict[str, torch.nn.Module]:
    return {c.name: c.module for c in walk(pipe).denoisers}


def _state_bytes(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items()}


def _run_split(rank: int, world_size: int, family: str, variant: str) -> dict[str, Any]:
    pipe, tiny = _built(family, variant)
    before = {name: (module, _state_bytes(module)) for name, module in _denoisers(pipe).items()}
    fastdit.accelerate(pipe, parallel=fastdit.Parallel(tp=world_size))
    try:
        out = run_tiny(pipe, tiny)
        stats = {name: info["tensor_parallel"] for name, info in fastdit.summary(pipe).transformers.items()}
    finally:
        fastdit.disable(pipe)
    restored = all(
        all(torch.equal(module.state_dict()[k], v) for k, v in state.items()) and len(module.state_dict()) == len(state)
        for module, state in before.values()
    )
    return {"out": out, "stats": stats, "restored": restored, "after": run_tiny(pipe, tiny)}


@pytest.mark.parametrize(("family", "variant"), CASES, ids=IDS)
def test_tp2_matches_single_process(dist2: WorkerPool, family: str, variant: str) -> None:
    pipe, tiny = _built(family, variant)
    expected = run_tiny(pipe, tiny)
    for result in dist2.run(_run_split, family, variant, timeout=240):
        out = result["out"]
        assert out.shape == expected.shape and np.isfinite(out).all()
        assert np.abs(out - expected).max() < TOLERANCE, f"max abs error {np.abs(out - expected).max():.2e}"
        for name, stats in result["stats"].items():
            assert stats["split_layers"] > 0, name
            # Per-rank bytes are exactly the split half plus everything held whole.
            assert stats["parameter_bytes_per_rank"] == stats["split_bytes"] // 2 + stats["replicated_bytes"], name
        assert result["restored"], "disable did not give back the original weights"
        assert np.array_equal(result["after"], expected), "disable is not bit-identical to the original model"


# --- under a step cache ---


def _cache(bn: int) -> fastdit.DBCache:
    # Random weights never look converged to a threshold: compute step 0, serve later steps from the cache.
    mask = fastdit.StepMask(compute_steps=(0,), policy="static")
    return fastdit.DBCache(fn=1, bn=bn, warmup_steps=0, step_mask=mask)


SCHEDULE_OVERRIDES: dict[tuple[str, str], dict[str, Any]] = {("sana", "sprint"): {"intermediate_timesteps": None}}


def _cached_overrides(family: str, variant: str) -> dict[str, Any]:
    steps = get_family(family).tiny(variant).call_kwargs["num_inference_steps"] * 3 // 2
    return {"num_inference_steps": steps, **SCHEDULE_OVERRIDES.get((family, variant), {})}


def _run_cached(rank: int, world_size: int, family: str, variant: str, tp: int, bn: int) -> tuple[np.ndarray, int]:
    pipe, tiny = _built(family, variant)
    parallel = fastdit.Parallel(tp=tp) if tp > 1 else None
    fastdit.accelerate(pipe, cache=_cache(bn), parallel=parallel)
    try:
        return run_tiny(pipe, tiny, **_cached_overrides(family, variant)), fastdit.summary(pipe).num_cached_steps
    finally:
        fastdit.disable(pipe)


def _num_blocks(family: str, variant: str) -> int:
    pipe, _ = _built(family, variant)
    counts = []
    for component in walk(pipe).denoisers:
        counts.append(sum(1 for _ in component.blocks()))
    return min(counts)


@pytest.mark.parametrize("bn", [0, 1])
@pytest.mark.parametrize(("family", "variant"), CASES, ids=IDS)
def test_tp2_cache_matches_single_process_cache(dist2: WorkerPool, family: str, variant: str, bn: int) -> None:
    if _num_blocks(family, variant) < 2 + bn:
        pytest.skip("too few blocks for a middle segment")
    expected, expected_cached = _run_cached(0, 1, family, variant, 1, bn)
    assert expected_cached > 0
    for out, cached in dist2.run(_run_cached, family, variant, 2, bn, timeout=240):
        assert cached == expected_cached
        assert np.abs(out - expected).max() < TOLERANCE, f"max abs error {np.abs(out - expected).max():.2e}"


# --- the plan against the module tree, on the meta device ---


@pytest.mark.parametrize("family", FAMILIES)
def test_plan_fits_on_meta(family: str) -> None:
    adapter = get_family(family)
    pipe = adapter.tiny().build()
    for module in _denoisers(pipe).values():
        meta = module.to("meta")
        resolve_tp_plan(meta, adapter.tp_plan, 2, family)  # the full plan, or the fallback the tiny model takes
        # A degree no plan of the chain meets is refused, naming the family and the valid degrees.
        with pytest.raises(ValueError, match=rf"tensor-parallel plan of {family!r}: .* not divisible by tp=7; valid"):
            resolve_tp_plan(meta, adapter.tp_plan, 7, family)


# --- agreement with the plans diffusers ships ---


def _diffusers_sizes(style: Any, module: torch.nn.Linear) -> tuple[str, list[int]]:
    """What a diffusers ``_tp_plan`` entry does to ``module``: its kind and the absolute sizes of its blocks."""
    if isinstance(style, str):
        kind = {"colwise": "col", "rowwise": "row"}[style]
        return kind, [module.out_features if kind == "col" else module.in_features]
    kind = "col" if type(style).__name__ == "PackedColwiseParallel" else "row"
    blocks = style.blocks or getattr(module, f"_tp_packed_{kind}_blocks")
    total = module.out_features if kind == "col" else module.in_features
    unit = total // sum(blocks)
    return kind, [b * unit for b in blocks]


@pytest.mark.parametrize("family", FAMILIES)
def test_plan_agrees_with_diffusers_where_it_ships_one(family: str) -> None:
    adapter = get_family(family)
    pipe = adapter.tiny().build()
    for module in _denoisers(pipe).values():
        theirs = getattr(type(module), "_tp_plan", None)
        if not theirs:
            continue
        ours = {name: (layer, style) for name, layer, style in plan_layers(module, adapter.tp_plan)}
        for pattern, style in theirs.items():
            for name, layer in match_modules(module, pattern):
                assert name in ours, f"diffusers splits {name}; our plan does not"
                kind, sizes = _diffusers_sizes(style, layer)
                our_layer, our_style = ours[name]
                assert ("col" if isinstance(our_style, Colwise) else "row") == kind, name
                assert not getattr(our_style, "gather_output", False), name
                owner, _ = parent_of(module, name)
                assert segment_sizes(owner, our_layer, our_style, name) == sizes, name


# --- on one mesh with context parallelism ---

# Families whose TP × CP composition is checked on 4 ranks (the first tiny pipeline of each).
MESH_FAMILIES = ("flux", "wan", "qwenimage", "hunyuan_video")
MESH_LAYOUTS = {"tp2-ulysses2": {"tp": 2, "ulysses": 2}, "tp2-ring2": {"tp": 2, "ring": 2}}


def _run_layout(rank: int, world_size: int, family: str, variant: str, layout: dict[str, int], bn: int | None):
    pipe, tiny = _built(family, variant)
    cache = None if bn is None else _cache(bn)
    fastdit.accelerate(pipe, parallel=fastdit.Parallel(**layout), cache=cache)
    try:
        overrides = {} if bn is None else _cached_overrides(family, variant)
        return run_tiny(pipe, tiny, **overrides), fastdit.summary(pipe).num_cached_steps
    finally:
        fastdit.disable(pipe)


@pytest.mark.parametrize("layout", list(MESH_LAYOUTS), ids=list(MESH_LAYOUTS))
@pytest.mark.parametrize("family", MESH_FAMILIES)
def test_tp_with_context_parallel_matches_single_process(dist4: WorkerPool, family: str, layout: str) -> None:
    variant = get_family(family).tiny_pipelines[0].name
    pipe, tiny = _built(family, variant)
    expected = run_tiny(pipe, tiny)
    for out, _ in dist4.run(_run_layout, family, variant, MESH_LAYOUTS[layout], None, timeout=300):
        assert np.abs(out - expected).max() < TOLERANCE, f"max abs error {np.abs(out - expected).max():.2e}"


@pytest.mark.parametrize("family", MESH_FAMILIES)
def test_tp_ulysses_cache_matches_single_process_cache(dist4: WorkerPool, family: str) -> None:
    variant = get_family(family).tiny_pipelines[0].name
    expected, expected_cached = _run_cached(0, 1, family, variant, 1, 0)
    results = dist4.run(_run_layout, family, variant, MESH_LAYOUTS["tp2-ulysses2"], 0, timeout=300)
    for out, cached in results:
        assert cached == expected_cached
        assert np.abs(out - expected).max() < TOLERANCE, f"max abs error {np.abs(out - expected).max():.2e}"


# --- with compiled blocks ---


def _run_compiled(rank: int, world_size: int, family: str, variant: str, bn: int) -> np.ndarray:
    pipe, tiny = _built(family, variant)
    # Dynamo traces the blocks through DTensor's layouts; the eager backend keeps this a CPU-time test.
    compile_config = fastdit.Compile(backend="eager", fullgraph=False)
    fastdit.accelerate(pipe, parallel=fastdit.Parallel(tp=world_size), cache=_cache(bn), compile=compile_config)
    try:
        return run_tiny(pipe, tiny, **_cached_overrides(family, variant))
    finally:
        fastdit.disable(pipe)


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_tp_with_compiled_blocks_and_cache(dist2: WorkerPool, family: str) -> None:
    variant = get_family(family).tiny_pipelines[0].name
    expected, _ = _run_cached(0, 1, family, variant, 1, 1)
    for out in dist2.run(_run_compiled, family, variant, 1, timeout=300):
        assert np.abs(out - expected).max() < TOLERANCE, f"max abs error {np.abs(out - expected).max():.2e}"
