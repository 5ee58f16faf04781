"""Every cuDNN execution plan of the attention graphs fastdit builds, timed at FLUX.1-dev's attention shape.

cuDNN ranks its plans by a heuristic and fastdit's FP8 attention runs the first that builds. This probe builds every
plan the heuristics offer (modes A, B and the fallback list) for the FP8 graph (`fastdit::cudnn_sdpa_fp8`) and for
the same graph in bf16, with Q/K/V/O in the ``BSHD`` layout the model produces and in a contiguous ``BHSD`` one, and
times each plan (CUDA events, median of 5 rounds of 20 calls) against bf16 SDPA on the same inputs. Each plan's
output is compared with the heuristic's first plan (PSNR), so a fast plan that computes something else shows.

    python benchmarks/probe_cudnn_plans.py --out benchmarks/results/<date>_<device>/cudnn_plans.json
"""

# ruff: noqa: N803 - shape suffixes (x_BSHD) name tensor layouts
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
from fastdit.metrics import json_safe

HEADS, HEAD_DIM = 24, 128
E4M3 = torch.float8_e4m3fn


def median_ms(call: Callable[[], Any], rounds: int = 5, calls: int = 20) -> float:
    """Median over ``rounds`` of the mean time of ``calls`` back-to-back calls."""
    call()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            call()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / calls)
    return statistics.median(times)


def psnr(reference: torch.Tensor, out: torch.Tensor) -> float | str:
    """PSNR in dB against the reference's peak, JSON-safe (``"inf"`` where the two are identical)."""
    ref, out = reference.float(), out.float()
    mse = (ref - out).pow(2).mean().item()
    peak = ref.abs().amax().item()
    return json_safe(round(10 * math.log10(peak * peak / mse), 2) if mse > 0 else math.inf)


def layout(x_BSHD: torch.Tensor, name: str) -> torch.Tensor:
    """The tensor in the named layout; its values are always read as ``(B, H, S, D)``."""
    return x_BSHD.contiguous() if name == "bshd" else x_BSHD.transpose(1, 2).contiguous().transpose(1, 2)


def dims(x_BSHD: torch.Tensor) -> tuple[list[int], list[int]]:
    b, s, h, d = x_BSHD.shape
    sb, ss, sh, sd = x_BSHD.stride()
    return [b, h, s, d], [sb, sh, ss, sd]


def build(cudnn: Any, handle: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, fp8: bool):
    """The graph with every plan built, and its tensor handles in the order of :func:`variant`."""
    io = cudnn.data_type.FP8_E4M3 if fp8 else cudnn.data_type.BFLOAT16
    fp32 = cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=io, intermediate_data_type=fp32, compute_data_type=fp32, handle=handle)
    tq, tk, tv = (
        graph.tensor(name=n, dim=dims(x)[0], stride=dims(x)[1], data_type=io)
        for n, x in zip("qkv", (q, k, v), strict=True)
    )
    scale = 1.0 / math.sqrt(HEAD_DIM)
    if fp8:
        scalar = {"dim": [1, 1, 1, 1], "stride": [1, 1, 1, 1], "data_type": fp32}
        names = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
        scalars = [graph.tensor(name=n, **scalar) for n in names]
        o, _, amax_s, amax_o = graph.sdpa_fp8(
            q=tq, k=tk, v=tv, descale_q=scalars[0], descale_k=scalars[1], descale_v=scalars[2],
            descale_s=scalars[3], scale_s=scalars[4], scale_o=scalars[5], generate_stats=False,
            attn_scale=scale, use_causal_mask=False,
        )  # fmt: skip
        extra = [*scalars, amax_s, amax_o]
        for amax in (amax_s, amax_o):
            amax.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(fp32)
    else:
        o, _ = graph.sdpa(q=tq, k=tk, v=tv, generate_stats=False, attn_scale=scale, use_causal_mask=False)
        extra = []
    o.set_output(True).set_dim(dims(out)[0]).set_stride(dims(out)[1]).set_data_type(io)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans(cudnn.build_plan_policy.ALL)
    return graph, [tq, tk, tv, o, *extra]


