"""FP8 GEMM rates at FLUX.1-dev's shapes, and the single blocks' GELU + concatenation + FP8 cast kernel, in isolation.

Two questions the per-call profile of static FP8 leaves open:

1. **How far are the GEMMs from what cuBLAS does at their shapes, and what would fusing the projections that share
   an input buy?** Every FP8 matmul of a FLUX.1-dev call (per-tensor scales, bf16 output with bias, fast accumulation,
   as fastdit's static mode runs them) is timed alone, beside the fused variants — Q/K/V as one matmul, and the
   single blocks' Q/K/V and MLP input projection as one — and a large square matmul as the ceiling.
2. **What does the concatenation kernel cost when written for its layout?** inductor's kernel for the single blocks'
   ``cast(cat([descale(attention), gelu(mlp)]))`` indexes each element with ``% 15360`` and masks both loads. The
   probe times it (compiled from the same expression) against a Triton kernel whose 2-D tiles lie wholly inside one
   part, with the precise ``tanh`` and with ``tanh.approx``, and counts the FP8 values that differ.

CUDA events, median of 5 rounds of 20 calls.

    python benchmarks/probe_fp8_producers.py --out benchmarks/results/<date>_<device>/fp8_producers.json
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from probe_cudnn_plans import median_ms

from fastdit.bench import device_name
from fastdit.bench.report import markdown_table
from fastdit.io import write_json

E4M3 = torch.float8_e4m3fn
DIM, MLP, IMG, TXT = 3072, 12288, 4096, 512
SINGLE, DOUBLE = 38, 19

# (name, M, K, N, calls per transformer call) of every FP8 matmul fastdit's static mode runs.
UNFUSED = [
    ("single q/k/v", IMG + TXT, DIM, DIM, 3 * SINGLE),
    ("single proj_mlp", IMG + TXT, DIM, MLP, SINGLE),
    ("single proj_out", IMG + TXT, DIM + MLP, DIM, SINGLE),
    ("double image q/k/v/out", IMG, DIM, DIM, 4 * DOUBLE),
    ("double image ff in", IMG, DIM, MLP, DOUBLE),
    ("double image ff out", IMG, MLP, DIM, DOUBLE),
    ("double text q/k/v/out", TXT, DIM, DIM, 4 * DOUBLE),
    ("double text ff in", TXT, DIM, MLP, DOUBLE),
    ("double text ff out", TXT, MLP, DIM, DOUBLE),
]
# (name, M, K, N, calls, the unfused rows it replaces with their call counts)
FUSED = [
    ("single q/k/v fused", IMG + TXT, DIM, 3 * DIM, SINGLE, {"single q/k/v": 3 * SINGLE}),
    (
        "single q/k/v + proj_mlp fused",
        IMG + TXT,
        DIM,
        3 * DIM + MLP,
        SINGLE,
        {"single q/k/v": 3 * SINGLE, "single proj_mlp": SINGLE},
    ),
    ("double image q/k/v fused", IMG, DIM, 3 * DIM, DOUBLE, {"double image q/k/v/out": 3 * DOUBLE}),
    ("double text q/k/v fused", TXT, DIM, 3 * DIM, DOUBLE, {"double text q/k/v/out": 3 * DOUBLE}),
]


def fp8_matmul(m: int, k: int, n: int) -> tuple[Any, float]:
    """A timed FP8 matmul of the given shape, as the static mode runs it, and its FLOPs."""
    a = torch.randn(m, k, device="cuda").to(E4M3)
    w = torch.randn(n, k, device="cuda").to(E4M3)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    sa, sw = torch.tensor(0.02, device="cuda"), torch.tensor(0.01, device="cuda")

    def call() -> torch.Tensor:
        return torch._scaled_mm(a, w.t(), sa, sw, bias=bias, out_dtype=torch.bfloat16, use_fast_accum=True)

    return call, 2.0 * m * k * n


def gemm_rows() -> list[dict[str, Any]]:
    rows = []
    for name, m, k, n, calls, *_rest in [*UNFUSED, *FUSED, ("ceiling (square)", 8192, 8192, 8192, 0)]:
        call, flops = fp8_matmul(m, k, n)
        ms = median_ms(call)
        rows.append({"name": name, "m": m, "k": k, "n": n, "calls": calls, "ms": ms, "tflops": flops / ms / 1e9})
        print(f"{name:32s} {m:5d}x{k:5d}x{n:5d} {ms * 1e3:8.1f} us {flops / ms / 1e9:7.0f} TFLOP/s", flush=True)
    return rows


def fusion_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per transformer call: the unfused matmuls' time, and what each fusion would save."""
    by_name = {r["name"]: r for r in rows}
    total = sum(by_name[name]["ms"] * calls for name, *_, calls in UNFUSED)
    savings = {}
    for name, *_, calls, replaces in FUSED:
        before = sum(by_name[old]["ms"] * count for old, count in replaces.items())
        savings[name] = before - by_name[name]["ms"] * calls
    return {"unfused_ms_per_call": total, "saving_ms_per_call": savings}


