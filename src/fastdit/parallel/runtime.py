"""The process group and device mesh the engine runs on.

:class:`ParallelRuntime` answers "which rank am I, on which device, and which group do I talk to for each kind of
parallelism". It reuses a process group the caller already created, creates one when launched by ``torchrun``, and
needs none at all for a single process. The mesh always has the four dims of :data:`MESH_DIMS`, size-1 ones included,
so code can ask for ``group("ulysses")`` without first checking which techniques are enabled.

Every group it creates — the default one under ``torchrun``, each mesh dim's, the flattened ones — waits
:attr:`Parallel.timeout_s` for the other ranks: torch would give sub-groups its own default (10 minutes for NCCL, 30
for gloo) whatever the default group's timeout, so one stalled rank would hang the others that long.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fastdit.config import Parallel
from fastdit.errors import FastditWarning
from fastdit.parallel.topology import CHATTY_DIMS, Topology, better_layout, gather_topology

__all__ = ["MESH_DIMS", "ParallelRuntime", "group_options", "sum_reducer"]

# Outermost to innermost: ranks adjacent in number (same node, fastest links) share the innermost dims, which carry
# the most traffic (tensor parallel every layer, Ulysses all-to-all every attention); CFG ranks exchange almost nothing.
MESH_DIMS: tuple[str, ...] = ("cfg", "ring", "ulysses", "tp")

# One mesh per (world group, device type, shape, timeout): building a mesh creates sub-groups collectively, so
# repeated runtimes in one process (accelerate, disable, accelerate again) reuse it instead of leaking groups.
_MESHES: dict[tuple[str, tuple[int, ...], float], tuple[object, DeviceMesh]] = {}


def _describe(parallel: Parallel) -> str:
    degrees = [f"{name}={getattr(parallel, name)}" for name in MESH_DIMS if getattr(parallel, name) != 1]
    return f"Parallel({', '.join(degrees)})"


def _launched_by_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def _env_int(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r}: must be an integer") from None


def _process_count() -> int:
    """How many processes this run has, read without any collective (so a mismatch never hangs a rank)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    if _launched_by_torchrun():
        return _env_int("WORLD_SIZE")
    return 1


def _check_world_size(parallel: Parallel, num_processes: int) -> None:
    if parallel.world_size != num_processes:
        noun = "process" if parallel.world_size == 1 else "processes"
        raise ValueError(
            f"{_describe(parallel)} needs {parallel.world_size} {noun}, got {num_processes} "
            f"(world_size = cfg × ring × ulysses × tp must equal the number of processes)"
        )


def _local_rank(rank: int) -> int:
    return _env_int("LOCAL_RANK") if "LOCAL_RANK" in os.environ else rank


def _resolve_device(device: torch.device | str | None, local_rank: int) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        num_gpus = torch.cuda.device_count()
        if local_rank >= num_gpus:
            raise ValueError(f"local rank {local_rank} has no CUDA device: only {num_gpus} visible")
        device = torch.device("cuda", local_rank)
    return device


def _init_from_env(device: torch.device, init_method: str | None, timeout_s: float) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = dist.get_default_backend_for_device(device)
    dist.init_process_group(
        backend,
        init_method=init_method or "env://",
        rank=_env_int("RANK"),
        world_size=_env_int("WORLD_SIZE"),
        timeout=timedelta(seconds=timeout_s),
    )


def group_options(timeout_s: float) -> dist.Backend.Options:
    """Options that give a sub-group of the default group's backend a timeout of ``timeout_s`` seconds.

    NCCL takes only its own options class; gloo reads nothing but the timeout, which the device mesh passes on.
    """
    if dist.is_nccl_available() and "nccl" in str(dist.get_backend()):
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False  # what new_group gives NCCL groups without options
    else:
        options = dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=timeout_s)
    return options


def _mesh(device_type: str, shape: tuple[int, ...], timeout_s: float) -> DeviceMesh:
    world = dist.group.WORLD
    key = (device_type, shape, timeout_s)
    cached = _MESHES.get(key)
    if cached is not None and cached[0] is world:
        return cached[1]
    options = group_options(timeout_s)
    mesh = init_device_mesh(
        device_type, shape, mesh_dim_names=MESH_DIMS, backend_override=dict.fromkeys(MESH_DIMS, options)
    )
    _MESHES[key] = (world, mesh)
    return mesh


