"""Ulysses exchanges (async NCCL all-to-all, then wait) recorded in a CUDA graph and replayed on new data.

A one-process NCCL group runs the real collective kernels, so this checks on any single GPU that the exchange code
issues nothing a capture refuses (host reads, unsupported async handling) and that replays read the new inputs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fastdit.parallel.attention.comm import head_to_seq_async, seq_to_head_async

pytestmark = pytest.mark.gpu


@pytest.fixture
def nccl_group(tmp_path: Path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_ulysses_exchange_replays_in_a_cuda_graph(nccl_group) -> None:
    shape = (1, 64, 8, 32)  # (B, S, H, D)
    static = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3)]

    def exchange() -> torch.Tensor:
        q, k, v = seq_to_head_async(static, nccl_group, seq_lens=[[64]] * 3).wait()
        return head_to_seq_async(q + k + v, nccl_group, seq_lens=[64]).wait()

    for _ in range(2):  # warm-up outside the capture: communicator and kernels initialised
        exchange()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = exchange()
    for _ in range(3):
        fresh = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        for s, f in zip(static, fresh, strict=True):
            s.copy_(f)
        graph.replay()
        torch.testing.assert_close(out, fresh[0] + fresh[1] + fresh[2])
