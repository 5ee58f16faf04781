"""Tensor parallelism through a one-rank mesh: bf16 numerics of the split layers and the cost of DTensor dispatch.

One GPU cannot show a TP speed-up, but it shows whether the re-laid, DTensor-wrapped layers compute what the original
ones do in bf16: the transformer is run on fixed random inputs unsplit, then through :func:`apply_tensor_parallel`
on a mesh of one rank (same code path as TP-N: slices cut and re-laid, ColwiseParallel/RowwiseParallel hooks,
ShardedNorm for Wan's QK-norms), and both outputs are compared (PSNR over the output's range, max error). Eager and
compiled forward times of both are reported: the gap is DTensor's per-op dispatch cost, which compile removes.

Models have the real width, heads and FFN size of FLUX.1-dev and Wan 2.1 14B with fewer blocks (numerics are per
layer; depth only scales time), random bf16 weights, residual-branch outputs scaled so the stack stays finite.

    torchrun --nproc-per-node 1 benchmarks/tp_one_gpu.py --out benchmarks/results/<date>_h200_tp/tp_one_gpu.json
    torchrun --nproc-per-node 1 benchmarks/tp_one_gpu.py --tiny      # CPU smoke test over gloo
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import fastdit
from fastdit.bench import device_name, json_ready, markdown_table
from fastdit.io import write_json
from fastdit.models.registry import get_family
from fastdit.parallel.tensor_parallel import apply_tensor_parallel

FLUX = {"num_layers": 4, "num_single_layers": 8, "attention_head_dim": 128, "num_attention_heads": 24,
        "in_channels": 64, "joint_attention_dim": 4096, "pooled_projection_dim": 768, "guidance_embeds": True,
        "axes_dims_rope": (16, 56, 56)}  # fmt: skip
WAN = {"num_layers": 4, "attention_head_dim": 128, "num_attention_heads": 40, "ffn_dim": 13824, "in_channels": 16,
       "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "patch_size": (1, 2, 2)}  # fmt: skip
TINY_FLUX = {**FLUX, "num_layers": 1, "num_single_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2,
             "joint_attention_dim": 32, "pooled_projection_dim": 32, "axes_dims_rope": (4, 6, 6)}  # fmt: skip
TINY_WAN = {**WAN, "num_layers": 2, "attention_head_dim": 8, "num_attention_heads": 2, "ffn_dim": 32, "text_dim": 16,
            "freq_dim": 16}  # fmt: skip


def flux_case(tiny: bool, device: torch.device, dtype: torch.dtype) -> tuple[torch.nn.Module, dict[str, Any]]:
    from diffusers import FluxTransformer2DModel

    config = TINY_FLUX if tiny else FLUX
    with torch.device(device):
        model = FluxTransformer2DModel(**config)
    scale(model, [m for b in model.transformer_blocks for m in (b.attn.to_out[0], b.attn.to_add_out, b.ff.net[2],
                                                                 b.ff_context.net[2])]
          + [b.proj_out for b in model.single_transformer_blocks])  # fmt: skip
    side, text = (4, 8) if tiny else (64, 512)
    g = torch.Generator().manual_seed(1)
    ids = torch.stack(
        torch.meshgrid(torch.zeros(1), torch.arange(float(side)), torch.arange(float(side)), indexing="ij"), -1
    )
    inputs = {
        "hidden_states": torch.randn(1, side * side, config["in_channels"], generator=g),
        "encoder_hidden_states": torch.randn(1, text, config["joint_attention_dim"], generator=g),
        "pooled_projections": torch.randn(1, config["pooled_projection_dim"], generator=g),
        "timestep": torch.tensor([0.5]),
        "guidance": torch.tensor([3.5]),
        "img_ids": ids.reshape(-1, 3),
        "txt_ids": torch.zeros(text, 3),
    }
    return model.to(dtype).eval(), {
        k: v.to(device, dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()
    }


def wan_case(tiny: bool, device: torch.device, dtype: torch.dtype) -> tuple[torch.nn.Module, dict[str, Any]]:
    from diffusers import WanTransformer3DModel

    config = TINY_WAN if tiny else WAN
    with torch.device(device):
        model = WanTransformer3DModel(**config)
    scale(model, [m for b in model.blocks for m in (b.attn1.to_out[0], b.attn2.to_out[0], b.ffn.net[2])])
    frames, side, text = (2, 4, 8) if tiny else (8, 60, 512)  # 8 x 30 x 30 = 7,200 tokens
    g = torch.Generator().manual_seed(1)
    inputs = {
        "hidden_states": torch.randn(1, config["in_channels"], frames, side, side, generator=g),
        "encoder_hidden_states": torch.randn(1, text, config["text_dim"], generator=g),
        "timestep": torch.tensor([500]),
    }
    return model.to(dtype).eval(), {
        k: v.to(device, dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()
    }


CASES: dict[str, tuple[str, Callable[..., tuple[torch.nn.Module, dict[str, Any]]]]] = {
    "flux": ("flux", flux_case),
    "wan": ("wan", wan_case),
}


def scale(model: torch.nn.Module, linears: list[torch.nn.Linear], factor: float = 0.2) -> None:
    """Shrink residual-branch output projections so random blocks stay finite."""
    with torch.no_grad():
        for linear in linears:
            linear.weight.mul_(factor)


def forward(model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0].float()


def timed(run: Callable[[], Any], device: torch.device, repeat: int) -> float:
    run()
    run()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def compare(reference: torch.Tensor, out: torch.Tensor) -> dict[str, float]:
    data_range = float(reference.max() - reference.min())
    mse = float((reference - out).pow(2).mean())
    return {
        "psnr": float("inf") if mse == 0 else 10 * torch.log10(torch.tensor(data_range**2 / mse)).item(),
        "max_abs_err": float((reference - out).abs().max()),
        "bit_identical": bool(torch.equal(reference, out)),
    }


def run_case(name: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    family, build = CASES[name]
    model, inputs = build(args.tiny, device, dtype)
    compiled_blocks = [b for g in get_family(family).block_groups for b in _blocks(model, g.path)]
    reference = forward(model, inputs)
    row: dict[str, Any] = {"model": name, "eager_s": timed(lambda: forward(model, inputs), device, args.repeat)}
    mesh = init_device_mesh(device.type, (1,))
    applied = apply_tensor_parallel(model, get_family(family).tp_plan, mesh, device=device, family=family)
    out = forward(model, inputs)
    row.update(compare(reference, out))
    row["tp1_eager_s"] = timed(lambda: forward(model, inputs), device, args.repeat)
    row["split_layers"] = applied.state.num_split_layers
    row["split_norms"] = applied.state.num_split_norms
    if not args.no_compile:
        for block in compiled_blocks:
            block.compile()
        compiled_out = forward(model, inputs)
        row["tp1_compiled_vs_unsplit"] = compare(reference, compiled_out)["psnr"]
        row["tp1_compiled_s"] = timed(lambda: forward(model, inputs), device, args.repeat)
        for block in compiled_blocks:
            block._compiled_call_impl = None  # back to eager for the unsplit comparison
        torch._dynamo.reset()
    if device.type == "cuda":
        # CUDA graphs of whole calls over the split model: DTensor's hooks and the ShardedNorm collectives replay.
        fastdit.accelerate(model, cuda_graph=fastdit.CudaGraph())
        try:
            row["tp1_graph_vs_unsplit"] = compare(reference, forward(model, inputs))["psnr"]
            row["tp1_graph_s"] = timed(lambda: forward(model, inputs), device, args.repeat)
            row["tp1_graph_replays"] = fastdit.summary(model).transformers["transformer"]["cuda_graph"]
        finally:
            fastdit.disable(model)
    applied.undo()
    restored = forward(model, inputs)
    row["restored_bit_identical"] = bool(torch.equal(reference, restored))
    if not args.no_compile:
        for block in compiled_blocks:
            block.compile()
        row["compiled_s"] = timed(lambda: forward(model, inputs), device, args.repeat)
        for block in compiled_blocks:
            block._compiled_call_impl = None
        torch._dynamo.reset()
    return row


def _blocks(model: torch.nn.Module, path: str) -> list[torch.nn.Module]:
    return list(model.get_submodule(path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny models (CPU smoke test)")
    parser.add_argument("--models", default=",".join(CASES), help=f"comma-separated of {list(CASES)}")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        rows = [run_case(name, args, device, dtype) for name in args.models.split(",")]
    finally:
        dist.destroy_process_group()
    header = ("model", "split layers / norms", "TP-1 vs unsplit PSNR", "max err", "bit-identical", "eager s",
              "TP-1 eager s", "compiled s", "TP-1 compiled s", "TP-1 graphs s", "disable bit-identical")  # fmt: skip
    cells = [
        (
            r["model"],
            f"{r['split_layers']} / {r['split_norms']}",
            f"{r['psnr']:.2f}",
            f"{r['max_abs_err']:.2e}",
            r["bit_identical"],
            f"{r['eager_s'] * 1e3:.1f} ms",
            f"{r['tp1_eager_s'] * 1e3:.1f} ms",
            f"{r.get('compiled_s', float('nan')) * 1e3:.1f} ms",
            f"{r.get('tp1_compiled_s', float('nan')) * 1e3:.1f} ms",
            f"{r.get('tp1_graph_s', float('nan')) * 1e3:.1f} ms",
            r["restored_bit_identical"],
        )
        for r in rows
    ]
    print(f"\nTP through a one-rank mesh, {device_name(device)}, {'tiny' if args.tiny else 'full width'} models\n")
    print(markdown_table(header, cells), end="")
    out = args.out or (Path(os.environ["OUT"]) / "tp_one_gpu.json" if "OUT" in os.environ else None)
    if out is not None:
        payload = {"benchmark": "tp_one_gpu", "date": date.today().isoformat(), "device": device_name(device),
                   "torch": torch.__version__, "tiny": args.tiny, "results": rows}  # fmt: skip
        write_json(out, json_ready(payload))
        print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
