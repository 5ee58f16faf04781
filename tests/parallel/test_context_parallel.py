"""Context parallelism end to end: whole pipelines on gloo ranks equal the single-process run, with and without cache.

Every rank runs the whole pipeline with the same seed (text encoders and VAE replicated, the transformer's sequence
split); the images must match the single-process images computed here in the parent.
"""

from __future__ import annotations

import functools
import logging
import random
from typing import Any

import numpy as np
import pytest
import torch

import fastdit
from fastdit.testing.distributed import DistributedTestError, WorkerPool
from fastdit.testing.pipelines import build_tiny

TINY_CALL = {"prompt": "a cat holding a sign", "num_inference_steps": 4, "max_sequence_length": 16}


@functools.lru_cache(maxsize=1)
def _tiny_pipeline() -> Any:
    from fastdit.models.flux import tiny_flux

    pipe = tiny_flux(0)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@functools.lru_cache(maxsize=1)
def _reference_pipeline() -> Any:
    from fastdit.reference import load_reference_pipeline

    return load_reference_pipeline()


def _has_reference() -> bool:
    from fastdit.reference import reference_dir

    try:
        reference_dir()
    except FileNotFoundError:
        return False
    return True


needs_reference = pytest.mark.skipif(not _has_reference(), reason="reference weights are not in this checkout")


def _call(pipe: Any, kwargs: dict[str, Any], seed: int = 0) -> np.ndarray:
    return pipe(**kwargs, generator=torch.Generator().manual_seed(seed), output_type="np").images


def _reference_kwargs(digit: int, true_cfg: bool) -> dict[str, Any]:
    from fastdit.reference import REFERENCE_DEFAULTS, REFERENCE_TRUE_CFG, digit_prompt

    return {"prompt": digit_prompt(digit), **REFERENCE_DEFAULTS, **(REFERENCE_TRUE_CFG if true_cfg else {})}


def _cached_steps(pipe: Any) -> dict[str, list[int]]:
    stats = fastdit.summary(pipe).transformers["transformer"].get("cache", {})
    return {name: branch["cached_steps"] for name, branch in stats.get("branches", {}).items()}


def _accelerated(pipe: Any, kwargs: dict[str, Any], **options: Any) -> tuple[np.ndarray, dict[str, list[int]]]:
    fastdit.accelerate(pipe, **options)
    try:
        return _call(pipe, kwargs), _cached_steps(pipe)
    finally:
        fastdit.disable(pipe)


# --- worker functions ---


def _tiny(rank: int, world_size: int, parallel: dict[str, int], size: int, attention: str | None = None) -> np.ndarray:
    options: dict[str, Any] = {"parallel": fastdit.Parallel(**parallel)}
    if attention is not None:
        options["attention"] = fastdit.Attention(backend=attention)
    return _accelerated(_tiny_pipeline(), {**TINY_CALL, "height": size, "width": size}, **options)[0]


def _reference(
    rank: int, world_size: int, parallel: dict[str, int] | None, cache: Any, digit: int, true_cfg: bool
) -> tuple[np.ndarray, dict[str, list[int]]]:
    options = {"parallel": fastdit.Parallel(**parallel) if parallel else None, "cache": cache}
    return _accelerated(_reference_pipeline(), _reference_kwargs(digit, true_cfg), **options)


def _disable_restores(rank: int, world_size: int) -> dict[str, Any]:
    import diffusers.models.transformers.transformer_flux as flux_module

    pipe = _tiny_pipeline()
    kwargs = {**TINY_CALL, "height": 32, "width": 32}
    original_fn = flux_module.dispatch_attention_fn
    before = _call(pipe, kwargs)
    fastdit.accelerate(pipe, parallel=fastdit.Parallel(ulysses=world_size))
    routed = flux_module.dispatch_attention_fn is not original_fn
    fastdit.disable(pipe)
    after = _call(pipe, kwargs)
    modules = list(pipe.transformer.modules())
    return {
        "identical": np.array_equal(before, after),
        "routed_while_on": routed,
        "fn_restored": flux_module.dispatch_attention_fn is original_fn,
        "hooks_left": sum(len(m._diffusers_hook.hooks) for m in modules if hasattr(m, "_diffusers_hook")),
        "pre_hooks_left": sum(len(m._forward_pre_hooks) for m in modules),
        "marks_left": sum("_parallel_config" in vars(m.processor) for m in modules if hasattr(m, "processor")),
    }


