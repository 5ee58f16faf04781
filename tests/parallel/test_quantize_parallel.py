"""Quantization with context and tensor parallelism on gloo ranks, against one quantized process.

Context parallelism splits the sequence: every token meets the same quantized weights, so 2 ranks equal 1 process.
Tensor parallelism quantizes each rank's slice of a split weight: column-split slices keep their rows' scales, a
row-split slice gets scales of its own half of each row, so the split run is close to (not equal to) one process.
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

pytest.importorskip("torchao")
pytestmark = pytest.mark.distributed

INT8 = fastdit.Quantize(mode="int8_weight")


@functools.lru_cache(maxsize=2)
def _built(family: str) -> tuple[Any, Any]:
    return build_tiny(family)


def _run(
    rank: int, world_size: int, family: str, layout: dict[str, int] | None, options: dict | None = None, **call: Any
) -> dict[str, Any]:
    pipe, tiny = _built(family)
    state = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    parallel = None if layout is None else fastdit.Parallel(**layout)
    fastdit.accelerate(pipe, quantize=INT8, parallel=parallel, **(options or {}))
    try:
        out = run_tiny(pipe, tiny, **call)
        report = fastdit.summary(pipe).transformers["transformer"]
    finally:
        fastdit.disable(pipe)
    restored = all(torch.equal(pipe.transformer.state_dict()[k], v) for k, v in state.items())
    return {"out": out, "report": report, "restored": restored}


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_context_parallel_equals_one_quantized_process(dist2: WorkerPool, family: str) -> None:
    expected = _run(0, 1, family, None)["out"]
    for result in dist2.run(_run, family, {"ulysses": 2}, timeout=240):
        np.testing.assert_allclose(result["out"], expected, atol=1e-5)
        assert result["report"]["quantize"]["num_quantized"] > 0 and result["restored"]


def test_tensor_parallel_quantizes_the_local_slices(dist2: WorkerPool) -> None:
    # Latents: the tiny VAE's decoded pixels hide differences of the size quantization makes.
    one = _run(0, 1, "flux", None, output_type="latent")
    pipe, tiny = _built("flux")
    plain = run_tiny(pipe, tiny, output_type="latent")
    noise = np.abs(one["out"] - plain).max()  # what quantizing changes
    for result in dist2.run(_run, "flux", {"tp": 2}, output_type="latent", timeout=240):
        report = result["report"]
        assert report["techniques"][:2] == ["tensor_parallel", "quantize"]
        quantized = report["quantize"]
        assert quantized["quantized"] == one["report"]["quantize"]["quantized"]
        # This rank's slices: half the bytes of one process's quantized weights (scales aside).
        assert quantized["bytes_before"] * 2 == one["report"]["quantize"]["bytes_before"]
        assert quantized["bytes_after"] < quantized["bytes_before"] / 1.8
        out = result["out"]
        # Quantized as much as one process (TP alone stays within 1e-4 of the plain model) and as close to it.
        assert 0.3 * noise < np.abs(out - plain).max() < 3 * noise, (np.abs(out - plain).max(), noise)
        assert np.abs(out - one["out"]).max() < noise
        assert result["restored"], "disable did not give back the original weights"


@pytest.mark.slow
def test_tensor_parallel_with_compiled_blocks_and_cache(dist2: WorkerPool) -> None:
    # Dynamo traces the local-slice forward of the split quantized layers; the eager backend keeps it CPU-time.
    options = {
        "compile": fastdit.Compile(backend="eager"),
        "cache": fastdit.DBCache(fn=1, threshold=10.0, warmup_steps=1),
    }
    eager = dist2.run(_run, "flux", {"tp": 2}, {"cache": options["cache"]}, output_type="latent", timeout=300)
    compiled = dist2.run(_run, "flux", {"tp": 2}, options, output_type="latent", timeout=300)
    for result, expected in zip(compiled, eager, strict=True):
        assert result["report"]["techniques"] == ["tensor_parallel", "quantize", "input_check", "cache", "compile"]
        assert result["report"]["cache"]["num_cached_steps"] > 0
        np.testing.assert_allclose(result["out"], expected["out"], atol=1e-5)


# --- static FP8: the scales recorded under parallelism, and quantizing with them ---


def _static(rank: int, world_size: int, family: str, layout: dict[str, int] | None) -> dict[str, Any]:
    from fastdit.calibration import calibrate_scales

    pipe, tiny = _built(family)
    torch.set_num_threads(1)
    parallel = None if layout is None else fastdit.Parallel(**layout)
    scales = calibrate_scales(pipe, lambda: run_tiny(pipe, tiny), parallel=parallel)
    fastdit.accelerate(pipe, quantize=fastdit.Quantize(mode="fp8_static", scales=scales), parallel=parallel)
    try:
        out = run_tiny(pipe, tiny, output_type="latent")
        report = fastdit.summary(pipe).transformers["transformer"]["quantize"]
    finally:
        fastdit.disable(pipe)
    return {"scales": scales, "out": out, "report": report}


@pytest.mark.parametrize("layout", [{"ulysses": 2}, {"ring": 2}, {"tp": 2}], ids=["ulysses", "ring", "tp"])
def test_static_scales_recorded_split_equal_one_process(dist2: WorkerPool, layout: dict[str, int]) -> None:
    # Each rank watches its part of every input (its tokens; under TP a row-split layer's half of the features);
    # the reduction over the group gives every rank the maxima of one process.
    one = _static(0, 1, "flux", None)
    pipe, tiny = _built("flux")
    plain = run_tiny(pipe, tiny, output_type="latent")
    noise = np.abs(one["out"] - plain).max()  # what quantizing changes
    results = dist2.run(_static, "flux", layout, timeout=240)
    # Context parallelism records no attention scales (its attention casts per call); one process records both.
    expected = {n: v for n, v in one["scales"].lookup().items() if "tp" in layout or ":" not in n}
    for result in results:
        scales = result["scales"]
        assert scales.lookup().keys() == expected.keys()
        for name, (amax, ndim) in scales.lookup().items():
            assert ndim == expected[name][1]
            np.testing.assert_allclose(amax, expected[name][0], rtol=1e-5, err_msg=name)
        assert result["report"]["quantized"] == one["report"]["quantized"]
        if "tp" in layout:  # each rank's slices quantized with the whole layer's scale: close to one process
            assert np.abs(result["out"] - one["out"]).max() < noise
        else:  # the same weights and scales for every token
            np.testing.assert_allclose(result["out"], one["out"], atol=1e-5)
    assert results[0]["scales"] == results[1]["scales"], "the ranks hold different scales"


def test_static_scales_recorded_under_cfg_parallel_cover_both_branches(dist2: WorkerPool) -> None:
    # Each rank runs one branch of every step (SD3 batches them: a batch of one per rank); the reduction gives both
    # ranks the maxima of both branches.
    one = _static(0, 1, "sd3", None)
    pipe, tiny = _built("sd3")
    noise = np.abs(one["out"] - run_tiny(pipe, tiny, output_type="latent")).max()  # what quantizing changes
    for result in dist2.run(_static, "sd3", {"cfg": 2}, timeout=240):
        assert result["scales"].layers == one["scales"].layers
        np.testing.assert_allclose(result["scales"].amax, one["scales"].amax, rtol=1e-5)
        # The same FP8 values; only the matmuls' accumulation order differs with the batch of one.
        assert np.abs(result["out"] - one["out"]).max() < min(2e-4, noise / 20)


# --- static FP8 with row-wise weight scales (bfloat16) ---


@functools.lru_cache(maxsize=2)
def _built_bf16(family: str) -> tuple[Any, Any]:
    pipe, tiny = build_tiny(family)
    return pipe.to(torch.bfloat16), tiny


def _rows(rank: int, world_size: int, family: str, layout: dict[str, int] | None) -> dict[str, Any]:
    from fastdit.calibration import calibrate_scales

    pipe, tiny = _built_bf16(family)
    torch.set_num_threads(1)
    plain = run_tiny(pipe, tiny, output_type="latent")
    parallel = None if layout is None else fastdit.Parallel(**layout)
    scales = calibrate_scales(pipe, lambda: run_tiny(pipe, tiny), parallel=parallel)
    config = fastdit.Quantize(mode="fp8_static", scales=scales, weight_scales="row")
    fastdit.accelerate(pipe, quantize=config, parallel=parallel)
    try:
        out = run_tiny(pipe, tiny, output_type="latent")
        report = fastdit.summary(pipe).transformers["transformer"]["quantize"]
    finally:
        fastdit.disable(pipe)
    restored = np.array_equal(run_tiny(pipe, tiny, output_type="latent"), plain)
    return {"out": out, "plain": plain, "report": report, "restored": restored}


@pytest.mark.parametrize(
    ("family", "layout"),
    [("flux", {"ulysses": 2}), ("flux", {"tp": 2}), ("sd3", {"cfg": 2})],
    ids=["ulysses", "tp", "cfg"],
)
def test_row_weight_scales_split_close_to_one_process(dist2: WorkerPool, family: str, layout: dict[str, int]) -> None:
    # Context and CFG parallelism: every token of every branch meets the same row-quantized weights. Tensor
    # parallelism: a column-split slice keeps its rows' scales; a row-split slice gets scales of its own half of
    # each row (close, not equal).
    one = _rows(0, 1, family, None)
    noise = np.abs(one["out"] - one["plain"]).mean()  # what quantizing changes (bfloat16: means, not maxima)
    assert noise > 0 and one["report"]["weight_scales"] == "row" and one["restored"]
    for result in dist2.run(_rows, family, layout, timeout=240):
        assert result["report"]["quantized"] == one["report"]["quantized"] and result["restored"]
        bound = noise if "tp" in layout else noise / 4
        assert np.abs(result["out"] - one["out"]).mean() < bound
