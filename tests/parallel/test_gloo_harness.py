"""The gloo worker pool: collectives the parallel code relies on, DTensor, 2-D meshes, failure handling."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fastdit.testing.distributed import DistributedTestError, WorkerPool

pytestmark = pytest.mark.distributed

# torch >= 2.13 renamed the single-tensor collectives; the old names still work but warn.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _a2a_input(rank: int, num_rows: int) -> torch.Tensor:
    return (torch.arange(num_rows * 3, dtype=torch.float32).reshape(num_rows, 3) + 1000 * rank).contiguous()


def _a2a_reference(splits: list[list[int]], receiver: int) -> torch.Tensor:
    """What ``receiver`` holds after an all-to-all where rank ``r`` sends ``splits[r][j]`` rows to rank ``j``."""
    chunks = []
    for sender, row in enumerate(splits):
        start = sum(row[:receiver])
        chunks.append(_a2a_input(sender, sum(row))[start : start + row[receiver]])
    return torch.cat(chunks)


# --- worker functions (module level: workers import them by module path) ---


def _identity(rank: int, world_size: int, tag: str, *, scale: int = 1) -> tuple[int, int, str, int, int]:
    return rank, world_size, tag, scale * rank, torch.get_num_threads()


def _all_to_all_single(rank: int, world_size: int, splits: list[list[int]]) -> torch.Tensor:
    inp = _a2a_input(rank, sum(splits[rank]))
    out_splits = [splits[sender][rank] for sender in range(world_size)]
    out = torch.empty(sum(out_splits), 3)
    dist.all_to_all_single(out, inp, output_split_sizes=out_splits, input_split_sizes=splits[rank])
    return out


def _all_to_all_async(rank: int, world_size: int, rows: int) -> tuple[torch.Tensor, list[torch.Tensor], bool]:
    inp = _a2a_input(rank, rows * world_size)
    out_single = torch.empty_like(inp)
    out_list = [torch.empty(rows, 3) for _ in range(world_size)]
    work_single = dist.all_to_all_single(out_single, inp, async_op=True)
    work_list = dist.all_to_all(out_list, list(inp.chunk(world_size)), async_op=True)
    busy = torch.randn(64, 64) @ torch.randn(64, 64)  # compute issued while the collectives are in flight
    work_single.wait()
    work_list.wait()
    return out_single, out_list, bool(work_single.is_completed() and work_list.is_completed() and busy.isfinite().all())


def _all_gather(rank: int, world_size: int) -> torch.Tensor:
    local = torch.full((2, 3), float(rank)) + torch.arange(3.0)
    out = torch.empty(2 * world_size, 3)
    _all_gather_single(out, local)
    return out


def _reduce_scatter(rank: int, world_size: int) -> torch.Tensor:
    inp = (rank + 1) * torch.arange(4.0 * world_size)
    out = torch.empty(4)
    _reduce_scatter_single(out, inp)
    return out


def _mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)).eval()


def _tp_mlp(rank: int, world_size: int, seed: int) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world_size,))
    mlp = parallelize_module(_mlp(seed), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        out = mlp(x)  # an async collective tensor: the harness must wait for it before sending it back
    return out, tuple(mlp[0].weight.to_local().shape), tuple(mlp[2].weight.to_local().shape)


def _mesh_2d_all_to_all(rank: int, world_size: int) -> dict[str, tuple[list[int], torch.Tensor]]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("outer", "inner"))
    results = {}
    for dim in ("outer", "inner"):
        group = mesh.get_group(dim)
        inp = torch.arange(4.0) + 100 * rank
        out = torch.empty(4)
        dist.all_to_all_single(out, inp, group=group)
        results[dim] = (dist.get_process_group_ranks(group), out)
    return results


def _fail_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one refuses")
    dist.barrier()  # never completes: rank 1 is gone from the collective


def _sleep_on_rank_zero(rank: int, world_size: int, seconds: float) -> int:
    if rank == 0:
        time.sleep(seconds)
    return rank


def _exit_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(3)
    return rank


def _exit_cleanly_on_rank_zero(rank: int, world_size: int) -> int:
    if rank == 0:
        sys.exit(5)  # a BaseException, like pytest.fail/skip inside a worker
    return rank


def _pid(rank: int, world_size: int) -> int:
    t = torch.ones(1)
    dist.all_reduce(t)  # proves the new group forms and works
    assert t.item() == world_size
    return os.getpid()


# --- tests ---


def test_results_come_back_by_rank_with_args_and_kwargs(dist2: WorkerPool) -> None:
    results = dist2.run(_identity, "tag", scale=3)
    assert results == [(0, 2, "tag", 0, 1), (1, 2, "tag", 3, 1)]


def test_local_functions_are_rejected(dist2: WorkerPool) -> None:
    def local(rank: int, world_size: int) -> None:
        return None

    with pytest.raises(TypeError, match="module-level"):
        dist2.run(local)


@pytest.mark.parametrize(
    "splits",
    [pytest.param([[2, 2], [2, 2]], id="even"), pytest.param([[1, 3], [2, 0]], id="uneven")],
)
def test_all_to_all_single(dist2: WorkerPool, splits: list[list[int]]) -> None:
    outputs = dist2.run(_all_to_all_single, splits)
    for rank, out in enumerate(outputs):
        torch.testing.assert_close(out, _a2a_reference(splits, rank), rtol=0, atol=0)


def test_all_to_all_single_uneven_three_ranks(dist3: WorkerPool) -> None:
    splits = [[1, 0, 2], [3, 1, 1], [0, 2, 2]]
    outputs = dist3.run(_all_to_all_single, splits)
    for rank, out in enumerate(outputs):
        torch.testing.assert_close(out, _a2a_reference(splits, rank), rtol=0, atol=0)


def test_async_all_to_all_with_wait(dist2: WorkerPool) -> None:
    rows = 3
    splits = [[rows, rows], [rows, rows]]
    for rank, (out_single, out_list, completed) in enumerate(dist2.run(_all_to_all_async, rows)):
        expected = _a2a_reference(splits, rank)
        assert completed
        torch.testing.assert_close(out_single, expected, rtol=0, atol=0)
        torch.testing.assert_close(torch.cat(out_list), expected, rtol=0, atol=0)


def test_all_gather_into_tensor(dist2: WorkerPool) -> None:
    expected = torch.cat([torch.full((2, 3), float(r)) + torch.arange(3.0) for r in range(2)])
    for out in dist2.run(_all_gather):
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_reduce_scatter(dist2: WorkerPool) -> None:
    total = sum((r + 1) * torch.arange(8.0) for r in range(2))
    outputs = dist2.run(_reduce_scatter)
    for rank, out in enumerate(outputs):
        torch.testing.assert_close(out, total[4 * rank : 4 * rank + 4], rtol=0, atol=0)


def test_dtensor_colwise_rowwise_mlp_matches_unsharded(dist2: WorkerPool) -> None:
    seed = 7
    with torch.no_grad():
        expected = _mlp(seed)(torch.randn(4, 8, generator=torch.Generator().manual_seed(seed + 1)))
    for out, up_shape, down_shape in dist2.run(_tp_mlp, seed):
        assert up_shape == (16, 8)  # really sharded: half the output features of the up projection
        assert down_shape == (8, 16)  # and half the input features of the down projection
        assert (out - expected).abs().max().item() < 1e-5


def test_2d_mesh_sub_group_all_to_all(dist4: WorkerPool) -> None:
    results = dist4.run(_mesh_2d_all_to_all)
    for rank, per_dim in enumerate(results):
        expected_groups = {"outer": [rank % 2, rank % 2 + 2], "inner": [rank - rank % 2, rank - rank % 2 + 1]}
        for dim, (group_ranks, out) in per_dim.items():
            assert group_ranks == expected_groups[dim]
            me = group_ranks.index(rank)
            expected = torch.stack([torch.arange(4.0)[me * 2 : me * 2 + 2] + 100 * r for r in group_ranks]).flatten()
            torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_exception_reports_rank_and_type_and_pool_recovers(dist2_private: WorkerPool) -> None:
    generation = dist2_private.generation
    with pytest.raises(DistributedTestError) as info:
        dist2_private.run(_fail_on_rank_one, timeout=30)
    assert info.value.exc_types == {1: "ValueError"}
    assert info.value.unfinished == [0]  # blocked in the barrier, killed after the grace period
    assert "rank one refuses" in info.value.failures[1].traceback
    assert dist2_private.generation == generation + 1
    assert dist2_private.run(_pid) == dist2_private.pids


def _refuse_everywhere(rank: int, world_size: int) -> None:
    raise ValueError(f"rank {rank} refuses")


def test_a_failure_every_rank_raises_alike_keeps_the_workers(dist2: WorkerPool) -> None:
    generation, pids = dist2.generation, dist2.pids
    with pytest.raises(DistributedTestError) as info:
        dist2.run(_refuse_everywhere, timeout=30)
    assert info.value.exc_types == {0: "ValueError", 1: "ValueError"}
    # The group still pairs its collectives, so nothing is restarted: the next call runs on the same workers.
    assert dist2.generation == generation
    assert dist2.run(_pid) == pids


def test_dead_worker_is_reported(dist2_private: WorkerPool) -> None:
    with pytest.raises(DistributedTestError) as info:
        dist2_private.run(_exit_on_rank_one)
    assert info.value.exc_types == {1: "WorkerExited"}
    assert "code 3" in info.value.failures[1].message


def test_base_exception_is_reported_not_lost(dist2_private: WorkerPool) -> None:
    with pytest.raises(DistributedTestError) as info:
        dist2_private.run(_exit_cleanly_on_rank_zero)
    assert info.value.exc_types == {0: "SystemExit"}
    assert info.value.unfinished == []


def test_timeout_restarts_pool_and_next_call_succeeds(dist2_private: WorkerPool) -> None:
    old_pids = dist2_private.pids
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="rank\\(s\\) \\[0\\]"):
        dist2_private.run(_sleep_on_rank_zero, 60.0, timeout=0.5)
    assert time.monotonic() - start < 10  # killed, not waited for
    new_pids = dist2_private.run(_pid)
    assert new_pids == dist2_private.pids
    assert not set(new_pids) & set(old_pids)
