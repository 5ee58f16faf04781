"""Where the ranks of a job are: which node each rank runs on, and which mesh dims' groups cross a node boundary.

The mesh puts the dims that talk most (tensor parallel every layer, Ulysses all-to-all every attention) innermost,
on adjacent ranks, and ``torchrun`` gives each node a contiguous block of ranks, so those groups stay inside a node
whenever their degrees fit in it. When they do not (Ulysses 4 over two nodes of two GPUs), the all-to-all crosses
the slow link at every attention; :func:`better_layout` names a layout with the same ranks that keeps it inside.

A node is identified by its host name and ``torchrun``'s node rank (``GROUP_RANK``), so two launches on one machine
(a loopback test of a multi-node job) count as two nodes.
"""

from __future__ import annotations

import os
import socket
import zlib
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from fastdit.config import Parallel

__all__ = ["CHATTY_DIMS", "Topology", "better_layout", "gather_topology", "node_key"]

# The dims whose collectives run inside every layer or attention: crossing nodes costs the most there.
CHATTY_DIMS: tuple[str, ...] = ("ulysses", "tp")


def node_key() -> int:
    """This process's node as an integer: the same on every rank of one node, different across nodes (no collective)."""
    host = zlib.crc32(socket.gethostname().encode())
    return host * 4096 + int(os.environ.get("GROUP_RANK", "0"))


@dataclass(frozen=True)
class Topology:
    """The nodes of a job and the mesh dims whose groups span several of them.

    Attributes:
        node_of_rank: Node index (0, 1, ... in order of first rank) of every global rank.
        spanning: Mesh dims of size > 1 with at least one group that has ranks on two nodes.
    """

    node_of_rank: tuple[int, ...]
    spanning: tuple[str, ...]

    @property
    def num_nodes(self) -> int:
        """How many nodes the job runs on."""
        return len(set(self.node_of_rank))

    @property
    def ranks_per_node(self) -> int:
        """Ranks on the smallest node."""
        counts = [self.node_of_rank.count(n) for n in set(self.node_of_rank)]
        return min(counts)

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form."""
        return {"nodes": self.num_nodes, "ranks_per_node": self.ranks_per_node, "dims_across_nodes": self.spanning}


def _spanning(mesh: torch.Tensor, dims: tuple[str, ...], node_of_rank: tuple[int, ...]) -> tuple[str, ...]:
    out = []
    for axis, name in enumerate(dims):
        if mesh.shape[axis] == 1:
            continue
        groups = mesh.movedim(axis, -1).reshape(-1, mesh.shape[axis])
        if any(len({node_of_rank[int(r)] for r in group}) > 1 for group in groups):
            out.append(name)
    return tuple(out)


def gather_topology(mesh: torch.Tensor, dims: tuple[str, ...], device: torch.device) -> Topology:
    """Every rank's node (one all-gather over the default group: every rank must call it) and the dims that span.

    Args:
        mesh: The device mesh's rank tensor, one axis per dim of ``dims``.
        dims: The mesh's dim names.
        device: This rank's device (NCCL gathers device tensors).
    """
    mine = torch.tensor([node_key()], dtype=torch.int64, device=device)
    keys = torch.empty(dist.get_world_size(), dtype=torch.int64, device=device)
    # torch 2.13 renamed the collective; the range we support (>= 2.7) has one or the other.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(keys, mine)
    order: dict[int, int] = {}
    node_of_rank = tuple(order.setdefault(int(k), len(order)) for k in keys.tolist())
    return Topology(node_of_rank, _spanning(mesh.cpu(), dims, node_of_rank))


def better_layout(parallel: Parallel, ranks_per_node: int) -> Parallel | None:
    """A layout on the same ranks whose Ulysses and TP groups fit in one node, if ``parallel``'s do not.

    Moves the part of the Ulysses degree that does not fit in a node to the ring (USP): ring attention passes K/V
    to one neighbour per step and hides the transfer behind compute, so it is the one to cross nodes. ``None``
    when ``parallel`` already fits or nothing better exists (TP alone wider than a node).
    """
    inner = parallel.ulysses * parallel.tp
    if inner <= ranks_per_node or parallel.tp > ranks_per_node or ranks_per_node % parallel.tp:
        return None
    ulysses = ranks_per_node // parallel.tp
    while ulysses > 1 and parallel.ulysses % ulysses:
        ulysses -= 1
    if ulysses == parallel.ulysses:
        return None
    return replace(parallel, ulysses=ulysses, ring=parallel.ring * (parallel.ulysses // ulysses))
