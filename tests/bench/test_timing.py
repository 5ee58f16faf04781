"""``fastdit.bench.timing``: what a run calls, in which order, and what it records."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fastdit.bench import CacheStats, MemoryTracker, RunResult, run, run_variants, time_calls, timed_load
from fastdit.bench.timing import OWNER
from fastdit.errors import FieldError
from fastdit.session import Case, Session, resolve_model
from tests.bench.fakes import FakeSession

CASES = [Case("a", seed=1), Case("b", seed=2), Case("c", seed=3)]


def test_run_warms_up_then_times_every_pass() -> None:
    session = FakeSession()
    result = run(session, CASES[:2], {"height": 4}, warmup=2, repeat=3)
    calls = session.pipe.calls
    assert [c["prompt"] for c in calls] == ["a", "a"] + ["a", "b"] * 3  # warm-up calls repeat the first case
    assert all(c["height"] == 4 for c in calls)
    assert len(result.seconds) == 3 and len(result.call_seconds) == 6 and result.warmup_seconds >= 0
    assert result.median_seconds >= result.median_call_seconds >= 0
    assert [o[0, 0, 0] for o in result.outputs] == pytest.approx([0.01, 0.02])
    assert result.cache is None and result.summary is None and result.peak_memory is None


def test_batches_keep_the_order_of_the_cases() -> None:
    session = FakeSession()
    result = run(session, CASES, {}, batch=2, warmup=1)
    assert [c["prompt"] for c in session.pipe.calls] == [["a", "b"], ["a", "b"], "c"]
    assert [c["seeds"] for c in session.pipe.calls][1:] == [[1, 2], [3]]
    assert [o[0, 0, 0] for o in result.outputs] == pytest.approx([0.01, 0.02, 0.03])
    assert len(result.call_seconds) == 2


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"repeat": 0}, "repeat"), ({"warmup": -1}, "warmup"), ({"batch": 0}, "batch"), ({"cases": []}, "cases")],
)
def test_counts_are_checked(kwargs: dict, field: str) -> None:
    cases = kwargs.pop("cases", CASES)
    for call in (
        lambda: run(FakeSession(), cases, {}, **kwargs),
        lambda: run_variants(FakeSession(), [{}], cases, {}, **kwargs),
    ):
        with pytest.raises(FieldError) as caught:
            call()
        assert (caught.value.owner, caught.value.field) == (OWNER, field)


def test_variants_interleave_pass_by_pass() -> None:
    session = FakeSession()
    plain, cached = run_variants(session, [None, {"cache": 1}], CASES[:1], {}, warmup=1, repeat=2, track_memory=True)
    # Warm-ups first, then each round runs one pass of every variant in turn.
    assert session.log == ["accelerate cache", "disable"] * 3 and not session.accelerated
    assert len(session.pipe.calls) == 2 + 2 * 2
    assert len(plain.seconds) == len(cached.seconds) == 2
    assert plain.cache is None and cached.cache == CacheStats(cached_steps=1, blocks_computed=3, blocks_total=4)
    assert cached.cache.blocks_computed_fraction == 0.75 and CacheStats().blocks_computed_fraction == 1.0
    assert plain.peak_memory and cached.memory_kind == "process peak RSS"


def test_extend_keeps_the_later_outputs_and_the_higher_peak() -> None:
    first = RunResult(seconds=[1.0], call_seconds=[1.0], peak_memory=10, memory_kind="a")
    first.extend(RunResult(seconds=[3.0], call_seconds=[3.0], peak_memory=5, memory_kind="b", warmup_seconds=1.0))
    assert first.seconds == [1.0, 3.0] and first.median_seconds == 2.0 and first.peak_memory == 10
    assert first.warmup_seconds == 1.0


def test_time_calls() -> None:
    counter = iter(range(10))
    value, seconds = time_calls(lambda: next(counter), "cpu", warmup=2, repeat=3)
    assert value == 4 and len(seconds) == 3 and min(seconds) >= 0
    with pytest.raises(FieldError):
        time_calls(lambda: None, "cpu", repeat=0)


def test_timed_load(tiny_flux_dir: Path) -> None:
    session, seconds = timed_load(resolve_model(None, str(tiny_flux_dir)), device="cpu", dtype=torch.float32)
    assert isinstance(session, Session) and seconds > 0 and session.device == torch.device("cpu")


def test_memory_tracker_on_cpu() -> None:
    tracker = MemoryTracker("cpu")
    tracker.reset()
    peak = tracker.peak()
    assert peak is None or peak > 0
    assert tracker.kind == "process peak RSS"
