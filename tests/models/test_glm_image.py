"""GLM-Image: the family suite over text-to-image and image-to-image (the KV-cache write pass)."""

from __future__ import annotations

import pytest
import torch

import fastdit
from fastdit.testing.distributed import get_pool
from tests.models.family_suite import FamilySuite, pytest_generate_tests  # noqa: F401 - pytest hook


class TestGlmImage(FamilySuite):
    family = "glm_image"


def _calls() -> tuple[torch.nn.Module, list[tuple[str, dict]], object]:
    """The image-to-image calls of one step: the condition pass (empty text, KV cache written), then the
    conditional call (6 glyph tokens, cache read) and the unconditional one (1 glyph token, cache skipped)."""
    from diffusers.models.transformers.transformer_glm_image import GlmImageKVCache

    from fastdit.models.glm_image import tiny_transformer

    transformer = tiny_transformer(seed=0)
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 4, 16, 16, generator=g)  # 8 x 8 tokens
    ids = torch.randint(0, 16, (1, 64), generator=g)
    common = {"target_size": torch.tensor([[32.0, 32.0]]), "crop_coords": torch.zeros(1, 2), "return_dict": False}
    cache = GlmImageKVCache(num_layers=transformer.config.num_layers)
    write = {
        **common,
        "hidden_states": torch.randn(1, 4, 16, 16, generator=g),
        "encoder_hidden_states": torch.zeros(1, 0, 32),
        "prior_token_id": ids,
        "prior_token_drop": torch.zeros_like(ids, dtype=torch.bool),
        "timestep": torch.zeros(1),
    }
    step = {**common, "hidden_states": latents, "prior_token_id": ids, "timestep": torch.tensor([900.0])}
    cond = {
        **step,
        "encoder_hidden_states": torch.randn(1, 6, 32, generator=g),
        "prior_token_drop": write["prior_token_drop"],
    }
    uncond = {
        **step,
        "encoder_hidden_states": torch.randn(1, 1, 32, generator=g),
        "prior_token_drop": ~write["prior_token_drop"],
    }
    return transformer, [("write", write), ("read", cond), ("skip", uncond)], cache


def _run_calls(rank: int, world_size: int, parallel: dict | None) -> list[torch.Tensor]:
    transformer, calls, cache = _calls()
    if parallel is not None:
        fastdit.accelerate(transformer, parallel=fastdit.Parallel(**parallel))
    outputs = []
    try:
        with torch.no_grad():
            for mode, kwargs in calls:
                cache.set_mode(mode)
                outputs.append(transformer(**kwargs, kv_caches=cache)[0])
    finally:
        if parallel is not None:
            fastdit.disable(transformer)
    return outputs


@pytest.mark.distributed
@pytest.mark.parametrize("parallel", [{"ulysses": 2}, {"ring": 2}], ids=["ulysses2", "ring2"])
def test_kv_cache_and_short_glyph_text_under_context_parallelism_match_one_process(parallel: dict) -> None:
    """The condition pass's empty text and the negative prompt's one glyph token are split with empty shards; each
    rank's cached keys are its shard of the condition image's, and the read call matches one process."""
    expected = _run_calls(0, 1, None)
    for outputs in get_pool(2).run(_run_calls, parallel, timeout=120):
        for out, ref in zip(outputs, expected, strict=True):
            assert (out - ref).abs().max() < 1e-5, f"max abs error {(out - ref).abs().max():.2e}"


def _run_with_text_mask(rank: int, world_size: int) -> str:
    transformer, calls, _ = _calls()
    kwargs = {**calls[1][1], "attention_mask": torch.tensor([[1, 1, 1, 1, 0, 0]])}
    fastdit.accelerate(transformer, parallel=fastdit.Parallel(ulysses=2))
    try:
        with torch.no_grad(), pytest.raises(ValueError, match="attention_mask") as error:
            transformer(**kwargs)
        return str(error.value)
    finally:
        fastdit.disable(transformer)


@pytest.mark.distributed
def test_a_text_mask_under_context_parallelism_is_refused_on_every_rank() -> None:
    for message in get_pool(2).run(_run_with_text_mask, timeout=120):
        assert "not supported" in message


@pytest.mark.slow
@pytest.mark.distributed
def test_i2i_under_cfg_parallel_and_a_cache_matches_the_same_cache_on_one_process() -> None:
    """The condition pass is no branch of a step: both CFG ranks compute it (unpaired) and the cache counts no step
    for it, so the cached steps and the output match the same cache on one process."""
    from fastdit.diagnostics.family_ladder import RungSpec, assert_rows, cached_call_overrides, run_family_ladder

    spec = RungSpec("cfg2-cache", {"cfg": 2}, cache_bn=0)
    overrides = cached_call_overrides("glm_image", "i2i")
    reports = get_pool(2).run(run_family_ladder, "glm_image", "i2i", [spec], overrides, timeout=300)
    rows = assert_rows(reports)
    assert rows[1]["cached_steps"] > 0
    stats = [info["cfg_parallel"] for info in rows[1]["summary"].values()]
    assert sum(s["skipped_calls"] for s in stats) > 0, stats
