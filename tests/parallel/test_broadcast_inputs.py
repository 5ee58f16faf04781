"""Split inputs of one row along the split dim: broadcast tables pass whole, one-token streams are still refused.

A RoPE table of one row broadcasts over every image token (the plain forward accepts it), so each rank needs it
whole; a text stream of one token cannot be shared by two ranks (each would add it to the joint sequence).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
import torch

import fastdit
from fastdit.parallel.plan import SplitInput, SplitOutput, passes_whole
from fastdit.testing.distributed import DistributedTestError, WorkerPool

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-5
LAYOUTS = {"ulysses2": {"ulysses": 2}, "ring2": {"ring": 2}}


@functools.lru_cache(maxsize=1)
def _hunyuan_dit() -> tuple[torch.nn.Module, dict[str, Any]]:
    """A tiny HunyuanDiT and a call whose (cos, sin) RoPE tables have one row for all 16 image tokens."""
    from fastdit.models.hunyuan_dit import _BERT_LEN, _T5_LEN, tiny_transformer

    transformer = tiny_transformer(seed=0)
    g = torch.Generator().manual_seed(0)
    head_dim = transformer.config.attention_head_dim
    kwargs = {
        "hidden_states": torch.randn(1, 4, 8, 8, generator=g),  # 2x2 patches: 16 tokens
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": torch.randn(1, _BERT_LEN, 32, generator=g),
        "text_embedding_mask": torch.ones(1, _BERT_LEN, dtype=torch.long),
        "encoder_hidden_states_t5": torch.randn(1, _T5_LEN, 32, generator=g),
        "text_embedding_mask_t5": torch.ones(1, _T5_LEN, dtype=torch.long),
        "image_rotary_emb": (torch.rand(1, head_dim, generator=g), torch.rand(1, head_dim, generator=g)),
        "return_dict": False,
    }
    return transformer, kwargs


def _run_hunyuan_dit(rank: int, world_size: int, parallel: dict[str, int] | None) -> torch.Tensor:
    transformer, kwargs = _hunyuan_dit()
    if parallel is not None:
        fastdit.accelerate(transformer, parallel=fastdit.Parallel(**parallel))
    try:
        with torch.no_grad():
            return transformer(**kwargs)[0]
    finally:
        if parallel is not None:
            fastdit.disable(transformer)


@pytest.mark.parametrize("parallel", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_hunyuan_dit_one_row_rope_matches_single_process(dist2: WorkerPool, parallel: dict[str, int]) -> None:
    expected = _run_hunyuan_dit(0, 1, None)
    for out in dist2.run(_run_hunyuan_dit, parallel, timeout=120):
        assert out.shape == expected.shape
        assert torch.isfinite(out).all()
        assert (out - expected).abs().max() < TOLERANCE, f"max abs error {(out - expected).abs().max():.2e}"


def _run_flux_one_text_token(rank: int, world_size: int) -> None:
    from fastdit.models.flux import tiny_transformer

    transformer = tiny_transformer(seed=0)
    g = torch.Generator().manual_seed(0)
    fastdit.accelerate(transformer, parallel=fastdit.Parallel(ulysses=world_size))
    try:
        with torch.no_grad():
            transformer(
                hidden_states=torch.randn(1, 16, 16, generator=g),
                encoder_hidden_states=torch.randn(1, 1, 32, generator=g),  # one text token
                pooled_projections=torch.randn(1, 32, generator=g),
                timestep=torch.tensor([0.5]),
                img_ids=torch.zeros(16, 3),
                txt_ids=torch.zeros(1, 3),
            )
    finally:
        fastdit.disable(transformer)


def test_one_token_text_stream_is_refused_on_every_rank(dist2: WorkerPool) -> None:
    with pytest.raises(DistributedTestError) as info:
        dist2.run(_run_flux_one_text_token, timeout=120)
    assert set(info.value.exc_types.values()) == {"fastdit.errors.ShardError"}  # a ValueError
    assert "encoder_hidden_states has 1 tokens" in str(info.value)


@pytest.mark.parametrize(
    ("shape", "dim", "keep", "whole"),
    [
        ((1, 64), 0, None, True),  # one-row RoPE table (S, D)
        ((2, 1), 1, None, True),  # per-sample timestep where another variant passes one per token
        ((1, 1, 2, 8), 1, None, True),  # (B, S, H, D) table
        ((1, 1, 32), 1, None, False),  # (B, S, D): a one-token stream
        ((1, 1, 32), -2, None, False),
        ((1, 1, 32), 1, True, True),  # declared per-sample (B, 1, D) modulation
        ((1, 64), 0, False, False),
        ((3, 64), 0, True, False),  # more than one row: always split
    ],
)
def test_passes_whole(shape: tuple[int, ...], dim: int, keep: bool | None, whole: bool) -> None:
    assert passes_whole(torch.zeros(shape), dim, keep) is whole


def test_one_row_table_really_broadcasts() -> None:
    """The case above is not vacuous: the plain forward reads the one-row table (another row, another output)."""
    transformer, kwargs = _hunyuan_dit()
    with torch.no_grad():
        first = transformer(**kwargs)[0]
        cos, sin = kwargs["image_rotary_emb"]
        second = transformer(**{**kwargs, "image_rotary_emb": (sin, cos)})[0]
    assert not np.allclose(first.numpy(), second.numpy())


def _split_cases(rank: int, world_size: int) -> dict[str, Any]:
    """What the context-parallel splitter does with the inputs the plans' audit found (on every rank)."""
    from fastdit.parallel.attention.dispatch import ForwardLayout
    from fastdit.parallel.context_parallel import _Splitter

    layout = ForwardLayout()
    splitter = _Splitter(None, layout, log=False)
    table = (torch.arange(8.0).view(1, 8), torch.arange(8.0).view(1, 8) + 1)  # one-row (cos, sin), dim 0
    tokens = torch.arange(24.0).view(1, 4, 6)
    out = {
        "table": splitter.split(table, 0, 2, "rope"),
        "rope_output": SplitOutput(dim=1, expected_dims=4).keep_singleton,
        "none": splitter.split(None, 1, 3, "mask"),  # an optional input left None
        "pair_with_none": splitter.split((tokens, None), 1, 3, "pair"),
        "tokens": splitter.split(tokens, 1, 3, "hidden_states"),
        "per_sample": SplitInput(dim=1, expected_dims=2).adjust(torch.ones(1, 1), splitter, "timestep"),
        "recorded": dict(layout.splits),
    }
    try:
        splitter.split(torch.zeros(1, 1, 6), 1, 3, "encoder_hidden_states")
    except ValueError as error:
        out["stream_error"] = str(error)
    return out


def test_splitter_passes_broadcasts_and_none_whole_and_splits_the_rest(dist2: WorkerPool) -> None:
    for rank, out in enumerate(dist2.run(_split_cases, timeout=60)):
        assert all(t.shape == (1, 8) for t in out["table"])  # whole on every rank, not recorded as a split
        assert out["rope_output"] is None  # SplitOutput broadcasts one-row outputs alike (the default)
        assert out["none"] is None
        assert out["pair_with_none"][1] is None and out["pair_with_none"][0].shape == (1, 2, 6)
        assert torch.equal(out["tokens"], torch.arange(24.0).view(1, 4, 6)[:, 2 * rank : 2 * rank + 2])
        assert out["per_sample"].shape == (1, 1)  # a (B, 1) per-sample timestep broadcasts
        assert out["recorded"] == {"pair": [2, 2], "hidden_states": [2, 2]}
        assert "encoder_hidden_states has 1 tokens along dim 1, fewer than the 2 ranks" in out["stream_error"]
