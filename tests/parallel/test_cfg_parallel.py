"""CFG parallelism on every tiny pipeline: equal to one process, or refused with a clear error.

Sequential-CFG pipelines (a ``cond`` and an ``uncond`` call per step) must split the branches over the two ranks
(calls skipped on each rank), batched-CFG ones must split the batch; a pipeline whose tiny call has no unconditional
branch must raise :class:`CfgParallelError` (or be refused up front) on every rank — never return a wrong image.
The matrix runs through the verify ladder (:mod:`fastdit.diagnostics.family_ladder`) at float32's exact threshold; under
a cache each row is judged against the same cache on one process, and each cache branch a rank ran against that
branch on one process (DBCache's forced schedule, TeaCache's, and DBCache and MagCache forecasting with FoCa and
Hermite).
"""

from __future__ import annotations

import dataclasses

import pytest

import fastdit
from fastdit.diagnostics.family_ladder import (
    RungSpec,
    assert_rows,
    cached_call_overrides,
    run_cache_combinations,
    run_family_ladder,
)
from fastdit.diagnostics.verify import Status
from fastdit.errors import ArgumentError
from fastdit.models.registry import all_adapters, get_family
from fastdit.testing.distributed import WorkerPool
from fastdit.testing.pipelines import build_tiny

pytestmark = pytest.mark.distributed

CASES = [
    (adapter.family, tiny.name) for adapter in all_adapters() if adapter.cfg_parallel for tiny in adapter.tiny_pipelines
]
IDS = [f"{f}-{v}" for f, v in CASES]

CFG2 = RungSpec("cfg2", {"cfg": 2})
CFG2_CACHED = RungSpec("cfg2-cache", {"cfg": 2}, cache_bn=0)


def _split_calls(row: dict) -> int:
    stats = [info.get("cfg_parallel", {}) for info in row["summary"].values()]
    return sum(s.get("skipped_calls", 0) + s.get("batched_calls", 0) for s in stats)


def _ladder(
    pool: WorkerPool, family: str, variant: str, specs: list[RungSpec], extra: dict | None = None
) -> list[dict]:
    overrides = {**cached_call_overrides(family, variant), **(extra or {})}
    return pool.run(run_family_ladder, family, variant, specs, overrides, timeout=300)


def _passed_and_split(reports: list[dict]) -> list[dict]:
    """Every row passes and split the branches over the CFG ranks; rank 0's rows."""
    rows = assert_rows(reports)
    for row in rows[1:]:
        assert _split_calls(row) > 0, f"{row['name']}: nothing was split over the CFG ranks: {row['summary']}"
    return rows


def _check(pool: WorkerPool, family: str, variant: str, specs: list[RungSpec], extra: dict | None = None) -> list[dict]:
    return _passed_and_split(_ladder(pool, family, variant, specs, extra))


@pytest.mark.parametrize(("family", "variant"), CASES, ids=IDS)
def test_cfg2_matches_one_process_or_is_refused(dist2: WorkerPool, family: str, variant: str) -> None:
    reports = _ladder(dist2, family, variant, [CFG2])
    row = reports[0]["rows"][1]
    if row["status"] == Status.NOT_AVAILABLE:
        # No unconditional branch in this call: refused on every rank, with the reason.
        assert all(r["rows"][1]["status"] == Status.NOT_AVAILABLE for r in reports)
        assert "cfg=2" in row["reason"], row
        return
    _passed_and_split(reports)


FIRST_CASES = [(f, v) for f, v in CASES if get_family(f).tiny_pipelines[0].name == v]
# Sequential announced CFG through diffusers' dispatch, batched CFG through the SDPA calls.
ATTENTION_DEFAULT = ("qwenimage", "sd3")


@pytest.mark.parametrize(
    ("family", "variant"),
    [c if c[0] in ATTENTION_DEFAULT else pytest.param(*c, marks=pytest.mark.slow) for c in FIRST_CASES],
    ids=[f"{f}-{v}" for f, v in FIRST_CASES],
)
def test_cfg2_with_an_attention_backend_matches_one_process(dist2: WorkerPool, family: str, variant: str) -> None:
    """cfg=2 with the ``math`` backend on one device, against the same backend on one process (or refused on every
    rank where the call has no unconditional branch, as without a backend)."""
    reports = _ladder(dist2, family, variant, [RungSpec("cfg2-attention", {"cfg": 2}, attention="math")])
    row = reports[0]["rows"][1]
    if row["status"] == Status.NOT_AVAILABLE:
        assert all(r["rows"][1]["status"] == Status.NOT_AVAILABLE for r in reports)
        return
    rows = _passed_and_split(reports)
    assert all(info["attention"]["backend"] == "math" for info in rows[1]["summary"].values())


