"""Every family with a context-parallel plan: its tiny pipelines on gloo ranks equal the single-process output.

The plan is discovered from the registry, so a family file that gains ``cp_plan`` is covered here without touching
this file. Ulysses and ring run on 2 ranks; Ulysses on 3 ranks exercises uneven sequence shards and padded heads.
Each layout runs without a cache and under a step cache that serves steps from the cache, with and without a back
block (the cache skips blocks a plan may split or gather at).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
import torch

import fastdit
from fastdit.models.base import resolve_attr
from fastdit.models.registry import adapter_for, all_adapters, get_family
from fastdit.testing.distributed import DistributedTestError, WorkerPool
from fastdit.testing.pipelines import build_tiny, run_tiny

pytestmark = pytest.mark.distributed

# Float32 on CPU: context parallelism reorders sums only; 1e-4 on [0, 1] outputs is > 80 dB PSNR.
TOLERANCE = 1e-4

# Tiny pipelines whose sequence is shorter than 3 tokens: 3 ranks must be refused with a clear error instead.
TOO_SHORT_FOR_3 = {("wan", "wan2.2-ti2v")}

CASES = [
    (adapter.family, tiny.name)
    for adapter in all_adapters()
    if adapter.cp_plan is not None
    for tiny in adapter.tiny_pipelines
]


@functools.lru_cache(maxsize=4)
def _built(family: str, variant: str) -> tuple[Any, Any]:
    return build_tiny(family, variant)


def _run(rank: int, world_size: int, family: str, variant: str, parallel: dict[str, int] | None) -> np.ndarray:
    pipe, tiny = _built(family, variant)
    if parallel is None:
        return run_tiny(pipe, tiny)
    fastdit.accelerate(pipe, parallel=fastdit.Parallel(**parallel))
    try:
        return run_tiny(pipe, tiny)
    finally:
        fastdit.disable(pipe)


LAYOUTS = {"ulysses2": {"ulysses": 2}, "ring2": {"ring": 2}, "ulysses3-uneven": {"ulysses": 3}}


@pytest.mark.parametrize("parallel", list(LAYOUTS.values()), ids=list(LAYOUTS))
@pytest.mark.parametrize(("family", "variant"), CASES, ids=[f"{f}-{v}" for f, v in CASES])
def test_family_matches_single_process(
    dist2: WorkerPool, dist3: WorkerPool, family: str, variant: str, parallel: dict[str, int]
) -> None:
    pool = dist3 if fastdit.Parallel(**parallel).world_size == 3 else dist2
    if pool is dist3 and (family, variant) in TOO_SHORT_FOR_3:
        with pytest.raises(DistributedTestError) as info:
            pool.run(_run, family, variant, parallel, timeout=180)
        assert set(info.value.exc_types.values()) == {"ValueError"}
        return
    expected = _expected(family, variant)
    for out in pool.run(_run, family, variant, parallel, timeout=180):
        assert out.shape == expected.shape
        assert np.isfinite(out).all()
        assert np.abs(out - expected).max() < TOLERANCE, f"max abs error {np.abs(out - expected).max():.2e}"


@functools.cache
def _expected(family: str, variant: str) -> np.ndarray:
    # One single-process reference per pipeline, shared by its layouts (the parent computes it while workers wait).
    return _run(0, 1, family, variant, None)


# --- under a step cache ---

# Front block 1, back blocks 0 or 1. With bn=0 the last block is a middle block: the cache measures its residual on
# computed steps and skips it on cached ones, so a plan that gathers at the last block meets the cache there. With
# bn=1 the last block always runs.
CACHE_BN = (0, 1)
FN = 1

# Tiny pipelines whose step count is not a plain ``num_inference_steps``: SANA-Sprint's SCM schedule takes exactly 2
# steps unless its intermediate timestep is dropped.
SCHEDULE_OVERRIDES: dict[tuple[str, str], dict[str, Any]] = {("sana", "sprint"): {"intermediate_timesteps": None}}


def _cache(bn: int) -> fastdit.DBCache:
    # Random weights never look converged to a threshold: a static mask computes step 0 and serves every later step
    # from the cache, the same on every rank.
    mask = fastdit.StepMask(compute_steps=(0,), policy="static")
    return fastdit.DBCache(fn=FN, bn=bn, warmup_steps=0, step_mask=mask)


def _cached_overrides(family: str, variant: str) -> dict[str, Any]:
    """Call arguments giving each transformer 3 denoising steps: step 0 computed, steps 1-2 from the cache."""
    # A tiny run denoises 2 steps per transformer; it asks for 4 where img2img strength 0.5 or a Wan 2.2 expert
    # boundary halves them. 3/2 of the declared count gives 3 per transformer either way.
    steps = get_family(family).tiny(variant).call_kwargs["num_inference_steps"] * 3 // 2
    return {"num_inference_steps": steps, **SCHEDULE_OVERRIDES.get((family, variant), {})}


def _num_blocks(family: str, variant: str) -> int:
    """Blocks of the smallest accelerated transformer of the tiny pipeline (what the cache plans its slots over)."""
    pipe, _ = _built(family, variant)
    counts = []
    for component in pipe.components.values():
        if not isinstance(component, torch.nn.Module) or adapter_for(component) is None:
            continue
        counts.append(sum(len(resolve_attr(component, g.path)) for g in adapter_for(component).block_groups))
    return min(counts)


def _run_cached(
    rank: int, world_size: int, family: str, variant: str, parallel: dict[str, int] | None, bn: int
) -> tuple[np.ndarray, int]:
    pipe, tiny = _built(family, variant)
    fastdit.accelerate(pipe, cache=_cache(bn), parallel=None if parallel is None else fastdit.Parallel(**parallel))
    try:
        out = run_tiny(pipe, tiny, **_cached_overrides(family, variant))
        return out, fastdit.summary(pipe).num_cached_steps
    finally:
        fastdit.disable(pipe)


def _default_layout(index: int, family: str, variant: str, bn: int) -> str:
    """The layout a tiny pipeline runs on with ``bn`` in the default run.

    It rotates with the pipeline's position and bn, so each pipeline meets two layouts and every layout meets both bn
    values; a layout that refuses the pipeline (too short for 3 ranks) passes to the next, so every default case
    compares outputs.
    """
    names = list(LAYOUTS)
    for shift in range(len(names)):
        layout = names[(index + bn + shift) % len(names)]
        if not (fastdit.Parallel(**LAYOUTS[layout]).world_size == 3 and (family, variant) in TOO_SHORT_FOR_3):
            return layout
    raise AssertionError(f"{family}/{variant}: no layout accepts it")


def _cache_params() -> list[Any]:
    """(family, variant, layout, bn) for every case: each tiny pipeline on one layout a bn value by default.

    The full matrix (every layout) costs about three times as much; the cases beyond the default are marked slow.
    """
    params = []
    for index, (family, variant) in enumerate(CASES):
        for bn in CACHE_BN:
            default = _default_layout(index, family, variant, bn)
            for layout in LAYOUTS:
                marks = () if layout == default else (pytest.mark.slow,)
                params.append(
                    pytest.param(family, variant, layout, bn, marks=marks, id=f"{family}-{variant}-{layout}-bn{bn}")
                )
    return params


@pytest.mark.parametrize(("family", "variant", "layout", "bn"), _cache_params())
def test_family_with_cache_matches_single_process(
    dist2: WorkerPool, dist3: WorkerPool, family: str, variant: str, layout: str, bn: int
) -> None:
    parallel = LAYOUTS[layout]
    if FN + bn >= _num_blocks(family, variant):
        # Too few blocks for this cache to leave a middle block: it must be refused, with or without parallelism.
        pipe, _ = _built(family, variant)
        with pytest.raises(ValueError, match="no middle block"):
            fastdit.accelerate(pipe, cache=_cache(bn))
        return
    pool = dist3 if fastdit.Parallel(**parallel).world_size == 3 else dist2
    if pool is dist3 and (family, variant) in TOO_SHORT_FOR_3:
        with pytest.raises(DistributedTestError) as info:
            pool.run(_run_cached, family, variant, parallel, bn, timeout=180)
        assert set(info.value.exc_types.values()) == {"ValueError"}
        return
    expected, expected_cached = _run_cached(0, 1, family, variant, None, bn)
    assert expected_cached > 0, "the schedule must serve steps from the cache"
    for out, cached in pool.run(_run_cached, family, variant, parallel, bn, timeout=180):
        assert cached == expected_cached
        assert out.shape == expected.shape
        assert np.isfinite(out).all()
        assert np.abs(out - expected).max() < TOLERANCE, f"max abs error {np.abs(out - expected).max():.2e}"