def reference_producer(attn: torch.Tensor, attn_scale: torch.Tensor, mlp: torch.Tensor, scale: torch.Tensor):
    """The single block's expression as the model and the static FP8 cast write it."""
    x = torch.cat([attn.to(torch.float32) * attn_scale, F.gelu(mlp, approximate="tanh")], dim=-1)
    return (x.float() / scale).clamp(-448.0, 448.0).to(E4M3)


def triton_producer(fast_tanh: bool, block_m: int = 16, block_n: int = 256):
    """A Triton kernel for :func:`reference_producer` whose tiles never straddle the two parts."""
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    @triton.jit
    def kernel(
        attn_ptr,
        attn_scale_ptr,
        mlp_ptr,
        scale_ptr,
        out_ptr,
        A: tl.constexpr,  # noqa: N803 - the parts' widths
        H: tl.constexpr,  # noqa: N803
        BM: tl.constexpr,  # noqa: N803
        BN: tl.constexpr,  # noqa: N803
        FAST: tl.constexpr,  # noqa: N803
    ):
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        if tl.program_id(1) * BN < A:
            x = tl.load(attn_ptr + rows[:, None] * A + cols[None, :]).to(tl.float32) * tl.load(attn_scale_ptr)
        else:
            x = tl.load(mlp_ptr + rows[:, None] * H + (cols - A)[None, :]).to(tl.float32)
            u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
            if FAST:
                t = tl.inline_asm_elementwise(
                    "tanh.approx.f32 $0, $1;", "=f,f", [u], dtype=tl.float32, is_pure=True, pack=1
                )
            else:
                t = libdevice.tanh(u)
            x = 0.5 * x * (1.0 + t)
        y = tl.clamp(x / tl.load(scale_ptr), -448.0, 448.0).to(tl.float8e4nv)
        tl.store(out_ptr + rows[:, None] * (A + H) + cols[None, :], y)

    def run(attn: torch.Tensor, attn_scale: torch.Tensor, mlp: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        (m, a), h = attn.shape, mlp.shape[1]
        out = torch.empty(m, a + h, device=attn.device, dtype=E4M3)
        grid = (m // block_m, (a + h) // block_n)
        kernel[grid](attn, attn_scale, mlp, scale, out, A=a, H=h, BM=block_m, BN=block_n, FAST=fast_tanh)
        return out

    return run


def producer_rows() -> list[dict[str, Any]]:
    m = IMG + TXT
    attn = (torch.randn(m, DIM, device="cuda") * 100).to(E4M3)
    mlp = torch.randn(m, MLP, device="cuda", dtype=torch.bfloat16) * 2
    attn_scale, scale = torch.tensor(0.01, device="cuda"), torch.tensor(0.01, device="cuda")
    args = (attn, attn_scale, mlp, scale)
    moved = attn.numel() + 2 * mlp.numel() + m * (DIM + MLP)
    reference = torch.compile(reference_producer)
    expected = reference(*args).view(torch.uint8)
    variants = {"inductor (the model's kernel)": reference}
    for bm, bn in ((8, 256), (16, 256), (32, 128), (16, 512)):
        variants[f"Triton {bm}x{bn}, tanh"] = triton_producer(False, bm, bn)
        variants[f"Triton {bm}x{bn}, tanh.approx"] = triton_producer(True, bm, bn)
    rows = []
    for name, fn in variants.items():
        out = fn(*args).view(torch.uint8)
        differ = (out != expected).float().mean().item()
        off = (out.int() - expected.int()).abs().max().item()
        ms = median_ms(lambda fn=fn: fn(*args))
        rows.append({"name": name, "us": ms * 1e3, "tb_s": moved / ms / 1e9, "differ": differ, "max_code_step": off})
        print(f"{name:34s} {ms * 1e3:7.1f} us {moved / ms / 1e9:5.2f} TB/s differ {differ:.2e} step {off}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    gemms = gemm_rows()
    summary = fusion_summary(gemms)
    producers = producer_rows()
    print(
        markdown_table(
            ["matmul", "M×K×N", "calls", "µs", "TFLOP/s"],
            [
                [r["name"], f"{r['m']}×{r['k']}×{r['n']}", r["calls"], f"{r['ms'] * 1e3:.1f}", f"{r['tflops']:.0f}"]
                for r in gemms
            ],
        )
    )
    print(summary)
    print(
        markdown_table(
            ["concatenation kernel", "µs", "TB/s", "FP8 codes differing", "largest code step"],
            [
                [r["name"], f"{r['us']:.1f}", f"{r['tb_s']:.2f}", f"{r['differ']:.1e}", r["max_code_step"]]
                for r in producers
            ],
        )
    )
    write_json(
        args.out,
        {
            "device": device_name(torch.device("cuda")),
            "torch": torch.__version__,
            "gemms": gemms,
            "fusion": summary,
            "producers": producers,
        },
    )


if __name__ == "__main__":
    main()