def _uneven_log(rank: int, world_size: int) -> list[str]:
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("fastdit.parallel.context_parallel")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        pipe = _tiny_pipeline()
        fastdit.accelerate(pipe, parallel=fastdit.Parallel(ulysses=world_size))
        try:
            for _ in range(2):  # the second run must not log again
                _call(pipe, {**TINY_CALL, "height": 40, "width": 40, "num_inference_steps": 1})
        finally:
            fastdit.disable(pipe)
    finally:
        log.removeHandler(handler)
    return records


def _bare_transformer(rank: int, world_size: int) -> torch.Tensor:
    from fastdit.models.flux import tiny_transformer

    transformer = tiny_transformer(0)
    fastdit.accelerate(transformer, parallel=fastdit.Parallel(ulysses=world_size))
    try:
        with torch.no_grad():
            return transformer(**_transformer_inputs()).sample
    finally:
        fastdit.disable(transformer)


def _transformer_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "hidden_states": torch.randn(2, 21, 16, generator=g),  # odd lengths: uneven over 2 ranks
        "encoder_hidden_states": torch.randn(2, 5, 32, generator=g),
        "pooled_projections": torch.randn(2, 32, generator=g),
        "timestep": torch.tensor([0.7, 0.7]),
        "img_ids": torch.randn(21, 3, generator=g),
        "txt_ids": torch.zeros(5, 3),
    }


def _uneven_exchanges(rank: int, world_size: int, graphed: bool) -> dict[str, Any]:
    """Length exchanges per forward of an uneven split, and whether every forward gave the first one's output."""
    from unittest import mock

    from fastdit.cuda_graph import apply_cuda_graph
    from fastdit.models.flux import tiny_transformer
    from fastdit.parallel import context_parallel
    from fastdit.parallel.attention import comm, dispatch
    from fastdit.testing.graphs import RecordingGraph

    transformer = tiny_transformer(0)
    fastdit.accelerate(transformer, parallel=fastdit.Parallel(ulysses=world_size))
    if graphed:  # a graph stand-in that runs on CPU: warm-up call, capture, replay
        undo_graph = apply_cuda_graph(transformer, fastdit.CudaGraph(warmup=1), new_graph=RecordingGraph)
    counted = mock.Mock(side_effect=comm.gather_lengths)
    counts, outputs = [], []
    try:
        with (
            mock.patch.object(dispatch, "gather_lengths", counted),
            mock.patch.object(context_parallel, "gather_lengths", counted),
            torch.no_grad(),
        ):
            for _ in range(3):
                outputs.append(transformer(**_transformer_inputs()).sample)
                counts.append(counted.call_count - sum(counts))
    finally:
        if graphed:
            undo_graph()
        fastdit.disable(transformer)
    return {"counts": counts, "same": all(torch.equal(outputs[0], out) for out in outputs[1:])}


