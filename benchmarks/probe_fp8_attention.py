"""Which FP8 attention kernels this GPU's PyTorch offers, and what each does at FLUX.1-dev's attention shape.

Every candidate is tried on the FLUX.1-dev shape (24 heads x 128, 4,608 tokens, batch 1) and, where it runs, timed
(median of 30 calls after 5 warm-up calls) against bf16 SDPA on the same inputs, with the output's PSNR against it.
A candidate that raises is reported with the first line of its error: that is the answer to "is it installed".

    python benchmarks/probe_fp8_attention.py --out benchmarks/results/<date>_h200_fp8_attention.json
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from fastdit.bench import device_name
from fastdit.io import write_json

HEADS, HEAD_DIM, TOKENS = 24, 128, 4608
FP8 = torch.float8_e4m3fn


def scaled(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head absmax scaling into e4m3 (the scale a real FP8 path would carry)."""
    scale = x.abs().amax(dim=(-2, -1), keepdim=True).float().clamp(min=1e-6) / torch.finfo(FP8).max
    return (x.float() / scale).to(FP8), scale


def candidates(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """Each FP8 attention path worth trying, as a call returning the bf16 output."""
    (q8, qs), (k8, ks), (v8, vs) = scaled(q), scaled(k), scaled(v)

    def sdpa_fp8() -> torch.Tensor:
        return F.scaled_dot_product_attention(q8, k8, v8).to(torch.bfloat16)

    def cudnn_fp8() -> torch.Tensor:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q8, k8, v8).to(torch.bfloat16)

    def flex_fp8() -> torch.Tensor:
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(q8, k8, v8).to(torch.bfloat16)

    def fa3_fp8() -> torch.Tensor:
        import flash_attn_interface  # FlashAttention 3 (Hopper), a separate build

        out = flash_attn_interface.flash_attn_func(
            q8.transpose(1, 2), k8.transpose(1, 2), v8.transpose(1, 2), descale_q=qs, descale_k=ks, descale_v=vs
        )
        return (out[0] if isinstance(out, tuple) else out).transpose(1, 2).to(torch.bfloat16)

    def cudnn_frontend_fp8() -> torch.Tensor:
        from fastdit.parallel.attention.cudnn_fp8 import cudnn_fp8_attention

        return cudnn_fp8_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

    def cudnn_frontend_fp8_kernel() -> torch.Tensor:
        import fastdit.parallel.attention.cudnn_fp8  # noqa: F401 - registers the op

        out8 = torch.ops.fastdit.cudnn_sdpa_fp8(*kernel_inputs, 1.0 / math.sqrt(HEAD_DIM))
        return (out8.float() * kernel_inputs[5]).to(torch.bfloat16).transpose(1, 2)

    kernel_inputs = _kernel_inputs(q, k, v)

    def torchao_fp8() -> torch.Tensor:
        from torchao.prototype.attention import apply_low_precision_attention  # noqa: F401 - FA3 underneath

        raise RuntimeError("torchao's FP8 attention wraps a module and needs FA3 (see fa3_fp8)")

    return {
        "sdpa_fp8_inputs": sdpa_fp8,
        "sdpa_cudnn_fp8_inputs": cudnn_fp8,
        "flex_attention_fp8": flex_fp8,
        "flash_attn_interface_fp8 (FA3)": fa3_fp8,
        "torchao_low_precision_attention": torchao_fp8,
        "cudnn_frontend_sdpa_fp8 (quantize + kernel + dequantize, eager)": cudnn_frontend_fp8,
        "cudnn_frontend_sdpa_fp8 (kernel only)": cudnn_frontend_fp8_kernel,
        "cudnn_frontend_sdpa_fp8 (compiled: quantization fused)": _compiled(cudnn_frontend_fp8),
        "cudnn_frontend_sdpa_fp8 (compiled, in a CUDA graph)": _graphed(_compiled(cudnn_frontend_fp8)),
    }


def _kernel_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Quantized BSHD operands and scales for the bare cuDNN kernel (empty when the package is missing)."""
    try:
        from fastdit.parallel.attention.cudnn_fp8 import quantize_per_tensor
    except ImportError:
        return ()
    (q8, dq), (k8, dk), (v8, dv) = (quantize_per_tensor(x.transpose(1, 2)) for x in (q, k, v))
    return (q8, k8, v8, dq, dk, dv, 1.0 / dv)


def _compiled(call: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    return torch.compile(call, fullgraph=True)


def _graphed(call: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``call`` captured once in a CUDA graph (after warm-up on a side stream) and replayed."""
    state: dict[str, Any] = {}

    def run() -> torch.Tensor:
        if "graph" not in state:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    call()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                state["out"] = call()
            state["graph"] = graph
        state["graph"].replay()
        return state["out"]

    return run


def output_psnr(reference: torch.Tensor, out: torch.Tensor) -> float:
    """PSNR of an attention output against the bf16 one, over the reference's value range (not an image metric)."""
    ref, out = reference.float(), out.float()
    mse = (ref - out).pow(2).mean().item()
    span = (ref.max() - ref.min()).item()
    return round(10 * math.log10(span * span / mse), 2) if mse > 0 else math.inf


def median_ms(call: Callable[[], Any]) -> float:
    for _ in range(5):
        call()
    times = []
    for _ in range(30):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", default=None, help="Run only the candidate whose name contains this text.")
    args = parser.parse_args()
    torch.manual_seed(0)
    shape = (1, HEADS, TOKENS, HEAD_DIM)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    reference = F.scaled_dot_product_attention(q, k, v)
    flops = 4 * TOKENS * TOKENS * HEAD_DIM * HEADS
    rows = [
        {
            "kernel": "sdpa bf16 (default backend)",
            "ok": True,
            "ms": median_ms(lambda: F.scaled_dot_product_attention(q, k, v)),
        }
    ]
    for name, call in candidates(q, k, v).items():
        if args.only is not None and args.only not in name:
            continue
        print("trying", name, flush=True)
        try:
            out = call()
            torch.cuda.synchronize()
            rows.append({"kernel": name, "ok": True, "ms": median_ms(call), "psnr_db": output_psnr(reference, out)})
        except Exception as error:  # the error is the finding
            rows.append(
                {"kernel": name, "ok": False, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
            )
        print(rows[-1], flush=True)
    for row in rows:
        if row.get("ms"):
            row["tflops"] = round(flops / row["ms"] / 1e9, 1)
        print(row, flush=True)
    write_json(args.out, {"device": device_name(torch.device("cuda")), "torch": torch.__version__, "rows": rows})


if __name__ == "__main__":
    main()
