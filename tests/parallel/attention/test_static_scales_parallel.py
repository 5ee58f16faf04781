"""Static FP8 attention scales with tensor and CFG parallelism on gloo ranks, against one process.

Tensor parallelism gives each rank a share of every attention module's heads: each rank records the maxima of its
own heads, and the reduction over the group gives every rank the maxima of all of them. CFG parallelism gives each
rank one branch of every step; the reduction gives both ranks the maxima of both branches. Running with the scales,
each rank casts its heads (or its branch) with the whole module's scale, as one process does. The FP8 kernel is the
host stand-in (``fp8_host``), patched in inside the workers.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
import torch

import fastdit
from fastdit.testing.distributed import WorkerPool
from fastdit.testing.pipelines import build_tiny, run_tiny

pytest.importorskip("torchao")  # the calibration records the Linear layers' inputs through the quantize technique
pytestmark = pytest.mark.distributed


@functools.lru_cache(maxsize=2)
def _built(family: str) -> tuple[Any, Any]:
    return build_tiny(family)


def _static_attention(rank: int, world_size: int, family: str, layout: dict[str, int] | None) -> dict[str, Any]:
    """Record the scales under ``layout`` (``None``: one process), then run with static FP8 attention scales."""
    from fastdit.calibration import calibrate_scales
    from tests.parallel.attention.fp8_host import fp8_backend_in_process

    pipe, tiny = _built(family)
    torch.set_num_threads(1)
    parallel = None if layout is None else fastdit.Parallel(**layout)
    scales = calibrate_scales(pipe, lambda: run_tiny(pipe, tiny), parallel=parallel)
    with fp8_backend_in_process():
        attention = fastdit.Attention(backend="cudnn-fp8", scales=scales)
        fastdit.accelerate(pipe, attention=attention, parallel=parallel)
        try:
            out = run_tiny(pipe, tiny, output_type="latent")
            report = fastdit.summary(pipe).transformers["transformer"]
        finally:
            fastdit.disable(pipe)
    plain = run_tiny(pipe, tiny, output_type="latent")
    return {"scales": scales, "out": out, "plain": plain, "report": report}


def _attention_entries(scales: fastdit.ActivationScales) -> dict[str, tuple[float, int]]:
    return {name: entry for name, entry in scales.lookup().items() if ":" in name}


def _split_calls(report: dict[str, Any]) -> int:
    stats = report.get("cfg_parallel", {})
    return stats.get("skipped_calls", 0) + stats.get("batched_calls", 0)


# FLUX split by heads; Qwen-Image's branches are two calls per step (sequential CFG), LTX's one batch of both.
SPLIT = [("ltx", {"cfg": 2}), ("qwenimage", {"cfg": 2}), ("flux", {"tp": 2})]


@pytest.mark.parametrize(("family", "layout"), SPLIT, ids=["ltx-cfg2", "qwenimage-cfg2", "flux-tp2"])
def test_static_attention_scales_recorded_and_run_split_match_one_process(
    dist2: WorkerPool, family: str, layout: dict[str, int]
) -> None:
    one = _static_attention(0, 1, family, None)
    assert _attention_entries(one["scales"]), "one process recorded no attention inputs"
    sites = one["report"]["attention"]["static_scale_sites"]
    assert sites > 0 and one["report"]["attention"]["dynamic_scale_sites"] == 0
    noise = np.abs(one["out"] - one["plain"]).max()  # what FP8 attention changes
    assert noise > 0
    results = dist2.run(_static_attention, family, layout, timeout=240)
    for result in results:
        # Every Linear's and every attention input's maximum of one process (the heads' or branches' reduced).
        scales, expected = result["scales"].lookup(), one["scales"].lookup()
        assert scales.keys() == expected.keys()
        for name, (amax, ndim) in scales.items():
            assert ndim == expected[name][1], name
            np.testing.assert_allclose(amax, expected[name][0], rtol=1e-5, err_msg=name)
        report = result["report"]
        attention = report["attention"]
        assert attention["backend"] == "cudnn-fp8" and attention["served_calls"] > 0
        assert attention["static_scale_sites"] == sites and attention["dynamic_scale_sites"] == 0
        if "cfg" in layout:
            assert _split_calls(report) > 0, f"nothing was split over the CFG ranks: {report}"
        # The same e4m3 values per head and branch; only the split matmuls' rounding differs.
        error = np.abs(result["out"] - one["out"]).max()
        assert error < noise / 10, (error, noise)
    assert results[0]["scales"] == results[1]["scales"], "the ranks hold different scales"


def _sd3_under_cfg2(rank: int, world_size: int) -> dict[str, Any]:
    from fastdit.calibration import calibrate_scales
    from tests.parallel.attention.fp8_host import fp8_backend_in_process

    pipe, tiny = _built("sd3")
    torch.set_num_threads(1)
    parallel = None if world_size == 1 else fastdit.Parallel(cfg=2)
    scales = calibrate_scales(pipe, lambda: run_tiny(pipe, tiny), parallel=parallel)
    # Refused by SD3's routing, before the scales are read (they hold no attention entries to read).
    with fp8_backend_in_process():
        try:
            fastdit.accelerate(pipe, attention=fastdit.Attention(backend="cudnn-fp8", scales=scales), parallel=parallel)
        except ValueError as error:
            refusal = str(error)
        else:
            fastdit.disable(pipe)
            refusal = None
    return {"scales": scales, "refusal": refusal, "accelerated": fastdit.api.context_of(pipe) is not None}


def test_sd3_under_cfg2_records_no_attention_scales_and_refuses_static_ones(dist2: WorkerPool) -> None:
    """SD3's attention is not routed through diffusers' dispatch: its calibration records the Linear layers only
    (under CFG parallelism both branches' maxima, as one process), and static attention scales are refused on every
    rank before anything is applied."""
    one = _sd3_under_cfg2(0, 1)
    assert one["scales"].layers and not _attention_entries(one["scales"])
    assert "not routed through diffusers' dispatch" in one["refusal"] and not one["accelerated"]
    for result in dist2.run(_sd3_under_cfg2, timeout=240):
        assert result["scales"].layers == one["scales"].layers
        np.testing.assert_allclose(result["scales"].amax, one["scales"].amax, rtol=1e-5)
        assert "not routed through diffusers' dispatch" in result["refusal"] and not result["accelerated"]