class ParallelRuntime:
    """Rank, device and per-dimension process groups of one run.

    Build it with :meth:`from_config`. In a single process with every degree 1 there is no process group:
    :attr:`mesh` is ``None``, :meth:`group` returns ``None`` and :meth:`barrier` does nothing.

    Attributes:
        parallel: The parallel configuration this runtime was built for.
        rank: Global rank of this process.
        world_size: Number of processes.
        local_rank: Rank on this node (``LOCAL_RANK`` under ``torchrun``).
        device: The device this rank computes on.
        mesh: Device mesh with dims :data:`MESH_DIMS`, or ``None`` without a process group.
        owns_process_group: Whether this runtime created the default process group (and :meth:`shutdown` ends it).
        topology: Which node each rank runs on and which dims' groups span nodes
            (:class:`~fastdit.parallel.topology.Topology`).
    """

    def __init__(
        self,
        parallel: Parallel,
        *,
        rank: int,
        world_size: int,
        local_rank: int,
        device: torch.device,
        mesh: DeviceMesh | None,
        owns_process_group: bool,
    ) -> None:
        self.parallel = parallel
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.device = device
        self.mesh = mesh
        self.owns_process_group = owns_process_group
        self.topology = Topology((0,) * world_size, ())  # one node until gather_topology says otherwise

    @classmethod
    def from_config(
        cls, parallel: Parallel, device: torch.device | str | None = None, *, init_method: str | None = None
    ) -> ParallelRuntime:
        """Build the runtime for ``parallel`` in this process.

        Reuses the default process group if one exists; otherwise creates one when launched by ``torchrun``
        (``WORLD_SIZE`` and ``RANK`` set; NCCL on CUDA, gloo on CPU). A single process needs no group.

        Args:
            parallel: Degrees of parallelism; their product must equal the number of processes.
            device: Device to compute on. ``None``: ``cuda:<local rank>`` if CUDA is available, else CPU.
            init_method: Rendezvous URL used when a process group is created (default ``env://``).

        Raises:
            ValueError: ``parallel.world_size`` differs from the number of processes. Raised on every rank before
                any collective, so no rank is left waiting.
        """
        _check_world_size(parallel, _process_count())
        owns_group = False
        if not (dist.is_available() and dist.is_initialized()):
            if not _launched_by_torchrun():
                return cls._single_process(parallel, device)
            device = _resolve_device(device, _local_rank(_env_int("RANK")))
            _init_from_env(device, init_method, parallel.timeout_s)
            owns_group = True
        rank = dist.get_rank()
        local_rank = _local_rank(rank)
        device = _resolve_device(device, local_rank)
        shape = tuple(getattr(parallel, name) for name in MESH_DIMS)
        mesh = _mesh(device.type, shape, parallel.timeout_s)
        runtime = cls(
            parallel,
            rank=rank,
            world_size=dist.get_world_size(),
            local_rank=local_rank,
            device=device,
            mesh=mesh,
            owns_process_group=owns_group,
        )
        # Every rank builds its runtime at the same point of accelerate: the one collective that finds the nodes.
        runtime.topology = gather_topology(mesh.mesh, MESH_DIMS, device)
        runtime._warn_if_chatty_dims_cross_nodes()
        return runtime

    def _warn_if_chatty_dims_cross_nodes(self) -> None:
        crossing = [d for d in self.topology.spanning if d in CHATTY_DIMS]
        if not crossing or not self.is_main:
            return
        better = better_layout(self.parallel, self.topology.ranks_per_node)
        hint = f"; {_describe(better)} keeps them inside a node" if better is not None else ""
        warnings.warn(
            f"{_describe(self.parallel)} on {self.topology.num_nodes} nodes of {self.topology.ranks_per_node} ranks: "
            f"the {' and '.join(crossing)} groups cross nodes, so their collectives (every layer or attention) "
            f"run over the inter-node link{hint}",
            FastditWarning,
            stacklevel=3,
        )

    @classmethod
    def _single_process(cls, parallel: Parallel, device: torch.device | str | None) -> ParallelRuntime:
        device = _resolve_device(device, 0)
        return cls(parallel, rank=0, world_size=1, local_rank=0, device=device, mesh=None, owns_process_group=False)

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0, the rank that writes outputs and logs."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        """Whether a process group backs this runtime."""
        return self.mesh is not None

    def size(self, dim: str) -> int:
        """Degree of mesh dimension ``dim`` (one of :data:`MESH_DIMS`)."""
        _check_dim(dim)
        return getattr(self.parallel, dim)

    def coordinate(self, dim: str) -> int:
        """This rank's index within its group along ``dim`` (0 without a process group)."""
        _check_dim(dim)
        return 0 if self.mesh is None else self.mesh.get_local_rank(dim)

    def group(self, dim: str) -> dist.ProcessGroup | None:
        """The process group of this rank along ``dim``, or ``None`` without a process group."""
        _check_dim(dim)
        return None if self.mesh is None else self.mesh.get_group(dim)

    def sample_group(self) -> dist.ProcessGroup | None:
        """The ranks that compute the same sample together (every mesh dim but ``cfg``), or ``None`` if just one.

        Decisions taken on host values inside a transformer call (a cache skipping blocks) must be equal on these
        ranks, since they meet in collectives inside the call; CFG ranks run different branches and never do.
        """
        if self.mesh is None:
            return None
        dims = tuple(d for d in MESH_DIMS if d != "cfg" and self.size(d) > 1)
        if not dims:
            return None
        if len(dims) == 1:
            return self.mesh.get_group(dims[0])
        return self.flat_group(dims)

    def flat_group(self, dims: tuple[str, ...]) -> dist.ProcessGroup:
        """One group over several mesh dims (the first one outermost in rank order), with this runtime's timeout.

        Raises:
            ValueError: Without a process group.
        """
        return self.flat_mesh(dims).get_group()

    def flat_mesh(self, dims: tuple[str, ...]) -> DeviceMesh:
        """A 1-D device mesh over several mesh dims (the first one outermost in rank order), as :meth:`flat_group`.

        Raises:
            ValueError: Without a process group.
        """
        for dim in dims:
            _check_dim(dim)
        if self.mesh is None:
            raise ValueError(f"mesh dims {dims}: this runtime has no process group")
        return self.mesh[dims]._flatten("fastdit_" + "_".join(dims), backend_override=self._options())

    def world_mesh(self) -> DeviceMesh:
        """A 1-D device mesh over every rank of the job, in global rank order (every dim of :data:`MESH_DIMS`).

        For work every rank does alike whatever its place in the layout (the text encoders, which see the same
        prompts on every rank, CFG ranks included).

        Raises:
            ValueError: Without a process group.
        """
        return self.flat_mesh(MESH_DIMS)

    def _options(self) -> dist.Backend.Options:
        return group_options(self.parallel.timeout_s)

    def sample_reducer(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """A function summing a small tensor over :meth:`sample_group` (``None`` when the group has one rank)."""
        group = self.sample_group()
        return None if group is None else sum_reducer(group)

    def barrier(self) -> None:
        """Wait until every rank reaches this point (no-op in a single process)."""
        if self.mesh is None:
            return
        if self.device.type == "cuda":
            # Without device_ids NCCL guesses the device from the rank, which is wrong on multi-node runs.
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    def shutdown(self) -> None:
        """Destroy the default process group if this runtime created it."""
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
            _MESHES.clear()
            self.mesh = None
        self.owns_process_group = False

    def __repr__(self) -> str:
        layout = "×".join(f"{name}{getattr(self.parallel, name)}" for name in MESH_DIMS)
        return f"ParallelRuntime(rank={self.rank}/{self.world_size}, device={self.device}, mesh={layout})"


def sum_reducer(group: dist.ProcessGroup | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function that sums a small tensor over ``group`` (every rank of the group must call it alike)."""

    def reduce(t: torch.Tensor) -> torch.Tensor:
        out = t.detach().clone().contiguous()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    return reduce


def _check_dim(dim: str) -> None:
    if dim not in MESH_DIMS:
        raise ValueError(f"mesh dim {dim!r}: must be one of {MESH_DIMS}")