def run_case(cudnn: Any, handle: Any, tokens: int, fp8: bool, name: str) -> dict[str, Any]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (1, tokens, HEADS, HEAD_DIM)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    reference = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    sdpa_ms = median_ms(lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)))
    dtype = E4M3 if fp8 else torch.bfloat16
    amax = [x.abs().amax().float() for x in (q, k, v)]
    cast = [(x.float() * (448.0 / a)).to(dtype) if fp8 else x for x, a in zip((q, k, v), amax, strict=True)]
    ins = [layout(x, name) for x in cast]
    out = layout(torch.empty(shape, device="cuda", dtype=dtype), name)
    graph, handles = build(cudnn, handle, *ins, out, fp8)
    values: list[torch.Tensor] = [*ins, out]
    if fp8:
        one = torch.ones(1, 1, 1, 1, device="cuda")
        dq, dk, dv = ((a / 448.0).reshape(1, 1, 1, 1) for a in amax)
        values += [dq, dk, dv, one / 448.0, one * 448.0, 1.0 / dv, one.clone(), one.clone()]
    pack = dict(zip(handles, values, strict=True))
    count = graph.get_execution_plan_count()
    workspace = torch.empty(
        max([graph.get_workspace_size_plan_at_index(i) for i in range(count)] + [1]), dtype=torch.uint8, device="cuda"
    )
    flops = 4 * tokens * tokens * HEAD_DIM * HEADS
    plans = []
    for index in range(count):
        row: dict[str, Any] = {"index": index, "name": graph.get_plan_name_at_index(index)}
        try:
            graph.execute_plan_at_index(pack, workspace, index=index, handle=handle)
            torch.cuda.synchronize()
            result = out.float() * (values[6] if fp8 else 1.0)
            row["psnr_vs_sdpa_bf16"] = psnr(reference, result)
            ms = median_ms(lambda i=index: graph.execute_plan_at_index(pack, workspace, index=i, handle=handle))
            row.update(ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1))
        except Exception as exc:  # a plan may build yet refuse this shape: that is a finding, not a failure
            row["error"] = str(exc).splitlines()[0][:200]
        plans.append(row)
        print(f"  {'fp8' if fp8 else 'bf16'} {name} {tokens} plan {index}: {row}", flush=True)
    return {
        "tokens": tokens,
        "dtype": "fp8" if fp8 else "bf16",
        "layout": name,
        "sdpa_bf16_ms": round(sdpa_ms, 4),
        "sdpa_bf16_tflops": round(flops / sdpa_ms / 1e9, 1),
        "plans": plans,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", default="4608,9216", help="Comma-separated sequence lengths.")
    args = parser.parse_args()
    import cudnn

    handle = cudnn.create_handle()
    cudnn.set_stream(handle, torch.cuda.current_stream().cuda_stream)
    cases = [
        run_case(cudnn, handle, int(tokens), fp8, name)
        for tokens in args.tokens.split(",")
        for fp8 in (True, False)
        for name in ("bshd", "bhsd")
    ]
    header = f"{'dtype':5} {'layout':6} {'tokens':>6} {'sdpa bf16 ms':>12} {'first plan ms':>13} {'best plan ms':>12}"
    print(f"\n{header} best")
    for case in cases:
        timed = [p for p in case["plans"] if "ms" in p]
        best = min(timed, key=lambda p: p["ms"]) if timed else {}
        first = timed[0]["ms"] if timed else float("nan")
        print(
            f"{case['dtype']:5} {case['layout']:6} {case['tokens']:>6} {case['sdpa_bf16_ms']:>12.4f} {first:>13.4f} "
            f"{best.get('ms', float('nan')):>12.4f} {best.get('name', '-')}"
        )
    write_json(
        args.out,
        {
            "benchmark": "probe_cudnn_plans",
            "device": device_name(torch.device("cuda")),
            "torch": torch.__version__,
            "cudnn": torch.backends.cudnn.version(),
            "frontend": cudnn.__version__,
            "cases": cases,
        },
    )


if __name__ == "__main__":
    main()
