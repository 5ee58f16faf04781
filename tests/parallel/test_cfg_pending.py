"""The placeholder a CFG rank returns for the branch the other rank computes: ops before the fill are replayed.

Pipelines cast or slice the first call's output before the step's second call (``out.float()`` in half precision
copies it); those copies must end up with the other rank's values, and a read of the values before they arrive must
raise instead of returning garbage.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fastdit
from fastdit.parallel.cfg_parallel import CfgParallelError, PendingOutput, _Spec
from fastdit.testing.distributed import WorkerPool


def _pending(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor], object]:
    output, slots, replay = _Spec.of((torch.zeros(shape, dtype=dtype),)).placeholder(torch.device("cpu"))
    return output[0], slots, replay


def test_casts_slices_and_arithmetic_before_the_fill_get_the_filled_values() -> None:
    out, slots, replay = _pending((1, 6, 4), torch.bfloat16)
    cast = out.float()  # a copy: bfloat16 -> float32
    tail = out[:, 2:].to(torch.float32)
    chunks = out.chunk(2, dim=1)
    scaled = cast * 2
    cast.add_(1)  # in place, after `scaled` was taken
    written = out.float()
    written[:, 0] = 5.0  # a write into a placeholder, redone after the fill
    assert isinstance(cast, PendingOutput) and cast.dtype == torch.float32 and tail.shape == (1, 4, 4)
    value = torch.randn(1, 6, 4).to(torch.bfloat16)
    replay.fill(slots, [value])
    expected = value.float()
    assert torch.equal(out, value)
    assert torch.equal(cast, expected + 1)
    assert torch.equal(scaled, expected * 2)
    assert torch.equal(tail, expected[:, 2:])
    assert torch.equal(chunks[1], value[:, 3:])
    assert torch.equal(written[:, 1:], expected[:, 1:]) and bool((written[:, 0] == 5.0).all())
    after = cast - 1  # filled: a plain operation
    assert torch.equal(after, expected) and not isinstance(after, PendingOutput)


def test_reading_values_before_the_fill_raises_and_metadata_does_not() -> None:
    out, _, _ = _pending((2, 3), torch.float32)
    assert out.shape == (2, 3) and out.dim() == 2 and out.dtype == torch.float32 and out.size(0) == 2
    for read in (lambda: out.sum().item(), lambda: bool((out > 0).all()), lambda: out.tolist()):
        with pytest.raises(CfgParallelError, match="read the values of a guidance branch's output"):
            read()


def _run_bf16(rank: int, world_size: int, family: str, variant: str, cfg: bool) -> dict:
    """A tiny pipeline in bfloat16: its transformer outputs are cast to float32 before the step's second call."""
    from fastdit.testing.pipelines import build_tiny, run_tiny

    pipe, tiny = build_tiny(family, variant)
    pipe.to(torch.bfloat16)
    fastdit.accelerate(pipe, parallel=fastdit.Parallel(cfg=2) if cfg else None)
    try:
        out = run_tiny(pipe, tiny, num_inference_steps=3, output_type="latent")
        stats = [t.get("cfg_parallel", {}) for t in fastdit.summary(pipe).transformers.values()]
    finally:
        fastdit.disable(pipe)
    return {"out": out, "skipped": sum(s.get("skipped_calls", 0) for s in stats)}


# BriaFIBO 2.0 casts the first call's output (`.float()`); Ideogram 4 slices the conditional output and casts it, and
# computes the branches with two transformers.
@pytest.mark.distributed
@pytest.mark.parametrize(("family", "variant"), [("bria_fibo2", "t2i"), ("ideogram4", "t2i")])
def test_cfg2_in_bfloat16_matches_one_process(dist2: WorkerPool, family: str, variant: str) -> None:
    expected = _run_bf16(0, 1, family, variant, False)["out"]
    for result in dist2.run(_run_bf16, family, variant, True, timeout=400):
        assert result["skipped"] > 0, "no call was left to the other rank"
        np.testing.assert_array_equal(result["out"], expected)  # the same kernels on the same inputs