def _flux_inputs(tokens: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(tokens)
    return {
        "hidden_states": torch.randn(1, tokens, 16, generator=g),
        "encoder_hidden_states": torch.randn(1, 4, 32, generator=g),
        "pooled_projections": torch.randn(1, 32, generator=g),
        "timestep": torch.tensor([0.5]),
        "img_ids": torch.randn(tokens, 3, generator=g),
        "txt_ids": torch.zeros(4, 3),
    }


def _block_graphs_uneven(rank: int, world_size: int) -> dict[str, Any]:
    """Block graphs over 9 and 10 image tokens in turn: rank 0 holds 5 of either, rank 1 holds 4 or 5."""
    from fastdit.components import walk
    from fastdit.context import context_of
    from fastdit.cuda_graph import apply_cuda_graph
    from fastdit.models.flux import tiny_transformer
    from fastdit.testing.graphs import RecordingGraph

    transformer = tiny_transformer(0)
    fastdit.accelerate(transformer, parallel=fastdit.Parallel(ulysses=world_size))
    config = fastdit.CudaGraph(scope="blocks", warmup=1)
    key = context_of(transformer).state("context_parallel", "transformer").signature
    blocks = walk(transformer).denoisers[0].blocks()
    undo = apply_cuda_graph(transformer, config, blocks=blocks, context_key=key, new_graph=RecordingGraph)
    outputs = []
    try:
        with torch.no_grad():
            for tokens in (9, 10, 9, 10, 9):
                outputs.append(transformer(**_flux_inputs(tokens)).sample)
        stats = undo.state.stats()
    finally:
        undo()
        fastdit.disable(transformer)
    return {"stats": stats, "outputs": outputs}


def _fp8_tiny(rank: int, world_size: int, chunks: int) -> np.ndarray:
    parallel = fastdit.Parallel(ulysses=world_size, comm_fp8=True, ulysses_chunks=chunks)
    return _accelerated(_tiny_pipeline(), {**TINY_CALL, "height": 32, "width": 32}, parallel=parallel)[0]


@functools.lru_cache(maxsize=1)
def _tiny_qwen() -> Any:
    from fastdit.models.qwenimage import ADAPTER

    pipe = ADAPTER.tiny("qwen-image").build()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _qwen_call(size: int) -> dict[str, Any]:
    from fastdit.models.qwenimage import ADAPTER

    return {**ADAPTER.tiny("qwen-image").call_kwargs, "num_inference_steps": 3, "height": size, "width": size}


def _qwen_pipeline(rank: int, world_size: int, parallel: dict[str, int] | None, size: int) -> np.ndarray:
    pipe, kwargs = _tiny_qwen(), _qwen_call(size)
    if parallel is None:
        return _call(pipe, kwargs)
    return _accelerated(pipe, kwargs, parallel=fastdit.Parallel(**parallel))[0]


def _qwen_inputs() -> dict[str, Any]:
    """Two samples, 7 text tokens (the second with 3 padding tokens), a 6 x 4 grid of image tokens."""
    g = torch.Generator().manual_seed(11)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, 4:] = False
    return {
        "hidden_states": torch.randn(2, 24, 16, generator=g),
        "encoder_hidden_states": torch.randn(2, 7, 32, generator=g),
        "encoder_hidden_states_mask": mask,
        "timestep": torch.tensor([0.6, 0.6]),
        "img_shapes": [[(1, 6, 4)], [(1, 6, 4)]],
    }


def _qwen_masked(rank: int, world_size: int, parallel: dict[str, int] | None) -> torch.Tensor:
    from fastdit.models.qwenimage import tiny_transformer

    transformer = tiny_transformer(0)
    if parallel is not None:
        fastdit.accelerate(transformer, parallel=fastdit.Parallel(**parallel))
    try:
        with torch.no_grad():
            return transformer(**_qwen_inputs()).sample
    finally:
        if parallel is not None:
            fastdit.disable(transformer)


@functools.lru_cache(maxsize=4)
def _tiny_wan(name: str) -> Any:
    from fastdit.models.wan import ADAPTER

    pipe = ADAPTER.tiny(name).build()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _wan(
    rank: int, world_size: int, name: str, parallel: dict[str, int] | None, cache: Any = None, **overrides: Any
) -> tuple[np.ndarray, dict[str, list[int]]]:
    from fastdit.models.wan import ADAPTER

    pipe = _tiny_wan(name)
    kwargs = {**ADAPTER.tiny(name).call_kwargs, **overrides}
    options = {"parallel": fastdit.Parallel(**parallel) if parallel else None, "cache": cache}
    if parallel is None and cache is None:
        return np.asarray(pipe(**kwargs, generator=torch.Generator().manual_seed(0), output_type="np").frames), {}
    fastdit.accelerate(pipe, **options)
    try:
        frames = pipe(**kwargs, generator=torch.Generator().manual_seed(0), output_type="np").frames
        return np.asarray(frames), _cached_steps(pipe)
    finally:
        fastdit.disable(pipe)


# --- tiny FluxPipeline ---


def _single_tiny(size: int) -> np.ndarray:
    return _call(_tiny_pipeline(), {**TINY_CALL, "height": size, "width": size})


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("parallel", "size"),
    [
        ({"ulysses": 2}, 32),
        ({"ring": 2}, 32),
        ({"ulysses": 3}, 40),  # 100 image + 16 text tokens over 3 ranks; 2 heads padded to 3
        ({"ring": 3}, 40),
        ({"ulysses": 2, "ring": 2}, 32),  # USP on a 2 x 2 grid
    ],
    ids=["ulysses2", "ring2", "ulysses3-uneven", "ring3-uneven", "usp2x2"],
)
def test_tiny_flux_matches_single_process(
    dist2: WorkerPool, dist3: WorkerPool, dist4: WorkerPool, parallel: dict[str, int], size: int
) -> None:
    expected = _single_tiny(size)
    pool = {2: dist2, 3: dist3, 4: dist4}[fastdit.Parallel(**parallel).world_size]
    for images in pool.run(_tiny, parallel, size, timeout=120):
        assert images.shape == expected.shape
        assert np.abs(images - expected).max() < 1e-5


