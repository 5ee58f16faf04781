"""GQA under tensor parallelism: the full plan (query and KV heads split) vs FFN-only, against one GPU.

Krea-2-shaped transformer (48 query / 12 KV heads of 128, FFN 16,384; fewer blocks than the 28 of the real model —
time scales with depth), random bf16 weights, 4,096 image + 256 text tokens. Every rank first runs the unsplit
transformer on its own GPU (the one-GPU baseline), then each plan splits it over all ranks: forward time (eager and
compiled), per-GPU weight memory and PSNR against the baseline. Rank 0 prints the table and writes JSON.

    torchrun --nproc-per-node 2 benchmarks/tp_gqa.py --out benchmarks/results/<date>_h200x2_tp/tp_gqa.json
    torchrun --nproc-per-node 2 benchmarks/tp_gqa.py --tiny      # CPU smoke test over gloo
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

from fastdit.bench import device_name, json_ready, markdown_table
from fastdit.io import write_json
from fastdit.models.registry import get_family
from fastdit.parallel.tensor_parallel import apply_tensor_parallel, parameter_bytes

KREA2 = {"num_layers": 8, "num_layerwise_text_blocks": 1, "num_refiner_text_blocks": 1}
TINY = {"num_layers": 2, "attention_head_dim": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 64, "timestep_embed_dim": 16, "text_hidden_dim": 32, "num_text_layers": 2,
        "text_num_attention_heads": 2, "text_num_key_value_heads": 2, "text_intermediate_size": 32,
        "num_layerwise_text_blocks": 1, "num_refiner_text_blocks": 1, "axes_dims_rope": (4, 6, 6)}  # fmt: skip


def build(tiny: bool, device: torch.device, dtype: torch.dtype) -> tuple[torch.nn.Module, dict[str, Any]]:
    from diffusers import Krea2Transformer2DModel

    torch.manual_seed(0)
    config = TINY if tiny else KREA2
    with torch.device(device):
        model = Krea2Transformer2DModel(**config)
    with torch.no_grad():  # residual outputs scaled down so random blocks stay finite
        for name, p in model.named_parameters():
            if name.startswith("transformer_blocks") and name.endswith(("to_out.0.weight", "down.weight")):
                p.mul_(0.2)
    side, text = (4, 8) if tiny else (64, 256)
    cfg = model.config
    g = torch.Generator().manual_seed(1)
    grid = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(float(side)), torch.arange(float(side)),
                                      indexing="ij"), -1).reshape(-1, 3)  # fmt: skip
    inputs = {
        "hidden_states": torch.randn(1, side * side, cfg.in_channels, generator=g),
        "encoder_hidden_states": torch.randn(1, text, cfg.num_text_layers, cfg.text_hidden_dim, generator=g),
        "timestep": torch.tensor([0.5]),
        "position_ids": torch.cat([torch.zeros(text, 3), grid]),
    }
    inputs = {k: v.to(device, dtype if k != "position_ids" else v.dtype) for k, v in inputs.items()}
    return model.to(dtype).eval(), inputs


def forward(model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0].float()


def timed(run: Callable[[], Any], device: torch.device, repeat: int) -> float:
    for _ in range(2):
        run()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    t = torch.tensor([statistics.median(times)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def psnr(reference: torch.Tensor, out: torch.Tensor) -> float:
    mse = float((reference - out).pow(2).mean())
    data_range = float(reference.max() - reference.min())
    return float("inf") if mse == 0 else 10 * float(torch.log10(torch.tensor(data_range**2 / mse)))


def measure(model: torch.nn.Module, inputs: dict[str, Any], args, device, reference) -> dict[str, Any]:
    row = {"eager_s": timed(lambda: forward(model, inputs), device, args.repeat)}
    row["psnr"] = psnr(reference, forward(model, inputs))
    row["weights_gib"] = round(parameter_bytes(model) / 2**30, 3)
    if not args.no_compile:
        blocks = list(model.transformer_blocks)
        for block in blocks:
            block.compile()
        row["compiled_s"] = timed(lambda: forward(model, inputs), device, args.repeat)
        for block in blocks:
            block._compiled_call_impl = None
        torch._dynamo.reset()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    dtype = torch.bfloat16 if cuda else torch.float32
    plan = get_family("krea2").tp_plan
    rows = []
    try:
        model, inputs = build(args.tiny, device, dtype)
        reference = forward(model, inputs)
        rows.append({"mode": "one GPU", "degree": 1, **measure(model, inputs, args, device, reference)})
        mesh = init_device_mesh(device.type, (world,))
        for candidate in (plan, plan.fallback):
            applied = apply_tensor_parallel(model, candidate, mesh, device=device, family="krea2")
            try:
                rows.append({"mode": f"TP-{world} {candidate.name}", "degree": world,
                             **measure(model, inputs, args, device, reference)})  # fmt: skip
            finally:
                applied.undo()
    finally:
        dist.destroy_process_group()
    if local_rank != 0:
        return
    base = rows[0]
    header = ("mode", "eager", "speed-up", "compiled", "speed-up", "weights GiB/GPU", "PSNR vs one GPU")
    cells = [
        (
            r["mode"],
            f"{r['eager_s'] * 1e3:.1f} ms",
            f"{base['eager_s'] / r['eager_s']:.2f}x",
            f"{r.get('compiled_s', float('nan')) * 1e3:.1f} ms",
            f"{base.get('compiled_s', float('nan')) / r.get('compiled_s', float('nan')):.2f}x",
            r["weights_gib"],
            f"{r['psnr']:.2f}",
        )
        for r in rows
    ]
    print(f"\nKrea-2-shaped GQA transformer, {world} x {device_name(device)}\n")
    print(markdown_table(header, cells), end="")
    out = args.out or (Path(os.environ["OUT"]) / "tp_gqa.json" if "OUT" in os.environ else None)
    if out is not None:
        payload = {"benchmark": "tp_gqa", "date": date.today().isoformat(), "device": device_name(device),
                   "world_size": world, "tiny": args.tiny, "results": rows}  # fmt: skip
        write_json(out, json_ready(payload))
        print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
