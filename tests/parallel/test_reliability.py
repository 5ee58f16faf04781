"""A distributed run that loses a rank fails fast and says who: a stalled rank times its peers out after
``Parallel.timeout_s`` (every group fastdit creates, sub-groups included), a rank that left ends them at once, and
both come out as one :class:`CollectiveError` naming the ranks."""

from __future__ import annotations

import functools
import os
import signal
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

import fastdit
from fastdit.parallel.failures import CollectiveError, collective_failures
from fastdit.parallel.runtime import ParallelRuntime
from fastdit.testing.distributed import DistributedTestError, WorkerPool

pytestmark = pytest.mark.distributed

TINY_CALL = {"prompt": "a cat", "num_inference_steps": 2, "max_sequence_length": 16, "height": 32, "width": 32}


@functools.lru_cache(maxsize=1)
def _tiny_pipeline() -> Any:
    from fastdit.models.flux import tiny_flux

    pipe = tiny_flux(0)
    pipe.set_progress_bar_config(disable=True)
    return pipe


class TimedError(Exception):
    """Carries how long a rank waited before its error, to the parent (failures travel as text)."""

    def __init__(self, seconds: float, error: BaseException) -> None:
        super().__init__(f"{seconds:.3f}|{type(error).__name__}|{error}")


def _timed(failure_message: str) -> tuple[float, str, str]:
    seconds, kind, message = failure_message.split("|", 2)
    return float(seconds), kind, message


# --- worker functions ---


def _stall_in_a_sub_group(rank: int, world_size: int, timeout_s: float) -> None:
    """Rank 1 never joins an all-reduce over the mesh's Ulysses group (created by fastdit, not the test pool)."""
    runtime = ParallelRuntime.from_config(fastdit.Parallel(ulysses=world_size, timeout_s=timeout_s), device="cpu")
    if rank == 1:
        return  # back to the pool's loop, never in the collective
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=runtime.group("ulysses"))
    except RuntimeError as error:
        raise TimedError(time.monotonic() - start, error) from error


def _stalled_peer(rank: int, world_size: int, timeout_s: float) -> None:
    """Rank 1 is stopped (SIGSTOP) once accelerated; rank 0 runs the pipeline and meets it in a collective."""
    pipe = _tiny_pipeline()
    fastdit.accelerate(pipe, parallel=fastdit.Parallel(ulysses=world_size, timeout_s=timeout_s))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # the pool kills it once rank 0 has reported
    start = time.monotonic()
    try:
        with collective_failures():
            pipe(**TINY_CALL, generator=torch.Generator().manual_seed(0))
    except CollectiveError as error:
        raise TimedError(time.monotonic() - start, error) from error
    finally:
        fastdit.disable(pipe)


def _peer_left(rank: int, world_size: int) -> None:
    """Rank 1 exits once accelerated; rank 0 (with a long timeout) must not wait for it."""
    pipe = _tiny_pipeline()
    fastdit.accelerate(pipe, parallel=fastdit.Parallel(ulysses=world_size, timeout_s=120))
    if rank == 1:
        os._exit(3)
    start = time.monotonic()
    try:
        with collective_failures():
            pipe(**TINY_CALL, generator=torch.Generator().manual_seed(0))
    except CollectiveError as error:
        raise TimedError(time.monotonic() - start, error) from error
    finally:
        fastdit.disable(pipe)


def _short_mask(rank: int, world_size: int) -> None:
    """A step mask laid out for 2 steps, a run of 3, the sequence split over the ranks."""
    pipe = _tiny_pipeline()
    mask = fastdit.StepMask.preset("fast", 2)
    cache = fastdit.DBCache(fn=1, bn=0, warmup_steps=0, step_mask=mask)
    fastdit.accelerate(pipe, parallel=fastdit.Parallel(ulysses=world_size), cache=cache)
    try:
        pipe(**{**TINY_CALL, "num_inference_steps": 3}, generator=torch.Generator().manual_seed(0))
    finally:
        fastdit.disable(pipe)


# --- tests ---


def test_a_step_mask_shorter_than_the_run_is_refused_alike_on_every_rank(dist2: WorkerPool) -> None:
    with pytest.raises(DistributedTestError) as info:
        dist2.run(_short_mask, timeout=90)
    assert sorted(info.value.failures) == [0, 1] and not info.value.unfinished
    assert set(info.value.exc_types.values()) == {"fastdit.errors.FieldError"}
    (message,) = {failure.message for failure in info.value.failures.values()}
    assert message.startswith("StepMask.num_steps=2: the mask was laid out for a run of 2 steps, this run has 3")


def test_sub_groups_wait_parallel_timeout_s_not_torch_default(dist2_private: WorkerPool) -> None:
    """torch gives sub-groups its own 30-minute gloo default; the mesh's groups get the configured timeout."""
    with pytest.raises(DistributedTestError) as info:
        dist2_private.run(_stall_in_a_sub_group, 2.0, timeout=60)
    seconds, kind, message = _timed(info.value.failures[0].message)
    assert kind == "RuntimeError" and "Timed out" in message
    assert 1.5 < seconds < 5


def test_a_stalled_rank_fails_its_peer_after_the_timeout_naming_it(dist2_private: WorkerPool) -> None:
    with pytest.raises(DistributedTestError) as info:
        dist2_private.run(_stalled_peer, 3.0, timeout=90)
    seconds, kind, message = _timed(info.value.failures[0].message)
    assert kind == "CollectiveError"
    assert message.startswith("rank 0 of 2: a collective timed out after 3 s: rank 1 stopped answering")
    assert "Parallel.timeout_s" in message
    assert 2.5 < seconds < 3.0 + 1.0 + 2.0  # the timeout, the answer grace, some slack for a busy machine
    assert info.value.unfinished == [1]


def test_a_rank_that_left_ends_its_peer_at_once(dist2_private: WorkerPool) -> None:
    with pytest.raises(DistributedTestError) as info:
        dist2_private.run(_peer_left, timeout=90)
    seconds, kind, message = _timed(info.value.failures[0].message)
    assert kind == "CollectiveError"
    assert message.startswith("rank 0 of 2: rank 1 left the run during a collective")
    assert seconds < 2.0  # not the 120 s timeout
    assert info.value.exc_types[1] == "WorkerExited"