@pytest.mark.distributed
def test_local_backend_under_context_parallel(dist2: WorkerPool) -> None:
    expected = _single_tiny(32)
    for images in dist2.run(_tiny, {"ulysses": 2}, 32, "math", timeout=120):
        assert np.abs(images - expected).max() < 1e-5


@pytest.mark.distributed
@pytest.mark.parametrize("chunks", [1, 2])
def test_fp8_all_to_all_is_close(dist2: WorkerPool, chunks: int) -> None:
    """``Parallel(comm_fp8=True)`` (alone and with head chunks) is lossy but close to one process."""
    from fastdit.metrics import psnr

    expected = _single_tiny(32)
    for images in dist2.run(_fp8_tiny, chunks, timeout=120):
        assert 30 < psnr(expected, images) < float("inf")


@pytest.mark.distributed
def test_bare_transformer_with_uneven_sequence(dist2: WorkerPool) -> None:
    from fastdit.models.flux import tiny_transformer

    with torch.no_grad():
        expected = tiny_transformer(0)(**_transformer_inputs()).sample
    for out in dist2.run(_bare_transformer, timeout=120):
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.distributed
@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graph"])
def test_uneven_shard_lengths_exchanged_once_per_graph_signature(dist2: WorkerPool, graphed: bool) -> None:
    for result in dist2.run(_uneven_exchanges, graphed, timeout=120):
        first, *later = result["counts"]
        assert first > 0, result["counts"]  # one per attention call and gather
        # Served by graphs, the warm-up call exchanges and the capture and replays recall; otherwise every call asks.
        assert later == ([0, 0] if graphed else [first, first]), result["counts"]
        assert result["same"]


@pytest.mark.distributed
def test_block_graphs_capture_at_the_same_calls_on_every_rank(dist2: WorkerPool) -> None:
    """Keyed on local shards alone, rank 0 would capture a block one call before rank 1 (collectives out of step:
    with the CPU stand-in, whose capture runs the call, that rank would run its collectives twice and hang)."""
    from fastdit.models.flux import tiny_transformer

    with torch.no_grad():
        expected = [tiny_transformer(0)(**_flux_inputs(n)).sample for n in (9, 10, 9, 10, 9)]
    results = dist2.run(_block_graphs_uneven, timeout=120)
    assert results[0]["stats"] == results[1]["stats"]
    for result in results:
        for out, want in zip(result["outputs"], expected, strict=True):
            torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.distributed
def test_disable_restores_everything(dist2: WorkerPool) -> None:
    for result in dist2.run(_disable_restores, timeout=120):
        assert result == {
            "identical": True,
            "routed_while_on": True,
            "fn_restored": True,
            "hooks_left": 0,
            "pre_hooks_left": 0,
            "marks_left": 0,
        }


@pytest.mark.distributed
def test_uneven_split_logs_once_on_the_main_rank(dist3: WorkerPool) -> None:
    records = dist3.run(_uneven_log, timeout=120)
    assert records[1] == records[2] == []
    # 16 text tokens -> [6, 5, 5]; 100 image tokens (and their ids) -> [34, 33, 33]; logged once per tensor.
    assert len(records[0]) == 4
    assert all("split unevenly over 3 ranks" in line for line in records[0])
    assert any("hidden_states has 100 tokens along dim 1" in line and "[34, 33, 33]" in line for line in records[0])


# --- Qwen-Image: split at the first block, RoPE tables split, the text padding mask gathered in attention ---


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("parallel", "size"), [({"ulysses": 2}, 32), ({"ulysses": 3}, 48), ({"ring": 3}, 48)], ids=["u2", "u3", "r3"]
)
def test_tiny_qwen_image_matches_single_process(
    dist2: WorkerPool, dist3: WorkerPool, parallel: dict[str, int], size: int
) -> None:
    expected = _qwen_pipeline(0, 1, None, size)
    pool = dist2 if fastdit.Parallel(**parallel).world_size == 2 else dist3
    for images in pool.run(_qwen_pipeline, parallel, size, timeout=180):
        assert np.abs(images - expected).max() < 1e-5


@pytest.mark.distributed
@pytest.mark.parametrize("parallel", [{"ulysses": 2}, {"ulysses": 3}, {"ring": 2}], ids=["u2", "u3", "r2"])
def test_qwen_text_padding_mask(dist2: WorkerPool, dist3: WorkerPool, parallel: dict[str, int]) -> None:
    expected = _qwen_masked(0, 1, None)
    pool = dist2 if fastdit.Parallel(**parallel).world_size == 2 else dist3
    for out in pool.run(_qwen_masked, parallel, timeout=180):
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