@pytest.mark.parametrize(
    ("family", "variant"),
    [c if c[0] in ATTENTION_DEFAULT else pytest.param(*c, marks=pytest.mark.slow) for c in FIRST_CASES],
    ids=[f"{f}-{v}" for f, v in FIRST_CASES],
)
def test_cfg2_with_fused_projections_matches_one_process(dist2: WorkerPool, family: str, variant: str) -> None:
    """cfg=2 with the family's projections fused, against the same fusion on one process (or refused on every rank
    where the call has no unconditional branch, or the family declares no projections to fuse)."""
    reports = _ladder(dist2, family, variant, [RungSpec("cfg2-fuse", {"cfg": 2}, fuse=True)])
    row = reports[0]["rows"][1]
    if row["status"] == Status.NOT_AVAILABLE:
        assert all(r["rows"][1]["status"] == Status.NOT_AVAILABLE for r in reports)
        return
    rows = _passed_and_split(reports)
    assert all(info["fuse"]["misses"] == 0 for info in rows[1]["summary"].values())


@pytest.mark.parametrize(
    ("family", "variant"),
    [
        ("qwenimage", "qwen-image"),  # sequential, announced
        ("wan", "t2v"),
        ("hunyuan_image", "hunyuan-image"),  # sequential, a guider's pred_cond / pred_uncond
        ("chroma", "chroma"),  # sequential, unannounced: paired by timestep
        ("minimax_music3", "t2a"),  # a guider's unannounced calls, a transformer without cache contexts
        ("sd3", "sd3"),  # batched
        ("pixart", "sigma"),
    ],
)
def test_cfg2_with_cache_matches_the_same_cache_on_one_process(dist2: WorkerPool, family: str, variant: str) -> None:
    rows = _check(dist2, family, variant, [CFG2_CACHED])
    assert rows[1]["cached_steps"] > 0


@pytest.mark.parametrize(("family", "variant"), [("qwenimage", "qwen-image"), ("sd3", "sd3")])
def test_cfg2_on_one_mesh_with_context_or_tensor_parallel(dist4: WorkerPool, family: str, variant: str) -> None:
    specs = [RungSpec("cfg2-ulysses2", {"cfg": 2, "ulysses": 2}), RungSpec("cfg2-tp2", {"cfg": 2, "tp": 2})]
    _check(dist4, family, variant, specs)


# Tiny calls that run one branch per step as configured for the matrix; with guidance on, their two calls pair.
GUIDED = [
    ("hunyuan_video", "i2v", {"true_cfg_scale": 4.0, "negative_prompt": "a dog"}),
    ("krea2", "turbo", {"guidance_scale": 4.0}),
]


@pytest.mark.parametrize(("family", "variant", "extra"), GUIDED, ids=[f"{f}-{v}" for f, v, _ in GUIDED])
def test_cfg2_pairs_the_calls_once_guidance_is_on(dist2: WorkerPool, family: str, variant: str, extra: dict) -> None:
    _check(dist2, family, variant, [CFG2], extra)


def test_a_target_without_guidance_or_a_family_without_cfg_parallel_is_refused_before_anything_moves() -> None:
    pipe, _ = build_tiny("flux", "flux")
    with pytest.raises(ArgumentError, match=r"cfg=2 splits the conditional and unconditional .* takes no guidance"):
        fastdit.accelerate(pipe.transformer, parallel=fastdit.Parallel(cfg=2))  # a bare transformer
    pipe, _ = build_tiny("qwenimage", "qwen-image")
    opted_out = dataclasses.replace(get_family("qwenimage"), cfg_parallel=False, notes="No CFG parallelism: a reason.")
    with pytest.raises(ArgumentError, match=r"not available for model family 'qwenimage' \(a reason\)"):
        fastdit.accelerate(pipe, parallel=fastdit.Parallel(cfg=2), adapter=opted_out)


