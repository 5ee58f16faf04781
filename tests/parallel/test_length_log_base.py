"""``LengthLogBase``: the base of proportional attention's logarithm, adjusted so that a rank's query shard gives the
logarithm of the global query length (Lumina-Next's ``base_sequence_length``)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from fastdit.errors import ShardError
from fastdit.parallel.context_parallel import _Splitter
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, LengthLogBase, SplitOutput


def _splitter(rank: int, lens: list[int]) -> _Splitter:
    """A splitter of rank ``rank`` whose forward split ``"x"`` into ``lens`` (no process group needed)."""
    splitter = object.__new__(_Splitter)
    splitter.rank, splitter.degree = rank, len(lens)
    splitter.layout = SimpleNamespace(splits={"x": lens})
    return splitter


@pytest.mark.parametrize("lens", [[8, 8], [6, 5, 5], [1024, 1023]])
def test_each_shard_measures_the_global_length(lens: list[int]) -> None:
    base = 4096
    for rank in range(len(lens)):
        local_base = LengthLogBase(of="x").adjust(base, _splitter(rank, lens), "base")
        assert math.isclose(math.log(lens[rank], local_base), math.log(sum(lens), base), rel_tol=1e-12)


def test_a_dict_entry_is_adjusted_and_the_rest_kept() -> None:
    spec = LengthLogBase(of="x", key="base_sequence_length")
    kwargs = {"base_sequence_length": 16, "other": 3}
    out = spec.adjust(kwargs, _splitter(0, [8, 8]), "cross_attention_kwargs")
    assert out["other"] == 3 and math.isclose(math.log(8, out["base_sequence_length"]), 1.0)
    assert kwargs["base_sequence_length"] == 16  # the caller's dict is not changed
    assert spec.adjust({}, _splitter(0, [8, 8]), "cross_attention_kwargs") == {}  # no proportional attention
    assert spec.adjust(None, _splitter(0, [8, 8]), "cross_attention_kwargs") is None


def test_unsplit_or_absent_values_pass_and_one_token_shards_are_refused() -> None:
    assert LengthLogBase(of="y").adjust(16, _splitter(0, [8, 8]), "base") == 16  # "y" not split in this forward
    assert LengthLogBase(of="x").adjust(None, _splitter(0, [8, 8]), "base") is None
    for rank in range(3):  # every rank raises alike, the one holding two tokens too
        with pytest.raises(ShardError, match="single token"):
            LengthLogBase(of="x").adjust(16, _splitter(rank, [2, 1, 1]), "base")


def test_plan_names_a_known_split() -> None:
    def plan(of: str) -> ContextParallelPlan:
        return ContextParallelPlan(
            inputs={"layers.*": {"kwargs": LengthLogBase(of=of, key="base")}},
            outputs={"embed": SplitOutput(dim=1, index=0)},
            gather={"out": GatherOutput(dim=1)},
            attention=AttentionRouting(modules=("m",)),
        )

    plan("embed[0]")
    with pytest.raises(ValueError, match=r"LengthLogBase\.of='embed'"):
        plan("embed")