# --- Wan: split at blocks.0 (positional call), RoPE tables split, text replicated ---


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("name", "parallel", "overrides"),
    [
        ("t2v", {"ulysses": 2}, {}),
        ("t2v", {"ring": 3}, {"height": 48}),  # 2 latent frames x 6 x 4 tokens over 3 ranks
        ("i2v", {"ulysses": 3}, {}),  # 2.1 I2V: CLIP image tokens in the (replicated) cross-attention
        ("wan2.2-t2v", {"ulysses": 2}, {}),  # two experts, both routed
        ("wan2.2-ti2v", {"ulysses": 2}, {}),  # per-token timestep split at the root
    ],
    ids=["t2v-u2", "t2v-r3", "i2v-u3", "a14b-u2", "ti2v-u2"],
)
def test_tiny_wan_matches_single_process(
    dist2: WorkerPool, dist3: WorkerPool, name: str, parallel: dict[str, int], overrides: dict[str, Any]
) -> None:
    expected, _ = _wan(0, 1, name, None, **overrides)
    pool = dist2 if fastdit.Parallel(**parallel).world_size == 2 else dist3
    for frames, _ in pool.run(_wan, name, parallel, timeout=180, **overrides):
        assert np.abs(frames - expected).max() < 1e-5


@pytest.mark.distributed
def test_wan_cache_sees_split_tokens_at_blocks_0(dist2: WorkerPool) -> None:
    """The split at blocks.0 runs before the cache's block hook, so the cached residual is the rank's own shard."""
    mask = fastdit.StepMask(compute_steps=(0,), policy="static")  # random weights: force cached steps
    cache = fastdit.DBCache(fn=1, bn=0, threshold=0.1, warmup_steps=0, step_mask=mask)
    expected, expected_steps = _wan(0, 1, "t2v", None, cache, num_inference_steps=4)
    assert expected_steps == {"cond": [1, 2, 3], "uncond": [1, 2, 3]}
    for frames, steps in dist2.run(_wan, "t2v", {"ulysses": 2}, cache, num_inference_steps=4, timeout=180):
        assert steps == expected_steps
        assert np.abs(frames - expected).max() < 1e-5


@pytest.mark.distributed
def test_fewer_tokens_than_ranks_is_refused(dist3: WorkerPool) -> None:
    with pytest.raises(DistributedTestError) as info:
        dist3.run(_wan, "wan2.2-ti2v", {"ulysses": 3}, timeout=180)  # 2 tokens per frame pair
    assert "fastdit.errors.ShardError" in set(info.value.exc_types.values())


def _mochi_usp(rank: int, world_size: int) -> str:
    pipe, _ = build_tiny("mochi")
    try:
        fastdit.accelerate(pipe, parallel=fastdit.Parallel(ulysses=2, ring=2))
    except ValueError as error:
        return str(error)
    fastdit.disable(pipe)
    return "accepted"


@pytest.mark.distributed
def test_data_dependent_lengths_refuse_usp_on_every_rank(dist4: WorkerPool) -> None:
    for message in dist4.run(_mochi_usp, timeout=180):
        assert "exchange_lengths" in message and "USP" in message, message


# --- validation in a single process ---


def test_family_without_plan_is_refused_before_anything() -> None:
    from dataclasses import replace

    from fastdit.models.flux import ADAPTER, tiny_transformer

    transformer = tiny_transformer(0)
    with pytest.raises(ValueError, match="no context-parallel plan"):
        fastdit.accelerate(transformer, parallel=fastdit.Parallel(ulysses=2), adapter=replace(ADAPTER, cp_plan=None))
    assert not hasattr(transformer, "_diffusers_hook") or not transformer._diffusers_hook.hooks


def test_world_size_mismatch_leaves_the_model_alone() -> None:
    pipe = _tiny_pipeline()
    with pytest.raises(ValueError, match="needs 2 processes, got 1"):
        fastdit.accelerate(pipe, parallel=fastdit.Parallel(ulysses=2))
    fastdit.accelerate(pipe)  # not marked as accelerated by the failed call
    fastdit.disable(pipe)


