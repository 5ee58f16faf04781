"""The audio DiTs' optional inputs under context parallelism, on the bare transformers (the tiny pipelines never
pass them): Stable Audio's self-attention padding mask, Stable Audio 3's inpainting rows when ranks hold only memory
tokens, LongCat-AudioDiT's frame mask with padded frames. Each against the single-process output."""

from __future__ import annotations

import pytest
import torch

import fastdit
from fastdit.testing.distributed import WorkerPool

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-4
LAYOUTS = {"ulysses2": {"ulysses": 2}, "ring2": {"ring": 2}, "ulysses3-uneven": {"ulysses": 3}}


def _stable_audio() -> tuple[torch.nn.Module, dict]:
    from diffusers.models.embeddings import get_1d_rotary_pos_embed

    from fastdit.models.stable_audio import tiny_transformer

    g = torch.Generator().manual_seed(1)
    kwargs = {
        "hidden_states": torch.randn(2, 4, 16, generator=g),
        "timestep": torch.tensor([0.5]),
        "encoder_hidden_states": torch.randn(2, 5, 16, generator=g),
        "global_hidden_states": torch.randn(2, 1, 32, generator=g),
        "rotary_embedding": get_1d_rotary_pos_embed(4, 17, use_real=True, repeat_interleave_real=False),
        "attention_mask": torch.tensor([[True] * 16, [True] * 10 + [False] * 6]),
        "encoder_attention_mask": torch.tensor([[True] * 5, [True] * 3 + [False] * 2]),
    }
    return tiny_transformer(), kwargs


def _stable_audio3() -> tuple[torch.nn.Module, dict]:
    from diffusers import StableAudio3DiTModel

    from fastdit.models.stable_audio3 import tiny_transformer

    tiny = tiny_transformer()
    # 12 memory tokens before 6 frames: over 2 or 3 ranks, some ranks hold memory tokens only (no inpainting rows).
    config = {**tiny.config, "num_memory_tokens": 12}
    torch.manual_seed(0)
    model = StableAudio3DiTModel.from_config(config).eval()
    model.load_state_dict({k: v for k, v in tiny.state_dict().items() if k != "memory_tokens"}, strict=False)
    g = torch.Generator().manual_seed(1)
    kwargs = {
        "hidden_states": torch.randn(2, 4, 6, generator=g),
        "timestep": torch.tensor([0.3, 0.7]),
        "encoder_hidden_states": torch.randn(2, 5, 32, generator=g),
        "global_hidden_states": torch.randn(2, 32, generator=g),
        "encoder_attention_mask": torch.tensor([[1] * 5, [1] * 2 + [0] * 3]),
        "local_add_cond": torch.randn(2, 5, 6, generator=g),
    }
    return model, kwargs


def _longcat() -> tuple[torch.nn.Module, dict]:
    from fastdit.models.longcat_audio_dit import tiny_transformer

    g = torch.Generator().manual_seed(1)
    kwargs = {
        "hidden_states": torch.randn(2, 14, 4, generator=g),
        "encoder_hidden_states": torch.randn(2, 5, 32, generator=g),
        "encoder_attention_mask": torch.tensor([[True] * 5, [True] * 3 + [False] * 2]),
        "timestep": torch.tensor([0.4, 0.4]),
        "attention_mask": torch.tensor([[True] * 14, [True] * 9 + [False] * 5]),
        "latent_cond": torch.randn(2, 14, 4, generator=g),
    }
    return tiny_transformer(), kwargs


MODELS = {"stable_audio": _stable_audio, "stable_audio3": _stable_audio3, "longcat_audio_dit": _longcat}


def _run(rank: int, world_size: int, model: str, parallel: dict[str, int] | None) -> torch.Tensor:
    torch.manual_seed(0)
    transformer, kwargs = MODELS[model]()
    if parallel is not None:
        fastdit.accelerate(transformer, parallel=fastdit.Parallel(**parallel))
    try:
        with torch.no_grad():
            return transformer(**kwargs, return_dict=False)[0]
    finally:
        if parallel is not None:
            fastdit.disable(transformer)


# One layout per model in the default run (3 ranks where ranks hold Stable Audio 3's memory tokens only); the rest
# in the slow run.
DEFAULT = {"stable_audio": "ulysses2", "stable_audio3": "ulysses3-uneven", "longcat_audio_dit": "ring2"}
CASES = [
    pytest.param(model, layout, id=f"{model}-{layout}", marks=() if DEFAULT[model] == layout else pytest.mark.slow)
    for model in MODELS
    for layout in LAYOUTS
]


@pytest.mark.parametrize(("model", "layout"), CASES)
def test_optional_inputs_match_single_process(dist2: WorkerPool, dist3: WorkerPool, model: str, layout: str) -> None:
    parallel = LAYOUTS[layout]
    expected = _run(0, 1, model, None)
    pool = dist3 if fastdit.Parallel(**parallel).world_size == 3 else dist2
    for out in pool.run(_run, model, parallel, timeout=180):
        assert out.shape == expected.shape and torch.isfinite(out).all()
        assert (out - expected).abs().max() < TOLERANCE, f"max abs error {(out - expected).abs().max():.2e}"
