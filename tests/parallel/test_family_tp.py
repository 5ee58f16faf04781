"""Every family with a tensor-parallel plan: its tiny pipelines split over gloo ranks equal the single-process output.

Plans are discovered from the registry, so a family file that gains ``tp_plan`` is covered here without touching
this file. The matrix runs through the verify ladder (:mod:`fastdit.diagnostics.family_ladder`) at float32's exact
threshold. Every family's first tiny pipeline runs split over 2 ranks (per-rank parameter bytes as planned,
``disable`` bit-identical, the weights given back) and under a step cache that serves steps from the cache with and
without a back block (against the same cache on one process); its other pipelines run the same in the slow run.
FLUX and Wan (every family in the slow run)
also under TeaCache and under DBCache and MagCache forecasting with FoCa and Hermite; and each plan is checked on the
``meta`` device for a degree that divides and one that does not.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fastdit.components import walk
from fastdit.diagnostics.family_ladder import (
    RungSpec,
    _built,
    assert_rows,
    cached_call_overrides,
    run_cache_combinations,
    run_family_ladder,
)
from fastdit.models.registry import all_adapters, get_family
from fastdit.parallel.plan import match_modules
from fastdit.parallel.tp_plan import Colwise, parent_of, plan_layers, resolve_tp_plan, segment_sizes
from fastdit.testing.distributed import WorkerPool

pytestmark = pytest.mark.distributed

CASES = [
    (adapter.family, tiny.name)
    for adapter in all_adapters()
    if adapter.tp_plan is not None
    for tiny in adapter.tiny_pipelines
]
IDS = [f"{f}-{v}" for f, v in CASES]
FAMILIES = sorted({family for family, _ in CASES})


def _denoisers(pipe: Any) -> dict[str, torch.nn.Module]:
    return {c.name: c.module for c in walk(pipe).denoisers}


def _num_blocks(family: str, variant: str) -> int:
    pipe, _ = _built(family, variant)
    return min(sum(1 for _ in component.blocks()) for component in walk(pipe).denoisers)


def _ladder_keeping_weights(rank: int, world_size: int, family: str, variant: str, specs: list[RungSpec]) -> dict:
    """The ladder, and whether every denoiser's state dict is bit-identical after it (``disable`` gave it back).

    The pipeline is the one the ladder runs (:func:`run_family_ladder` builds it once per rank and keeps it)."""
    pipe, _ = _built(family, variant)
    before = {name: {k: v.clone() for k, v in m.state_dict().items()} for name, m in _denoisers(pipe).items()}
    report = run_family_ladder(rank, world_size, family, variant, specs, cached_call_overrides(family, variant))
    after = {name: m.state_dict() for name, m in _denoisers(pipe).items()}
    report["restored"] = all(
        state.keys() == after[name].keys() and all(torch.equal(after[name][k], v) for k, v in state.items())
        for name, state in before.items()
    )
    return report


def _first_variant(family: str, variant: str) -> bool:
    return get_family(family).tiny_pipelines[0].name == variant


def _cached_specs(family: str, variant: str) -> list[RungSpec]:
    # The forced cache needs a middle block: front 1 and back bn blocks around it.
    return [
        RungSpec(f"tp2-cache-bn{bn}", {"tp": 2}, cache_bn=bn) for bn in (0, 1) if _num_blocks(family, variant) >= 2 + bn
    ]


# Every family in the default run through its first tiny pipeline; its other pipelines in the slow run.
FIRST_BY_DEFAULT = [
    pytest.param(f, v, id=f"{f}-{v}", marks=() if _first_variant(f, v) else pytest.mark.slow) for f, v in CASES
]


@pytest.mark.parametrize(("family", "variant"), FIRST_BY_DEFAULT)
def test_tp2_matches_single_process_alone_and_under_a_cache(dist2: WorkerPool, family: str, variant: str) -> None:
    specs = [RungSpec("tp2", {"tp": 2}, check_disable=True)]
    if _first_variant(family, variant):
        specs += _cached_specs(family, variant)
    reports = dist2.run(_ladder_keeping_weights, family, variant, specs, timeout=300)
    rows = {row["name"]: row for row in assert_rows(reports)}
    assert all(report["restored"] for report in reports), "disable did not give back the original weights"
    for name, stats in rows["tp2"]["summary"].items():
        stats = stats["tensor_parallel"]
        assert stats["split_layers"] > 0, name
        # Per-rank bytes are exactly the split half plus everything held whole.
        assert stats["parameter_bytes_per_rank"] == stats["split_bytes"] // 2 + stats["replicated_bytes"], name
    assert all(row["cached_steps"] > 0 for key, row in rows.items() if "cache" in key)


OTHER_VARIANTS = [(f, v) for f, v in CASES if not _first_variant(f, v)]


@pytest.mark.slow
@pytest.mark.parametrize(("family", "variant"), OTHER_VARIANTS, ids=[f"{f}-{v}" for f, v in OTHER_VARIANTS])
def test_tp2_cache_on_every_other_tiny_pipeline(dist2: WorkerPool, family: str, variant: str) -> None:
    specs = _cached_specs(family, variant)
    if not specs:
        pytest.skip("too few blocks for a middle segment")
    reports = dist2.run(_ladder_keeping_weights, family, variant, specs, timeout=300)
    rows = assert_rows(reports)
    assert all(report["restored"] for report in reports) and all(row["cached_steps"] > 0 for row in rows[1:])


# --- under the other step caches: TeaCache, and DBCache and MagCache forecasting ---

# The default run's share of the sweep: an image family with two block lists and a video family.
REPRESENTATIVE = ("flux", "wan")
POLICIES = ("dbcache", "magcache")


def _first(family: str) -> str:
    return get_family(family).tiny_pipelines[0].name


def _assert_cached(reports: list[dict]) -> list[dict]:
    """Every row passes against the same cache on one process (steps served included) and served steps."""
    rows = assert_rows(reports)
    for row in rows[1:]:
        assert row["cached_steps"] > 0, f"{row['name']}: no step was served from the cache"
    return rows


@pytest.mark.parametrize("family", REPRESENTATIVE)
def test_tp2_under_teacache_and_forecasts_matches_one_process(dist2: WorkerPool, family: str) -> None:
    # Their schedules are spaced evenly enough to forecast over the timestep too, as the fast presets do.
    reports = dist2.run(run_cache_combinations, family, _first(family), "tp2", {"tp": 2}, False, True, timeout=300)
    names = [row["name"].removeprefix("tp2-") for row in _assert_cached(reports)[1:]]
    assert names == [
        "teacache",
        *(f"{p}-{m}" for m in ("foca", "hermite", "foca-timestep") for p in POLICIES),
        "dbcache-ahead",
    ]


@pytest.mark.slow
@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in REPRESENTATIVE])
def test_tp2_under_teacache_and_forecasts_on_every_family(dist2: WorkerPool, family: str) -> None:
    _assert_cached(dist2.run(run_cache_combinations, family, _first(family), "tp2", {"tp": 2}, timeout=300))


# --- with an attention backend on one device (TP without CP: the backend takes the attention calls) ---

# Two families through diffusers' dispatch (one with two block lists, one video) and one through its SDPA calls.
ATTENTION_DEFAULT = ("flux", "wan", "cogvideox")


@pytest.mark.parametrize(
    "family", [f if f in ATTENTION_DEFAULT else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES]
)
def test_tp2_with_an_attention_backend_matches_one_process(dist2: WorkerPool, family: str) -> None:
    """TP-2 with the ``math`` backend, alone and under a cache, against the same backend on one process."""
    variant = _first(family)
    specs = [RungSpec("tp2-attention", {"tp": 2}, attention="math")]
    if _num_blocks(family, variant) >= 2:
        specs.append(RungSpec("tp2-attention-cache", {"tp": 2}, cache_bn=0, attention="math"))
    reports = dist2.run(_ladder_keeping_weights, family, variant, specs, timeout=300)
    rows = {row["name"]: row for row in assert_rows(reports)}
    assert all(report["restored"] for report in reports)
    for name, info in rows["tp2-attention"]["summary"].items():
        assert info["attention"]["backend"] == "math" and "tensor_parallel" in info, name
    assert all(row["cached_steps"] > 0 for key, row in rows.items() if "cache" in key)


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
MESH_SPECS = [
    RungSpec("tp2-ulysses2", {"tp": 2, "ulysses": 2}),
    RungSpec("tp2-ring2", {"tp": 2, "ring": 2}),
    RungSpec("tp2-ulysses2-cache-bn0", {"tp": 2, "ulysses": 2}, cache_bn=0),
]


@pytest.mark.parametrize("family", MESH_FAMILIES)
def test_tp_with_context_parallel_matches_single_process(dist4: WorkerPool, family: str) -> None:
    variant = get_family(family).tiny_pipelines[0].name
    overrides = cached_call_overrides(family, variant)
    assert_rows(dist4.run(run_family_ladder, family, variant, MESH_SPECS, overrides, timeout=300))


# --- with compiled blocks ---


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_tp_with_compiled_blocks_and_cache(dist2: WorkerPool, family: str) -> None:
    variant = get_family(family).tiny_pipelines[0].name
    specs = [RungSpec("tp2-cache-bn1-compiled", {"tp": 2}, cache_bn=1, compile=True)]
    overrides = cached_call_overrides(family, variant)
    assert_rows(dist2.run(run_family_ladder, family, variant, specs, overrides, timeout=300))


@pytest.mark.parametrize("family", REPRESENTATIVE)
def test_tp_with_compiled_blocks_under_teacache_and_forecasts(dist2: WorkerPool, family: str) -> None:
    reports = dist2.run(run_cache_combinations, family, _first(family), "tp2-compiled", {"tp": 2}, True, timeout=300)
    _assert_cached(reports)


# FLUX in the default run (about 2 s on warm ranks), the other mesh families in the slow one.
@pytest.mark.parametrize(
    "family", [f if f == "flux" else pytest.param(f, marks=pytest.mark.slow) for f in MESH_FAMILIES]
)
def test_tp_with_context_parallel_under_teacache_and_forecasts(dist4: WorkerPool, family: str) -> None:
    layout = {"tp": 2, "ulysses": 2}
    _assert_cached(dist4.run(run_cache_combinations, family, _first(family), "tp2-ulysses2", layout, timeout=300))