def test_vae_parallelism_on_one_process_is_refused() -> None:
    with pytest.raises(ValueError, match=r"vae=True splits the VAE's decode over the ranks of the job"):
        fastdit.accelerate(_tiny_pipeline(), parallel=fastdit.Parallel(vae=True))


# --- the trained reference pipeline (28 steps) ---


@pytest.mark.slow
@pytest.mark.distributed
@needs_reference
@pytest.mark.parametrize("parallel", [{"ulysses": 2}, {"ring": 2}], ids=["ulysses2", "ring2"])
def test_reference_pipeline_28_steps(dist2: WorkerPool, parallel: dict[str, int]) -> None:
    from fastdit.metrics import psnr

    expected, _ = _reference(0, 1, None, None, 3, False)
    for images, _ in dist2.run(_reference, parallel, None, 3, False, timeout=180):
        assert psnr(expected, images) >= 60


def _cache_schedules(count: int) -> list[tuple[fastdit.DBCache, int, bool]]:
    """A few DBCache settings (threshold, warm-up, caps) drawn with a fixed seed, with a digit and a CFG mode."""
    rng = random.Random(20261130)
    out = []
    for _ in range(count):
        cache = fastdit.DBCache(
            fn=1,
            bn=rng.choice([0, 1]),
            threshold=round(rng.uniform(0.1, 0.4), 3),
            warmup_steps=rng.choice([0, 2, 4]),
            max_continuous_cached_steps=rng.choice([None, 2, 3]),
        )
        out.append((cache, rng.randrange(10), rng.random() < 0.5))
    return out


@pytest.mark.slow
@pytest.mark.distributed
@needs_reference
@pytest.mark.parametrize(("cache", "digit", "true_cfg"), _cache_schedules(3))
def test_cache_under_context_parallel_matches_single_process(
    dist2: WorkerPool, cache: fastdit.DBCache, digit: int, true_cfg: bool
) -> None:
    """Identical cached steps on every rank and as in one process; no hang; the same image."""
    from fastdit.metrics import psnr

    expected, expected_steps = _reference(0, 1, None, cache, digit, true_cfg)
    assert sum(len(steps) for steps in expected_steps.values()) > 0, "the schedule must cache some steps"
    for images, steps in dist2.run(_reference, {"ulysses": 2}, cache, digit, true_cfg, timeout=180):
        assert steps == expected_steps
        assert psnr(expected, images) >= 60


def _pruned_blocks(pipe: Any) -> dict[str, list[int]]:
    stats = fastdit.summary(pipe).transformers["transformer"]["cache"]["branches"]
    return {name: branch["pruned_blocks_per_step"] for name, branch in stats.items()}


def _reference_other(rank: int, world_size: int, parallel: dict[str, int] | None, config: Any) -> tuple[Any, Any]:
    """The reference pipeline under DBPrune or DBCache + TaylorSeer: images and per-step decisions."""
    pipe = _reference_pipeline()
    fastdit.accelerate(pipe, parallel=fastdit.Parallel(**parallel) if parallel else None, cache=config)
    try:
        images = _call(pipe, _reference_kwargs(4, False))
        decisions = _pruned_blocks(pipe) if isinstance(config, fastdit.DBPrune) else _cached_steps(pipe)
        return images, decisions
    finally:
        fastdit.disable(pipe)


@pytest.mark.slow
@pytest.mark.distributed
@needs_reference
@pytest.mark.parametrize(
    "config",
    [
        fastdit.DBPrune(fn=1, bn=0, threshold=0.3, warmup_steps=2),
        fastdit.DBCache(fn=1, bn=0, threshold=0.3, warmup_steps=2, taylorseer=fastdit.TaylorSeer(order=2)),
        fastdit.DBCache(
            fn=1, bn=0, threshold=0.3, warmup_steps=2, taylorseer=fastdit.TaylorSeer(order=2, method="foca")
        ),
        fastdit.DBCache(
            fn=1, bn=0, threshold=0.3, warmup_steps=2, taylorseer=fastdit.TaylorSeer(order=2, method="hermite")
        ),
    ],
    ids=["dbprune", "taylorseer", "foca", "hermite"],
)
def test_prune_and_taylorseer_under_context_parallel(dist2: WorkerPool, config: Any) -> None:
    from fastdit.metrics import psnr

    expected, expected_decisions = _reference_other(0, 1, None, config)
    assert any(any(steps) for steps in expected_decisions.values()), "the config must skip some work"
    for images, decisions in dist2.run(_reference_other, {"ulysses": 2}, config, timeout=180):
        assert decisions == expected_decisions
        assert psnr(expected, images) >= 60


