"""Every family with a context-parallel plan: its tiny pipelines on gloo ranks equal the single-process output.

The matrix runs through the verify ladder (:mod:`fastdit.diagnostics.family_ladder`), the checks ``fastdit verify``
makes, at float32's exact threshold. The plan is discovered from the registry, so a family file that gains
``cp_plan`` is covered here without touching this file. Ulysses and ring run on 2 ranks; Ulysses on 3 ranks exercises
uneven sequence shards and padded heads. Every family also runs under a forced step cache (served steps, with and
without a back block: the cache skips blocks a plan may split or gather at), judged against the same cache on one
process: its first tiny pipeline in the default run, every pipeline on every layout in the slow one.
"""

from __future__ import annotations

import functools

import pytest
import torch

import fastdit
from fastdit.diagnostics.family_ladder import (
    FORCED_CACHE_FN,
    RungSpec,
    assert_rows,
    cached_call_overrides,
    run_family_ladder,
)
from fastdit.models.registry import adapter_for, all_adapters, get_family
from fastdit.models.validate import block_lists
from fastdit.testing.distributed import WorkerPool
from fastdit.testing.pipelines import build_tiny

pytestmark = pytest.mark.distributed

# Tiny pipelines whose sequence is shorter than 3 tokens: 3 ranks must be refused with a clear error instead.
# Tiny pipelines with a call too short for 3 ranks (the layout reports "not available" and the matrix checks that):
# Wan 2.2 TI2V's latents; Wan-Animate-2's reference pass (2 tokens; its bare transformer runs uneven Ulysses-3 in
# tests/parallel/test_wan_animate2_context_parallel.py).
TOO_SHORT_FOR_3 = {("wan", "wan2.2-ti2v"), ("wan_animate2", "animate")}

CASES = [
    (adapter.family, tiny.name)
    for adapter in all_adapters()
    if adapter.cp_plan is not None
    for tiny in adapter.tiny_pipelines
]
IDS = [f"{f}-{v}" for f, v in CASES]
# Uneven Ulysses-3 in the default run: every family's first tiny pipeline (each family meets the layout every run);
# its other pipelines run Ulysses-2 by default, ring-2 and uneven Ulysses-3 in the slow run.
FIRST_ON_THREE = [
    pytest.param(f, v, id=f"{f}-{v}", marks=() if get_family(f).tiny_pipelines[0].name == v else pytest.mark.slow)
    for f, v in CASES
]

LAYOUTS = {"ulysses2": {"ulysses": 2}, "ring2": {"ring": 2}, "ulysses3-uneven": {"ulysses": 3}}
CACHE_BN = (0, 1)


def _world(layout: str) -> int:
    return fastdit.Parallel(**LAYOUTS[layout]).world_size


@functools.lru_cache(maxsize=4)
def _num_blocks(family: str, variant: str) -> int:
    """Blocks of the smallest accelerated transformer of the tiny pipeline (what the cache plans its slots over)."""
    pipe, _ = build_tiny(family, variant)
    counts = []
    for component in pipe.components.values():
        if not isinstance(component, torch.nn.Module) or adapter_for(component) is None:
            continue
        counts.append(sum(len(blocks) for _, blocks in block_lists(component, adapter_for(component))))
    return min(counts)


def _default_layout(index: int, family: str, variant: str, bn: int) -> str:
    """The layout a tiny pipeline's cached run with ``bn`` takes in the default suite.

    It rotates with the pipeline's position and bn, so each pipeline meets two layouts and every layout meets both bn
    values; a layout that refuses the pipeline (too short for 3 ranks) passes to the next, so every default case
    compares outputs. The full matrix (every layout) costs about three times as much: the rest is marked slow.
    """
    names = list(LAYOUTS)
    for shift in range(len(names)):
        layout = names[(index + bn + shift) % len(names)]
        if not (_world(layout) == 3 and (family, variant) in TOO_SHORT_FOR_3):
            return layout
    raise AssertionError(f"{family}/{variant}: no layout accepts it")


