"""Head-parallel attention (``AttentionRouting.head_parallel``) and grouped splits (``SplitInput.groups_of``).

Qwen-Image 2.1's bare transformer drives what its tiny pipelines leave out: a condition image inside the text, a
right-padded prompt, the prefix KV cache (a prefill call, then a call on the target tokens alone) and the flex
processor, whose BlockMask covers the whole sequence. Each runs on Ulysses 2 and 3 (uneven shards, padded heads), ring
2 and USP against one process. The rest checks the vocabulary's validation and its errors without ranks.
"""

from __future__ import annotations

import pytest
import torch

import fastdit
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, HeadParallel, SplitInput
from fastdit.testing.distributed import WorkerPool

TOLERANCE = 1e-5
_TEXT, _COND, _TARGET = (6, 3), (4, 4), (4, 6)  # text runs around the condition image; latent grids (h, w)


def _inputs(seed: int = 3) -> dict:
    """Two samples: text, a 4 x 4 condition image (4 slots), more text, then the 4 x 6 target; sample 2 padded."""
    g = torch.Generator().manual_seed(seed)
    cond_slots = _COND[0] * _COND[1] // 4
    text_len = _TEXT[0] + cond_slots + _TEXT[1]
    slots = torch.zeros(text_len, dtype=torch.bool)
    slots[_TEXT[0] : _TEXT[0] + cond_slots] = True
    img_mask = torch.cat([slots, torch.ones(_TARGET[0] * _TARGET[1] // 4, dtype=torch.bool)])
    text_mask = torch.ones(2, text_len, dtype=torch.bool)
    text_mask[1, -2:] = False
    image_tokens = _COND[0] * _COND[1] + _TARGET[0] * _TARGET[1]
    return {
        "hidden_states": torch.randn(2, image_tokens, 4, generator=g),
        "encoder_hidden_states": torch.randn(2, text_len, 32, generator=g),
        "timestep": torch.tensor([0.7, 0.7]),
        "img_shapes": [[(1, *_COND), (1, *_TARGET)]] * 2,
        "img_mask": img_mask[None].expand(2, -1),
        "encoder_hidden_states_mask": text_mask,
    }


def _qwen21(rank: int, world_size: int, parallel: dict | None, flex: bool) -> list[torch.Tensor]:
    """Prefill (without and with the KV cache), then one cached call on the target tokens: the three outputs."""
    from diffusers.models.transformers.transformer_qwenimage21 import (
        QwenImage21FlexAttnProcessor,
        QwenImage21KVCache,
    )

    from fastdit.models.qwenimage21 import tiny_transformer

    transformer = tiny_transformer(0)
    if flex:
        for block in transformer.transformer_blocks:
            block.attn.set_processor(QwenImage21FlexAttnProcessor())
    if parallel is not None:
        fastdit.accelerate(transformer, parallel=fastdit.Parallel(**parallel))
    inputs = _inputs()
    cache = QwenImage21KVCache(len(transformer.transformer_blocks))
    try:
        with torch.no_grad():
            plain = transformer(**inputs, return_dict=False)[0]
            prefill = transformer(**inputs, kv_cache=cache, kv_cache_mode="extract", return_dict=False)[0]
            later = {**inputs, "hidden_states": inputs["hidden_states"] * 0.5, "timestep": torch.tensor([0.4, 0.4])}
            cached = transformer(**later, kv_cache=cache, kv_cache_mode="cached", return_dict=False)[0]
        return [plain, prefill, cached]
    finally:
        if parallel is not None:
            fastdit.disable(transformer)


LAYOUTS = {"u2": {"ulysses": 2}, "r2": {"ring": 2}, "u3": {"ulysses": 3}}
# The default run takes each processor on one layout; the other pairs are slow.
DEFAULT = {("u3", False), ("r2", True)}
CASES = [
    pytest.param(layout, flex, marks=() if (layout, flex) in DEFAULT else pytest.mark.slow)
    for layout in LAYOUTS
    for flex in (False, True)
]


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("layout", "flex"), CASES, ids=[f"{lay}-{'flex' if f else 'segments'}" for lay in LAYOUTS for f in (0, 1)]
)
def test_qwenimage21_kv_cache_and_block_mask_match_single_process(
    dist2: WorkerPool, dist3: WorkerPool, layout: str, flex: bool
) -> None:
    parallel = LAYOUTS[layout]
    expected = _qwen21(0, 1, None, flex)
    assert expected[2].shape[1] == _TARGET[0] * _TARGET[1]  # the cached call returns the target tokens only
    pool = dist2 if fastdit.Parallel(**parallel).world_size == 2 else dist3
    for outputs in pool.run(_qwen21, parallel, flex, timeout=300):
        for out, ref in zip(outputs, expected, strict=True):
            assert out.shape == ref.shape and torch.isfinite(out).all()
            assert (out - ref).abs().max() < TOLERANCE, f"max abs error {(out - ref).abs().max():.2e}"


@pytest.mark.slow
@pytest.mark.distributed
def test_qwenimage21_usp_matches_single_process(dist4: WorkerPool) -> None:
    expected = _qwen21(0, 1, None, False)
    for outputs in dist4.run(_qwen21, {"ulysses": 2, "ring": 2}, False, timeout=300):
        for out, ref in zip(outputs, expected, strict=True):
            assert (out - ref).abs().max() < TOLERANCE


def test_head_parallel_spec_errors() -> None:
    with pytest.raises(ValueError, match=r"HeadParallel\.queries"):
        HeadParallel(inputs=("to_q", "add_q"), output=("to_out", "to_add_out"), queries=("to_q",))
    with pytest.raises(ValueError, match=r"HeadParallel\.input_heads\['to_x'\]"):
        HeadParallel(inputs=("to_q",), output="to_out", input_heads={"to_x": "num_key_value_heads"})
    with pytest.raises(ValueError, match=r"HeadParallel\.arguments\['kv_cache'\]"):
        HeadParallel(inputs=("to_q",), output="to_out", arguments={"kv_cache": "2"})
    with pytest.raises(ValueError, match=r"HeadParallel\.optional"):
        HeadParallel(inputs=("to_q",), output="to_out", optional=("to_gate",))
    spec = HeadParallel(inputs=("to_q", "add_q"), output=("to_out", "to_add_out"), queries=("to_q", "add_q"))
    assert spec.outputs == ("to_out", "to_add_out")
    assert HeadParallel(inputs=("to_q", "to_k"), output="to_out.0").queries == ("to_q",)
    with pytest.raises(ValueError, match=r"HeadParallel\.inputs"):
        HeadParallel(inputs=(), output="to_out.0")
    with pytest.raises(ValueError, match=r"HeadParallel\.inputs"):
        HeadParallel(inputs="to_q", output="to_out.0")
    with pytest.raises(ValueError, match="exchanged once"):
        HeadParallel(inputs=("to_q", "to_out.0"), output="to_out.0")
    with pytest.raises(ValueError, match="expected HeadParallel"):
        AttentionRouting(head_parallel={"blocks.*.attn": ("to_q",)})
    # head_parallel alone is a routing.
    assert AttentionRouting(head_parallel={"a": HeadParallel(inputs=("to_q",), output="to_out.0")}).head_parallel


def _plan(spec: HeadParallel, path: str = "transformer_blocks.*.attn") -> ContextParallelPlan:
    return ContextParallelPlan(
        inputs={"transformer_blocks.0": {"hidden_states": SplitInput(dim=1, expected_dims=3)}},
        gather={"transformer_blocks.-1": GatherOutput(dim=1)},
        attention=AttentionRouting(head_parallel={path: spec}),
    )


def test_head_parallel_validation_names_what_does_not_fit() -> None:
    from fastdit.models.qwenimage21 import CP_PLAN, tiny_transformer
    from fastdit.parallel.plan import validate_plan

    transformer = tiny_transformer(0)
    validate_plan(transformer, CP_PLAN, 2)
    with pytest.raises(ValueError, match="no sub-module 'to_qkv'"):
        validate_plan(transformer, _plan(HeadParallel(inputs=("to_qkv",), output="to_out.0")), 2)
    with pytest.raises(ValueError, match="num_heads=None is not a head count"):
        validate_plan(transformer, _plan(HeadParallel(inputs=("to_q",), output="to_out.0", heads="num_heads")), 2)
    with pytest.raises(ValueError, match=r"use_bias=False .* not an integer multiple"):
        validate_plan(transformer, _plan(HeadParallel(inputs=("to_q",), output="to_out.0", divide=("use_bias",))), 2)
    with pytest.raises(ValueError, match="covers no attention module"):
        validate_plan(transformer, _plan(HeadParallel(inputs=("to_q",), output="to_out.0"), path="norm_out"), 2)
    with pytest.raises(ValueError, match="do not divide the Ulysses degree 3"):
        validate_plan(transformer, CP_PLAN, 3, uneven_heads=False)


def test_groups_of_must_name_a_plain_split_input() -> None:
    with pytest.raises(ValueError, match="groups_of='hidden' is not a plain split input"):
        ContextParallelPlan(
            inputs={"blocks.*": {"timestep": SplitInput(dim=0, groups_of="hidden")}},
            gather={"proj_out": GatherOutput(dim=1)},
            attention=AttentionRouting(modules=("m",)),
        )
    with pytest.raises(ValueError, match="cannot be combined"):
        SplitInput(dim=0, groups_of="hidden_states", unit=("width",))
    assert SplitInput(dim=0, groups_of="hidden_states").reads_record


class _Layout:
    def __init__(self, splits: dict) -> None:
        self.splits, self.records = splits, {}

    def record(self, name: str, lens: list[int]) -> None:
        self.records[name] = lens


def test_groups_of_splits_each_group_like_its_input() -> None:
    from fastdit.errors import ShardError
    from fastdit.parallel.context_parallel import _Splitter

    splitter = _Splitter.__new__(_Splitter)
    splitter.layout, splitter.degree = _Layout({"hidden_states": [2, 1, 1]}), 3
    rows = torch.arange(2 * 4 * 3).reshape(2 * 4, 3)  # (B·N, C): B = 2 samples of N = 4 tokens
    spec = SplitInput(dim=0, expected_dims=2, groups_of="hidden_states")
    for rank, expected in enumerate([[0, 1, 4, 5], [2, 6], [3, 7]]):
        splitter.rank = rank
        out = spec.adjust(rows, splitter, "timestep")
        assert out[:, 0].div(3).tolist() == expected
    assert splitter.layout.records["timestep"] == [4, 2, 2]
    # An input whole in this forward leaves its groups whole; a row count that is not whole groups is refused.
    splitter.layout = _Layout({})
    assert spec.adjust(rows, splitter, "timestep") is rows
    splitter.layout = _Layout({"hidden_states": [2, 1]})
    with pytest.raises(ShardError, match="not whole groups of the 3 tokens of hidden_states"):
        spec.adjust(rows, splitter, "timestep")


def test_block_mask_reaching_routed_attention_is_refused() -> None:
    from torch.nn.attention.flex_attention import create_block_mask

    from fastdit.parallel.attention.dispatch import ContextParallelAttention

    mask = create_block_mask(lambda b, h, q, k: q >= k, None, None, 128, 128, device="cpu")
    q = torch.randn(1, 128, 2, 8)
    with pytest.raises(ValueError, match=r"BlockMask .* AttentionRouting\.head_parallel"):
        ContextParallelAttention(cp_group=None)(q, q, q, attn_mask=mask)


# Tensor parallelism first divides the heads (the exchange sees a TP shard's heads; its output hook must run before
# TP's input hook on the output projection), USP exchanges and gathers; compiled blocks trace around the exchanges.
MESH_SPECS = {
    "tp2-ulysses2": {"tp": 2, "ulysses": 2},
    "tp2-ring2": {"tp": 2, "ring": 2},
    "usp": {"ulysses": 2, "ring": 2},
}


@pytest.mark.slow
@pytest.mark.distributed
# AnyFlow-FAR: TP's per-block KV-cache view, sliced again to the rank's heads; Cosmos 3: TP-divided query and KV
# heads, exchanged per pathway.
@pytest.mark.parametrize(
    ("family", "variant"),
    [("qwenimage21", "t2i"), ("kandinsky6_sr", "vsr"), ("anyflow_far", "t2v"), ("cosmos3", "t2v")],
)
def test_head_parallel_with_tensor_parallel_and_usp(dist4: WorkerPool, family: str, variant: str) -> None:
    from fastdit.diagnostics.family_ladder import RungSpec, assert_rows, run_family_ladder

    specs = [RungSpec(name, parallel) for name, parallel in MESH_SPECS.items()]
    assert_rows(dist4.run(run_family_ladder, family, variant, specs, timeout=600))


@pytest.mark.slow
@pytest.mark.distributed
def test_head_parallel_in_compiled_blocks_with_cache(dist2: WorkerPool) -> None:
    from fastdit.diagnostics.family_ladder import RungSpec, assert_rows, cached_call_overrides, run_family_ladder

    specs = [RungSpec("ulysses2-cache-bn1-compiled", {"ulysses": 2}, cache_bn=1, compile=True)]
    overrides = cached_call_overrides("qwenimage21", "t2i")
    assert_rows(dist2.run(run_family_ladder, "qwenimage21", "t2i", specs, overrides, timeout=600))


def _exchange(u: int, ulysses: int):
    from fastdit.parallel.attention.head_parallel import _Exchange

    exchange = _Exchange.__new__(_Exchange)
    exchange.ulysses, exchange.ring, exchange.u, exchange.r = ulysses, 1, u, 0
    return exchange


def test_head_arguments_are_views_of_the_rank_heads_or_padded_copies_written_back() -> None:
    from fastdit.parallel.attention.head_parallel import _Call

    cache = torch.arange(2 * 5 * 3, dtype=torch.float32).view(2, 5, 3)  # (2, heads, L): 5 heads
    # Ulysses 2 of 5 heads: 3 each (one zero head padded on rank 1).
    call = _Call(heads=5, local_heads=3)
    view = _exchange(0, 2).local_argument({"c": [cache]}, 1, call, "attn(kv_cache=)")["c"][0]
    assert view.data_ptr() == cache.data_ptr() and view.shape == (2, 3, 3) and not call.write_back
    padded = _exchange(1, 2).local_argument(cache, 1, call, "attn(kv_cache=)")
    assert padded.shape == (2, 3, 3) and torch.equal(padded[:, :2], cache[:, 3:]) and not padded[:, 2].any()
    ((target, copy, dim),) = call.write_back
    padded[:, 0] = -1.0  # the processor writes its real heads; the leave hook copies them back
    target.copy_(copy.narrow(dim, 0, target.shape[dim]))
    assert (cache[:, 3] == -1).all() and (cache[:, 4] != -1).all()
    # A flattened H·D dim ({ndim: dim}) takes the rank's heads' columns; a rank of its own is refused clearly.
    table = torch.arange(4 * 6, dtype=torch.float32).view(1, 4, 6)  # (B, S, H·D) with 2 heads of 3
    half = _exchange(1, 2).local_argument(table, {3: 2}, _Call(heads=2, local_heads=1), "attn(rope=)")
    assert torch.equal(half, table[..., 3:])
    with pytest.raises(ValueError, match=r"attn\(rope=\) got a 2-D tensor"):
        _exchange(0, 2).local_argument(table[0], {3: 2}, _Call(heads=2, local_heads=1), "attn(rope=)")
    with pytest.raises(ValueError, match="not a multiple of 4 heads"):
        _exchange(0, 2).local_argument(table, 2, _Call(heads=4, local_heads=2), "attn(rope=)")


def test_grouped_heads_are_exchanged_as_they_are_or_repeated_per_query_head() -> None:
    exchange = _exchange(0, 2)
    assert exchange.grouped(4, 2) == (2, 1)  # one KV head per rank beside its two query heads
    assert exchange.grouped(2, 1) == (1, 2)  # one KV head for two ranks: repeated per query head
    assert _exchange(0, 4).grouped(6, 2) == (2, 3)  # 2 query heads per rank would cut the groups of 3
    assert _exchange(0, 3).grouped(4, 2) == (2, 1)  # padded: [q0 q1 | kv0], [q2 q3 | kv1], [pad | pad]