def _compiled(rank: int, world_size: int) -> tuple[np.ndarray, int]:
    """Images of compiled blocks under Ulysses, and how many compiled entries dynamo made for the exchange code."""
    from fastdit.parallel.attention import comm, ulysses

    torch._dynamo.reset()
    pipe = _tiny_pipeline()
    kwargs = {**TINY_CALL, "height": 32, "width": 32}
    images = _accelerated(pipe, kwargs, parallel=fastdit.Parallel(ulysses=2), compile=fastdit.Compile(backend="eager"))[
        0
    ]
    entries = torch._C._dynamo.eval_frame._debug_get_cache_entry_list
    functions = (ulysses.ulysses_attention, comm.seq_to_head_async, comm.head_to_seq_async, comm._exchange)
    return images, sum(len(entries(f.__code__)) for f in functions)


@pytest.mark.distributed
def test_compiled_blocks_under_context_parallel(dist2: WorkerPool) -> None:
    """Dynamo compiles the blocks around the routed attention, never the exchanges inside it; results stay exact."""
    expected = _single_tiny(32)
    for images, compiled_exchange_entries in dist2.run(_compiled, timeout=180):
        assert np.abs(images - expected).max() < 1e-5
        assert compiled_exchange_entries == 0


def test_rank_failure_surfaces(dist2: WorkerPool) -> None:
    """A plan error raised on every rank reaches the caller instead of hanging a collective."""
    with pytest.raises(DistributedTestError) as info:
        dist2.run(_tiny, {"ulysses": 3}, 32)  # 3 ranks asked of a 2-rank pool
    assert set(info.value.exc_types.values()) == {"ValueError"}


# --- leading-token counts (LeadingCount) and gathering one element of a tuple output (GatherOutput.index) ---


class _CountingBlock(torch.nn.Module):
    """Takes a count through ``*args`` or by keyword, as HunyuanVideo's plain blocks do; returns (tokens, count)."""

    def forward(self, hidden_states: torch.Tensor, temb: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        self.seen = args[0] if args else kwargs.get("num_tokens")
        return hidden_states + 1, self.seen


class _CountingModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_CountingBlock() for _ in range(3)])

    def forward(self, hidden_states: torch.Tensor, n: int) -> torch.Tensor:
        hidden_states, _ = self.blocks[0](hidden_states, None, n)  # by position (*args)
        hidden_states, _ = self.blocks[1](hidden_states, None, num_tokens=n)  # by keyword
        hidden_states, count = self.blocks[2](hidden_states, None, None)  # not a count: passes unchanged
        assert count is None  # element 1 of the gathered block's output is left alone
        return hidden_states


def _leading_counts(
    rank: int, world_size: int, at_root: bool, n: int, trailing: bool = False
) -> tuple[torch.Tensor, list[Any]]:
    from fastdit.parallel.attention.dispatch import ForwardLayout
    from fastdit.parallel.context_parallel import _install_hooks, _Splitter
    from fastdit.parallel.plan import (
        AttentionRouting,
        ContextParallelPlan,
        GatherOutput,
        LeadingCount,
        SplitInput,
        TrailingCount,
    )

    tokens = SplitInput(dim=1, expected_dims=3)
    count = TrailingCount if trailing else LeadingCount
    if at_root:  # split and count at the root: the blocks receive the rank's count
        inputs = {"": {"n": count(of="hidden_states"), "hidden_states": tokens}}
    else:  # counts listed before the split they read: they must still run after it
        inputs = {
            "blocks.*": {"num_tokens": count(of="hidden_states", position=2)},
            "blocks.0": {"hidden_states": tokens},
        }
    plan = ContextParallelPlan(
        inputs=inputs,
        gather={"blocks.-1": GatherOutput(dim=1, expected_dims=3, index=0)},
        attention=AttentionRouting(modules=("diffusers.models.transformers.transformer_flux",)),
    )
    model = _CountingModel()
    undo = _install_hooks(model, plan, _Splitter(None, ForwardLayout(), log=False))
    try:
        out = model(torch.arange(7.0).reshape(1, 7, 1), n)
    finally:
        undo()
    return out, [block.seen for block in model.blocks]


