"""A job over two "nodes" on one machine: two ``torchrun --nnodes 2`` launches meeting by c10d rendezvous on
loopback (gloo), as they would on two hosts. The image equals one process, whether every rank reads the weights or
one rank of the job (or of each node) reads and broadcasts them; rank 0 alone writes; the layout and which groups
cross nodes are reported; a node that never joins ends the other with an error, not a hang."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

TINY = ["--height", "32", "--width", "32", "--steps", "2", "--quiet"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(port: int, nproc: int, argv: list[str], *extra: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "fastdit-test",
        *extra,
        "-m",
        "fastdit",
        "generate",
        *argv,
    ]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.mark.parametrize(
    ("nproc", "parallel", "load"),
    [
        (1, "ulysses=2", "every-rank"),
        # Rank 0 reads the weights and broadcasts them to the other node (the worker-pool tests of
        # tests/parallel/test_load_broadcast.py cover the same in the default suite).
        pytest.param(1, "ulysses=2", "rank0", marks=pytest.mark.slow),
        pytest.param(2, "ulysses=2,ring=2", "every-rank", marks=pytest.mark.slow),
        # Each node's local rank 0 reads and broadcasts within its node.
        pytest.param(2, "ulysses=2,ring=2", "node-rank0", marks=pytest.mark.slow),
    ],
)
def test_two_nodes_on_loopback_match_one_process(
    tiny_flux_dir: Path, tmp_path: Path, nproc: int, parallel: str, load: str
) -> None:
    out = tmp_path / "cat.png"
    argv = ["--model-path", str(tiny_flux_dir), "--prompt", "a cat", *TINY, "--parallel", parallel]
    argv += ["--compare", "--out", str(out), "--json", "--load", load]
    port = _free_port()
    nodes = [_launch(port, nproc, argv), _launch(port, nproc, argv)]
    results = [node.communicate(timeout=300) for node in nodes]
    for node, (_, stderr) in zip(nodes, results, strict=True):
        assert node.returncode == 0, stderr[-3000:]
    lines = [line for stdout, _ in results for line in stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, "rank 0 of the job alone reports"
    payload = json.loads(lines[0])
    assert payload["world_size"] == 2 * nproc
    assert payload["load"] == load
    assert payload["psnr_min"] == "inf" or payload["psnr_min"] > 100
    assert [p.name for p in tmp_path.iterdir()] == ["cat.png"]
    topology = payload["parallel"]["topology"]
    # Ulysses inside each node, the ring (the dim that talks least) across.
    assert topology["nodes"] == 2 and topology["ranks_per_node"] == nproc
    assert topology["dims_across_nodes"] == (["ulysses"] if nproc == 1 else ["ring"])


def test_a_node_that_never_joins_ends_the_other_with_an_error(tiny_flux_dir: Path) -> None:
    argv = ["--model-path", str(tiny_flux_dir), "--prompt", "a cat", *TINY, "--parallel", "ulysses=2"]
    start = time.monotonic()
    node = _launch(_free_port(), 1, argv, "--rdzv-conf", "join_timeout=5")
    _, stderr = node.communicate(timeout=120)
    assert node.returncode != 0
    assert time.monotonic() - start < 90
    assert "Rendezvous" in stderr or "rendezvous" in stderr
