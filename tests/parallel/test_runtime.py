"""ParallelRuntime: mesh layout on the worker pool, validation before any collective, single-process mode."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from fastdit.config import Parallel
from fastdit.parallel import runtime as runtime_module
from fastdit.parallel.runtime import MESH_DIMS, ParallelRuntime
from fastdit.testing.distributed import WorkerPool

TORCHRUN_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


# --- worker functions ---


def _layout(rank: int, world_size: int, degrees: dict[str, int]) -> dict[str, Any]:
    rt = ParallelRuntime.from_config(Parallel(**degrees), device="cpu")  # gloo pool: CPU even where CUDA exists
    ulysses_sum = torch.tensor([float(rank)])
    dist.all_reduce(ulysses_sum, group=rt.group("ulysses"))  # the group really connects the expected ranks
    rt.barrier()
    return {
        "rank": rt.rank,
        "world_size": rt.world_size,
        "is_main": rt.is_main,
        "local_rank": rt.local_rank,
        "device": str(rt.device),
        "dim_names": rt.mesh.mesh_dim_names,
        "group_ranks": {dim: dist.get_process_group_ranks(rt.group(dim)) for dim in MESH_DIMS},
        "sizes": {dim: rt.size(dim) for dim in MESH_DIMS},
        "coordinates": {dim: rt.coordinate(dim) for dim in MESH_DIMS},
        "ulysses_sum": ulysses_sum.item(),
        "mesh_reused": ParallelRuntime.from_config(Parallel(**degrees), device="cpu").mesh is rt.mesh,
    }


def _mismatch(rank: int, world_size: int) -> tuple[str, int]:
    calls = []
    original = runtime_module.init_device_mesh

    def record(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return original(*args, **kwargs)

    runtime_module.init_device_mesh = record
    try:
        ParallelRuntime.from_config(Parallel(ulysses=3))
    except ValueError as exc:
        return str(exc), len(calls)
    finally:
        runtime_module.init_device_mesh = original
    return "no error", len(calls)


def _all_reduce(rank: int, world_size: int) -> float:
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


# --- on the pool ---


@pytest.mark.distributed
def test_two_ranks_ulysses(dist2: WorkerPool) -> None:
    results = dist2.run(_layout, {"ulysses": 2})
    for rank, r in enumerate(results):
        assert (r["rank"], r["world_size"], r["is_main"], r["local_rank"]) == (rank, 2, rank == 0, rank)
        assert r["device"] == "cpu"
        assert r["dim_names"] == ("cfg", "ring", "ulysses", "tp")
        assert r["group_ranks"] == {"cfg": [rank], "ring": [rank], "ulysses": [0, 1], "tp": [rank]}
        assert r["sizes"] == {"cfg": 1, "ring": 1, "ulysses": 2, "tp": 1}
        assert r["coordinates"] == {"cfg": 0, "ring": 0, "ulysses": rank, "tp": 0}
        assert r["ulysses_sum"] == 1.0
        assert r["mesh_reused"]


@pytest.mark.distributed
def test_four_ranks_ring_by_ulysses(dist4: WorkerPool) -> None:
    results = dist4.run(_layout, {"ulysses": 2, "ring": 2})
    for rank, r in enumerate(results):
        ring_coord, ulysses_coord = divmod(rank, 2)  # ulysses is the inner dim: neighbours share a group
        ulysses_group = [2 * ring_coord, 2 * ring_coord + 1]
        ring_group = [ulysses_coord, ulysses_coord + 2]
        assert r["group_ranks"] == {"cfg": [rank], "ring": ring_group, "ulysses": ulysses_group, "tp": [rank]}
        assert r["sizes"] == {"cfg": 1, "ring": 2, "ulysses": 2, "tp": 1}
        assert r["coordinates"] == {"cfg": 0, "ring": ring_coord, "ulysses": ulysses_coord, "tp": 0}
        assert r["ulysses_sum"] == sum(ulysses_group)
        assert r["is_main"] == (rank == 0)


@pytest.mark.distributed
def test_world_size_mismatch_raises_on_every_rank_before_any_collective(dist2: WorkerPool) -> None:
    results = dist2.run(_mismatch, timeout=20)
    for message, mesh_calls in results:
        assert message.startswith("Parallel(ulysses=3) needs 3 processes, got 2")
        assert mesh_calls == 0
    # No rank was left inside a collective: the same workers run the next one.
    pids = dist2.pids
    assert dist2.run(_all_reduce, timeout=20) == [2.0, 2.0]
    assert dist2.pids == pids


# --- in this process ---


@pytest.fixture
def no_torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    if dist.is_initialized():
        pytest.skip("a default process group already exists in the test process")


def test_single_process_needs_no_process_group(no_torchrun_env: None) -> None:
    rt = ParallelRuntime.from_config(Parallel(), device="cpu")
    assert not dist.is_initialized()
    assert (rt.rank, rt.world_size, rt.local_rank, rt.is_main, rt.is_distributed) == (0, 1, 0, True, False)
    assert rt.mesh is None and rt.device == torch.device("cpu")
    assert all(rt.group(dim) is None and rt.size(dim) == 1 and rt.coordinate(dim) == 0 for dim in MESH_DIMS)
    rt.barrier()
    rt.shutdown()
    assert not dist.is_initialized()


def test_single_process_rejects_parallel_degrees(no_torchrun_env: None) -> None:
    with pytest.raises(ValueError, match=r"^Parallel\(ulysses=2, tp=2\) needs 4 processes, got 1"):
        ParallelRuntime.from_config(Parallel(ulysses=2, tp=2))
    assert not dist.is_initialized()


def test_torchrun_mismatch_raises_before_creating_a_group(
    no_torchrun_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ValueError, match=r"^Parallel\(cfg=2, ring=2\) needs 4 processes, got 2"):
        ParallelRuntime.from_config(Parallel(cfg=2, ring=2))
    assert not dist.is_initialized()


def test_torchrun_env_creates_and_shuts_down_a_gloo_group(
    no_torchrun_env: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    rt = ParallelRuntime.from_config(Parallel(), device="cpu", init_method=f"file://{tmp_path / 'store'}")
    try:
        assert dist.is_initialized() and dist.get_backend() == "gloo"
        assert rt.owns_process_group and rt.is_distributed
        assert rt.mesh.mesh_dim_names == MESH_DIMS and tuple(rt.mesh.shape) == (1, 1, 1, 1)
        assert dist.get_process_group_ranks(rt.group("tp")) == [0]
        rt.barrier()
    finally:
        rt.shutdown()
    assert not dist.is_initialized()
    assert rt.mesh is None


def test_unknown_dim_is_rejected(no_torchrun_env: None) -> None:
    rt = ParallelRuntime.from_config(Parallel())
    with pytest.raises(ValueError, match="'sp'"):
        rt.group("sp")