@pytest.mark.parametrize("cache", [fastdit.MagCache(calibrate=True), fastdit.TeaCache(calibrate=True)])
def test_a_calibration_run_under_cfg2_is_refused_before_anything_moves(cache: fastdit.MagCache) -> None:
    # A CFG rank records one branch only: MagCache's branches would disagree in length, and TeaCache would fit a
    # different polynomial on each rank.
    pipe, _ = build_tiny("qwenimage", "qwen-image")
    with pytest.raises(
        ArgumentError, match=r"calibrate=True with parallel=Parallel\(.*cfg=2.*one guidance branch"
    ) as info:
        fastdit.accelerate(pipe, cache=cache, parallel=fastdit.Parallel(cfg=2))
    assert (info.value.field, info.value.value) == ("cache", cache)
    assert fastdit.api.context_of(pipe) is None


@pytest.mark.parametrize(("family", "variant"), [("qwenimage", "qwen-image"), ("sd3", "sd3")])
def test_cfg2_with_compiled_blocks_and_cache(dist2: WorkerPool, family: str, variant: str) -> None:
    _check(dist2, family, variant, [RungSpec("cfg2-cache-compiled", {"cfg": 2}, cache_bn=0, compile=True)])


# --- under the other step caches: TeaCache, and DBCache and MagCache forecasting ---

# Sequential announced, sequential unannounced (paired by timestep: its branches are named differently on one
# process), batched, and a video family.
OTHER_CACHES = [("qwenimage", "qwen-image"), ("chroma", "chroma"), ("sd3", "sd3"), ("wan", "t2v")]
OTHER_CACHE_ROWS = (
    ["teacache"]
    + [f"{p}-{m}" for m in ("foca", "hermite", "foca-timestep") for p in ("dbcache", "magcache")]
    + ["dbcache-ahead"]
)


def _other_caches(
    pool: WorkerPool, family: str, variant: str, compile: bool = False, timestep: bool = False
) -> list[dict]:
    prefix = "cfg2-compiled" if compile else "cfg2"
    return pool.run(run_cache_combinations, family, variant, prefix, {"cfg": 2}, compile, timestep, timeout=300)


def _assert_split_and_cached(reports: list[dict]) -> list[dict]:
    rows = _passed_and_split(reports)
    # Each rank served steps of its own branch (the ladder compared them with that branch on one process).
    for report in reports:
        for row in report["rows"][1:]:
            assert row["cached_steps"] > 0, f"{row['name']}: no step was served from the cache"
    return rows


@pytest.mark.parametrize(("family", "variant"), OTHER_CACHES)
def test_cfg2_under_teacache_and_forecasts_matches_one_process(dist2: WorkerPool, family: str, variant: str) -> None:
    # Their schedules are spaced evenly enough to forecast over the timestep too, as the fast presets do.
    rows = _assert_split_and_cached(_other_caches(dist2, family, variant, timestep=True))
    assert [row["name"] for row in rows[1:]] == [f"cfg2-{name}" for name in OTHER_CACHE_ROWS]


OTHER_CASES = [(f, v) for f, v in CASES if (f, v) not in OTHER_CACHES and get_family(f).tiny_pipelines[0].name == v]


@pytest.mark.slow
@pytest.mark.parametrize(("family", "variant"), OTHER_CASES, ids=[f"{f}-{v}" for f, v in OTHER_CASES])
def test_cfg2_under_teacache_and_forecasts_on_every_family(dist2: WorkerPool, family: str, variant: str) -> None:
    reports = _other_caches(dist2, family, variant)
    if all(row["status"] == Status.NOT_AVAILABLE for report in reports for row in report["rows"][1:]):
        # No unconditional branch in this call: refused on every rank, as without a cache.
        assert all("cfg=2" in row["reason"] for row in reports[0]["rows"][1:]), reports[0]["rows"]
        return
    _assert_split_and_cached(reports)


@pytest.mark.parametrize(("family", "variant"), [("qwenimage", "qwen-image"), ("sd3", "sd3")])
def test_cfg2_with_compiled_blocks_under_teacache_and_forecasts(dist2: WorkerPool, family: str, variant: str) -> None:
    _assert_split_and_cached(_other_caches(dist2, family, variant, compile=True))