@pytest.mark.distributed
@pytest.mark.parametrize("at_root", [False, True], ids=["blocks", "root"])
def test_leading_count_is_narrowed_per_rank(dist2: WorkerPool, dist3: WorkerPool, at_root: bool) -> None:
    full = torch.arange(7.0).reshape(1, 7, 1) + 3
    # 7 tokens: [4, 3] over 2 ranks, [3, 2, 2] over 3; rank r gets clamp(n - start_r, 0, len_r).
    for pool, n, counts in [(dist2, 4, [4, 0]), (dist2, 6, [4, 2]), (dist3, 4, [3, 1, 0]), (dist3, 9, [3, 2, 2])]:
        results = pool.run(_leading_counts, at_root, n)
        for rank, (out, seen) in enumerate(results):
            assert torch.equal(out, full)  # gathered at the last block (element 0 of its tuple output)
            assert seen == [counts[rank], counts[rank], None]


@pytest.mark.distributed
def test_trailing_count_is_narrowed_per_rank(dist2: WorkerPool, dist3: WorkerPool) -> None:
    full = torch.arange(7.0).reshape(1, 7, 1) + 3
    # 7 tokens: [4, 3] over 2 ranks, [3, 2, 2] over 3; rank r holds how many of the last n: clamp(end_r - (7 - n)).
    for pool, n, counts in [(dist2, 4, [1, 3]), (dist2, 6, [3, 3]), (dist3, 4, [0, 2, 2]), (dist3, 9, [3, 2, 2])]:
        results = pool.run(_leading_counts, False, n, True)
        for rank, (out, seen) in enumerate(results):
            assert torch.equal(out, full)
            assert seen == [counts[rank], counts[rank], None]


# --- a segment-wise split of one concatenated argument (SplitInput.segments), both elements gathered ---


class _TwoStreamBlock(torch.nn.Module):
    """Takes two streams and a table over their concatenation, as HiDream's double-stream blocks do."""

    def forward(self, image: torch.Tensor, text: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.seen = (image.shape[1], text.shape[1], torch.equal(table, torch.cat([image, text], dim=1)))
        return image * 2, text * 3


class _TwoStreamModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_TwoStreamBlock()])

    def forward(self, image: torch.Tensor, text: torch.Tensor, extra: int = 0) -> tuple[torch.Tensor, ...]:
        table = torch.cat([image, text, text[:, :extra]], dim=1)  # extra: a table that does not fit its segments
        return self.blocks[0](image, text, table=table)


def _segments(rank: int, world_size: int, extra: int) -> tuple[tuple[torch.Tensor, ...], tuple[Any, ...]]:
    from fastdit.parallel.attention.dispatch import ForwardLayout
    from fastdit.parallel.context_parallel import _install_hooks, _Splitter
    from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, SplitInput

    tokens = SplitInput(dim=1, expected_dims=3)
    plan = ContextParallelPlan(
        # The segment-wise split is listed before the splits it reads: it must still run after them.
        inputs={"blocks.*": {"table": SplitInput(1, 3, segments=("image", "text")), "image": tokens, "text": tokens}},
        gather={"blocks.*": GatherOutput(dim=1, expected_dims=3, index=(0, 1))},
        attention=AttentionRouting(modules=("diffusers.models.transformers.transformer_flux",)),
    )
    model = _TwoStreamModel()
    undo = _install_hooks(model, plan, _Splitter(None, ForwardLayout(), log=False))
    try:
        out = model(torch.arange(5.0).reshape(1, 5, 1), 100 + torch.arange(3.0).reshape(1, 3, 1), extra)
    finally:
        undo()
    return out, model.blocks[0].seen


@pytest.mark.distributed
def test_segment_split_follows_each_segment(dist2: WorkerPool, dist3: WorkerPool) -> None:
    image, text = torch.arange(5.0).reshape(1, 5, 1), 100 + torch.arange(3.0).reshape(1, 3, 1)
    # 5 image and 3 text tokens: [3, 2] and [2, 1] over 2 ranks, [2, 2, 1] and [1, 1, 1] over 3.
    for pool, lengths in [(dist2, [(3, 2), (2, 1)]), (dist3, [(2, 1), (2, 1), (1, 1)])]:
        for rank, ((out_image, out_text), seen) in enumerate(pool.run(_segments, 0)):
            assert torch.equal(out_image, image * 2) and torch.equal(out_text, text * 3)  # both elements gathered
            assert seen == (*lengths[rank], True)  # the table's pieces line up with [image_shard, text_shard]
        with pytest.raises(DistributedTestError) as info:  # a table longer than its segments: every rank refuses
            pool.run(_segments, 1)
        assert set(info.value.exc_types.values()) == {"ValueError"}
