"""CFG parallelism on every tiny pipeline: equal to one process, or refused with a clear error.

Sequential-CFG pipelines (a ``cond`` and an ``uncond`` call per step) must split the branches over the two ranks
(calls skipped on each rank), batched-CFG ones must split the batch; a pipeline whose tiny call has no unconditional
branch must raise :class:`CfgParallelError` (or be refused up front) on every rank — never return a wrong image.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np
import pytest

import fastdit
from fastdit.errors import ArgumentError
from fastdit.models.registry import all_adapters, get_family
from fastdit.testing.distributed import DistributedTestError, WorkerPool
from fastdit.testing.pipelines import build_tiny, run_tiny

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-4
STEPS = 3  # step 0 computes both branches on both ranks (the structure), steps 1-2 split them

CASES = [
    (adapter.family, tiny.name) for adapter in all_adapters() if adapter.cfg_parallel for tiny in adapter.tiny_pipelines
]
IDS = [f"{f}-{v}" for f, v in CASES]

# Tiny pipelines whose step count is not a plain num_inference_steps, and those that halve it (img2img strength, a
# second expert): the same overrides as the family matrices.
OVERRIDES: dict[tuple[str, str], dict[str, Any]] = {("sana", "sprint"): {"intermediate_timesteps": None}}


@functools.lru_cache(maxsize=4)
def _built(family: str, variant: str) -> tuple[Any, Any]:
    return build_tiny(family, variant)


def _overrides(family: str, variant: str, cached: bool = False) -> dict[str, Any]:
    steps = get_family(family).tiny(variant).call_kwargs["num_inference_steps"] * 3 // 2
    return {"num_inference_steps": steps, **OVERRIDES.get((family, variant), {})}


def _cache() -> fastdit.DBCache:
    mask = fastdit.StepMask(compute_steps=(0,), policy="static")
    return fastdit.DBCache(fn=1, bn=0, warmup_steps=0, step_mask=mask)


def _run(
    rank: int, world_size: int, family: str, variant: str, layout: dict | None, cache: bool, extra: dict | None = None
) -> dict:
    pipe, tiny = _built(family, variant)
    parallel = None if layout is None else fastdit.Parallel(**layout)
    fastdit.accelerate(pipe, parallel=parallel, cache=_cache() if cache else None)
    try:
        out = run_tiny(pipe, tiny, **_overrides(family, variant), **(extra or {}))
        info = fastdit.summary(pipe).transformers
        stats = {name: t.get("cfg_parallel", {}) for name, t in info.items()}
        cached = fastdit.summary(pipe).num_cached_steps if cache else 0
    finally:
        fastdit.disable(pipe)
    return {"out": out, "stats": stats, "cached": cached}


def _expected(family: str, variant: str, cache: bool = False) -> dict:
    return _run(0, 1, family, variant, None, cache)


def _check(results: list[dict], expected: dict) -> None:
    for result in results:
        err = np.abs(result["out"] - expected["out"]).max()
        assert err < TOLERANCE, f"max abs error {err:.2e}"
        stats = list(result["stats"].values())
        split = sum(s.get("skipped_calls", 0) + s.get("batched_calls", 0) for s in stats)
        assert split > 0, f"nothing was split over the CFG ranks: {stats}"


@pytest.mark.parametrize(("family", "variant"), CASES, ids=IDS)
def test_cfg2_matches_one_process_or_is_refused(dist2: WorkerPool, family: str, variant: str) -> None:
    expected = _expected(family, variant)
    try:
        results = dist2.run(_run, family, variant, {"cfg": 2}, False, timeout=240)
    except DistributedTestError as error:
        # No unconditional branch in this call: refused on every rank, with the reason.
        assert set(error.exc_types.values()) <= {
            "fastdit.errors.ArgumentError",
            "fastdit.parallel.cfg_parallel.CfgParallelError",
        }, error
        assert len(error.failures) == 2
        assert all("cfg=2" in f.message for f in error.failures.values())
        return
    _check(results, expected)


@pytest.mark.parametrize(
    ("family", "variant"),
    [
        ("qwenimage", "qwen-image"),  # sequential, announced
        ("wan", "t2v"),
        ("hunyuan_image", "hunyuan-image"),  # sequential, a guider's pred_cond / pred_uncond
        ("chroma", "chroma"),  # sequential, unannounced: paired by timestep
        ("sd3", "sd3"),  # batched
        ("pixart", "sigma"),
    ],
)
def test_cfg2_with_cache_matches_the_same_cache_on_one_process(dist2: WorkerPool, family: str, variant: str) -> None:
    expected = _expected(family, variant, cache=True)
    assert expected["cached"] > 0
    results = dist2.run(_run, family, variant, {"cfg": 2}, True, timeout=240)
    _check(results, expected)


@pytest.mark.parametrize(("family", "variant"), [("qwenimage", "qwen-image"), ("sd3", "sd3")])
@pytest.mark.parametrize("layout", [{"cfg": 2, "ulysses": 2}, {"cfg": 2, "tp": 2}], ids=["cfg2-ulysses2", "cfg2-tp2"])
def test_cfg2_on_one_mesh_with_context_or_tensor_parallel(
    dist4: WorkerPool, family: str, variant: str, layout: dict
) -> None:
    _check(dist4.run(_run, family, variant, layout, False, timeout=300), _expected(family, variant))


# Tiny calls that run one branch per step as configured for the matrix; with guidance on, their two calls pair.
GUIDED = [
    ("hunyuan_video", "i2v", {"true_cfg_scale": 4.0, "negative_prompt": "a dog"}),
    ("krea2", "turbo", {"guidance_scale": 4.0}),
]


@pytest.mark.parametrize(("family", "variant", "extra"), GUIDED, ids=[f"{f}-{v}" for f, v, _ in GUIDED])
def test_cfg2_pairs_the_calls_once_guidance_is_on(dist2: WorkerPool, family: str, variant: str, extra: dict) -> None:
    expected = _run(0, 1, family, variant, None, False, extra)
    _check(dist2.run(_run, family, variant, {"cfg": 2}, False, extra, timeout=240), expected)


def test_a_target_without_guidance_or_a_family_without_cfg_parallel_is_refused_before_anything_moves() -> None:
    pipe, _ = build_tiny("flux", "flux")
    with pytest.raises(ArgumentError, match=r"cfg=2 splits the conditional and unconditional .* takes no guidance"):
        fastdit.accelerate(pipe.transformer, parallel=fastdit.Parallel(cfg=2))  # a bare transformer
    pipe, _ = build_tiny("qwenimage", "qwen-image")
    opted_out = dataclasses.replace(get_family("qwenimage"), cfg_parallel=False, notes="No CFG parallelism: a reason.")
    with pytest.raises(ArgumentError, match=r"not available for model family 'qwenimage' \(a reason\)"):
        fastdit.accelerate(pipe, parallel=fastdit.Parallel(cfg=2), adapter=opted_out)


def _run_compiled(rank: int, world_size: int, family: str, variant: str) -> dict:
    pipe, tiny = _built(family, variant)
    # Dynamo traces the blocks of the calls this rank computes; the eager backend keeps this a CPU-time test.
    compile_config = fastdit.Compile(backend="eager")
    fastdit.accelerate(pipe, parallel=fastdit.Parallel(cfg=2), cache=_cache(), compile=compile_config)
    try:
        out = run_tiny(pipe, tiny, **_overrides(family, variant))
        stats = {name: t.get("cfg_parallel", {}) for name, t in fastdit.summary(pipe).transformers.items()}
    finally:
        fastdit.disable(pipe)
    return {"out": out, "stats": stats}


@pytest.mark.parametrize(("family", "variant"), [("qwenimage", "qwen-image"), ("sd3", "sd3")])
def test_cfg2_with_compiled_blocks_and_cache(dist2: WorkerPool, family: str, variant: str) -> None:
    _check(dist2.run(_run_compiled, family, variant, timeout=300), _expected(family, variant, cache=True))