def _specs(index: int, family: str, variant: str, world: int, slow: bool) -> list[RungSpec]:
    """The rungs of one pipeline on ``world`` ranks: the uncached layouts of the default run and, for a family's first
    tiny pipeline, its cached layout; with ``slow``, the rest of the matrix."""
    layouts = [name for name in LAYOUTS if _world(name) == world]
    first = get_family(family).tiny_pipelines[0].name == variant
    # Uncached, the default run takes every layout for a family's first tiny pipeline and Ulysses-2 for the others
    # (their ring-2 rung runs in the slow run), so every family meets every layout in every run.
    plain = layouts if first or world != 2 else ["ulysses2"]
    specs = [RungSpec(name, LAYOUTS[name]) for name in layouts if (name not in plain) == slow]
    for bn in CACHE_BN:
        default = _default_layout(index, family, variant, bn)
        for name in layouts:
            # The default run: each family's first tiny pipeline under the cache on its rotating layout.
            if (first and name == default) != slow:
                specs.append(RungSpec(f"{name}-cache-bn{bn}", LAYOUTS[name], cache_bn=bn))
    return specs


def _refusals(family: str, variant: str, specs: list[RungSpec]) -> dict[str, str]:
    """Rows that must be refused with their reason rather than pass."""
    refused = {}
    for spec in specs:
        if spec.cache_bn is not None and FORCED_CACHE_FN + spec.cache_bn >= _num_blocks(family, variant):
            refused[spec.name] = "no middle block"  # too few blocks for this cache, with or without parallelism
        elif fastdit.Parallel(**spec.parallel).world_size == 3 and (family, variant) in TOO_SHORT_FOR_3:
            refused[spec.name] = "fewer than the 3 ranks"
    return refused


def _check(pool: WorkerPool, index: int, family: str, variant: str, world: int, slow: bool) -> None:
    specs = _specs(index, family, variant, world, slow)
    if not specs:
        pytest.skip("every cached layout of this pipeline runs in the default suite")
    reports = pool.run(run_family_ladder, family, variant, specs, cached_call_overrides(family, variant), timeout=300)
    rows = assert_rows(reports, _refusals(family, variant, specs))
    for row in rows:
        if row["name"].endswith(("bn0", "bn1")) and row["status"] == "pass":
            assert row["cached_steps"] > 0, "the schedule must serve steps from the cache"


@pytest.mark.parametrize(("family", "variant"), CASES, ids=IDS)
def test_family_on_two_ranks_matches_single_process(dist2: WorkerPool, family: str, variant: str) -> None:
    _check(dist2, CASES.index((family, variant)), family, variant, 2, slow=False)


@pytest.mark.parametrize(("family", "variant"), FIRST_ON_THREE)
def test_family_on_three_uneven_ranks_matches_single_process(dist3: WorkerPool, family: str, variant: str) -> None:
    _check(dist3, CASES.index((family, variant)), family, variant, 3, slow=False)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(("family", "variant"), CASES, ids=IDS)
def test_family_cache_matrix_on_the_other_layouts(
    dist2: WorkerPool, dist3: WorkerPool, family: str, variant: str, world: int
) -> None:
    _check(dist2 if world == 2 else dist3, CASES.index((family, variant)), family, variant, world, slow=True)


FUSED_CASES = [
    (adapter.family, adapter.tiny_pipelines[0].name)
    for adapter in all_adapters()
    if adapter.cp_plan is not None and adapter.fused_projections
]


@pytest.mark.parametrize(("family", "variant"), FUSED_CASES, ids=[f"{f}-{v}" for f, v in FUSED_CASES])
def test_family_fused_under_a_cache_on_two_ranks(dist2: WorkerPool, family: str, variant: str) -> None:
    """Fused projections (each rank's shard through one matmul per group) under Ulysses-2 and the forced cache, against
    the same on one process, for every family that declares them (its first tiny pipeline)."""
    spec = RungSpec("ulysses2-fuse-cache-bn0", LAYOUTS["ulysses2"], cache_bn=0, fuse=True)
    reports = dist2.run(run_family_ladder, family, variant, [spec], cached_call_overrides(family, variant), timeout=300)
    rows = assert_rows(reports, _refusals(family, variant, [spec]))
    for row in rows[1:]:
        if row["status"] == "pass":
            fused = [info["fuse"] for info in row["summary"].values()]
            assert all(f["misses"] == 0 for f in fused) and sum(f["hits"] for f in fused) > 0, fused
