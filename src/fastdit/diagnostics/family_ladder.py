"""The family capability matrices as rungs of the verify ladder: one implementation for ``fastdit verify`` and tests.

The context-, tensor- and CFG-parallel matrices run every registered tiny pipeline through
:func:`fastdit.diagnostics.verify.verify_ladder` on gloo ranks, with rungs described as plain data
(:class:`RungSpec`, which pickles to worker processes) and judged at :data:`EXACT`: on CPU in float32 a parallel
layout only reorders float sums, so every output value must stay within ``1e-4`` of the one-process run (> 80 dB on
[0, 1] outputs), not just above the 35 dB a GPU in bf16 is held to.

A rung that adds parallelism to a step cache is judged against the same cache on one process (same outputs, same
steps served from the cache): a cache approximates, parallelism must not change what it decides.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastdit.config import Compile, DBCache, Offload, Parallel, StepMask
from fastdit.diagnostics.verify import Rung, Status, Thresholds, VerifyRuntime, fixed_rung, verify_ladder
from fastdit.models.registry import get_family
from fastdit.testing.pipelines import build_tiny, scaled_steps

__all__ = [
    "EXACT",
    "FORCED_CACHE_FN",
    "RungSpec",
    "assert_rows",
    "cached_call_overrides",
    "forced_cache",
    "run_family_ladder",
]

EXACT = Thresholds(max_abs=1e-4)
"""Float32 on CPU: parallelism reorders sums only."""

FORCED_CACHE_FN = 1
"""Front blocks of the forced cache (:func:`forced_cache`)."""

# Tiny pipelines whose step count is not a plain ``num_inference_steps``: SANA-Sprint's SCM schedule takes exactly 2
# steps unless its intermediate timestep is dropped.
_SCHEDULE_OVERRIDES: dict[tuple[str, str], dict[str, Any]] = {("sana", "sprint"): {"intermediate_timesteps": None}}


def forced_cache(bn: int) -> DBCache:
    """A step cache that computes step 0 and serves every later step, the same on every rank.

    Random weights never look converged to a threshold, so a static mask forces the cache's path. With ``bn=0`` the
    last block is a middle block (measured on computed steps, skipped on cached ones), so a plan that gathers at the
    last block meets the cache there; with ``bn=1`` the last block always runs.
    """
    mask = StepMask(compute_steps=(0,), policy="static")
    return DBCache(fn=FORCED_CACHE_FN, bn=bn, warmup_steps=0, step_mask=mask)


def cached_call_overrides(family: str, variant: str) -> dict[str, Any]:
    """Call arguments giving each transformer 3 denoising steps: step 0 computed, steps 1-2 from a forced cache.

    A tiny run denoises 2 steps per transformer; it asks for 4 where img2img strength 0.5 or a Wan 2.2 expert
    boundary halves them. 3/2 of the declared count gives 3 per transformer either way (per stage, for a pipeline
    that counts its steps per resolution stage: Helios' pyramid).
    """
    steps = scaled_steps(get_family(family).tiny(variant), 3, 2)
    return {**steps, **_SCHEDULE_OVERRIDES.get((family, variant), {})}


@dataclass(frozen=True)
class RungSpec:
    """One configuration of a matrix, as plain data.

    Attributes:
        name: Its row's name.
        parallel: :class:`~fastdit.Parallel` keyword arguments.
        cache_bn: Back blocks of a :func:`forced_cache` (``None``: no cache). The row is then judged against the
            same cache on one process.
        compile: Compile the blocks (eager backend: traces through the layouts at CPU-test cost).
        offload: Stream the blocks from host memory, keeping this many resident (``None``: no offload).
        check_disable: After this rung's ``disable`` the output must equal the baseline bit for bit.
    """

    name: str
    parallel: Mapping[str, Any] = field(default_factory=dict)
    cache_bn: int | None = None
    compile: bool = False
    offload: int | None = None
    check_disable: bool = False

    def rung(self) -> Rung:
        """The verify rung this spec describes."""
        cache = None if self.cache_bn is None else forced_cache(self.cache_bn)
        options: dict[str, Any] = {"parallel": Parallel(**self.parallel)}
        if cache is not None:
            options["cache"] = cache
        if self.compile:
            options["compile"] = Compile(backend="eager", fullgraph=False)
        if self.offload is not None:
            options["offload"] = Offload(resident_blocks=self.offload)
        reference = None if cache is None else {"cache": cache}
        return fixed_rung(self.name, options, reference=reference, check_disable=self.check_disable)


@functools.lru_cache(maxsize=4)
def _built(family: str, variant: str) -> tuple[Any, Any]:
    return build_tiny(family, variant)


def run_family_ladder(
    rank: int,
    world_size: int,
    family: str,
    variant: str,
    specs: Sequence[RungSpec],
    overrides: Mapping[str, Any] | None = None,
    check_disable: bool = False,
) -> dict[str, Any]:
    """Run ``specs`` on a family's tiny pipeline against its one-process baseline; the report as plain data.

    A worker-pool function (``pool.run(run_family_ladder, family, variant, specs)``): every rank builds the same
    pipeline and runs the same ladder. ``overrides`` change the call (steps, guidance) for the baseline and every
    rung alike; ``check_disable`` checks that each rung's ``disable`` gives the baseline back bit for bit.
    """
    pipe, tiny = _built(family, variant)
    runtime = VerifyRuntime(thresholds=EXACT, timeout_s=120, check_disable=check_disable, name=f"{family}/{variant}")
    report = verify_ladder(pipe, {**tiny.call_kwargs, **(overrides or {})}, [s.rung() for s in specs], runtime)
    return report.to_dict()


def assert_rows(reports: Sequence[Mapping[str, Any]], refused: Mapping[str, str] | None = None) -> list[dict]:
    """Check every rank's report: each row passes, except those ``refused`` maps to a reason fragment, which must
    be refused (``not available``) with that reason. Returns rank 0's rows.

    The ranks must agree row by row (a verdict that differs between ranks is a bug of its own).
    """
    refused = dict(refused or {})
    rows = reports[0]["rows"]
    for report in reports[1:]:
        assert [(r["name"], r["status"]) for r in report["rows"]] == [(r["name"], r["status"]) for r in rows]
    for report in reports:
        for row in report["rows"][1:]:
            name = row["name"]
            if name in refused:
                assert row["status"] == Status.NOT_AVAILABLE, row
                assert refused[name] in row["reason"], row
            else:
                assert row["status"] == Status.PASS, f"{name}: {row['status']}: {row['reason']}"
    return rows
