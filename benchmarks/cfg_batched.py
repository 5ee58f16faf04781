"""Batched CFG over two ranks: a PixArt-Σ-shaped pipeline (one transformer call over [uncond; cond] per step).

The transformer has PixArt-Σ's shape (28 blocks, 16 heads of 72, 4,096-wide T5 text of 300 tokens) with random
bf16 weights; the pipeline gets ``prompt_embeds`` / ``negative_prompt_embeds``, so no text encoder is loaded, and
returns latents (no VAE). Every rank runs the one-GPU baseline, then ``cfg=2`` (each rank computes its half of the
CFG batch), eager and with compiled blocks; rank 0 prints the table and writes JSON.

    torchrun --nproc-per-node 2 benchmarks/cfg_batched.py --out benchmarks/results/<date>_h200x2_cfg/cfg_batched.json
    torchrun --nproc-per-node 2 benchmarks/cfg_batched.py --tiny     # CPU smoke test over gloo
"""

from __future__ import annotations

import argparse
import os
import statistics
from datetime import date
from pathlib import Path
from typing import Any

import torch

import fastdit
from fastdit.bench import device_name, json_ready, markdown_table, time_calls
from fastdit.io import write_json
from fastdit.metrics import psnr
from fastdit.process import choose_device, join_process_group, max_across_processes, process_group_scope

SIGMA = {"num_layers": 28, "num_attention_heads": 16, "attention_head_dim": 72, "in_channels": 4, "out_channels": 8,
         "cross_attention_dim": 1152, "caption_channels": 4096, "sample_size": 128, "use_additional_conditions": False,
         "norm_type": "ada_norm_single", "interpolation_scale": 2}  # fmt: skip
TINY = {**SIGMA, "num_layers": 2, "num_attention_heads": 2, "attention_head_dim": 8, "cross_attention_dim": 16,
        "caption_channels": 16, "sample_size": 8}  # fmt: skip


def build(tiny: bool, device: torch.device, dtype: torch.dtype) -> Any:
    from diffusers import DPMSolverMultistepScheduler, PixArtSigmaPipeline, PixArtTransformer2DModel

    torch.manual_seed(0)
    with torch.device(device):
        transformer = PixArtTransformer2DModel(**(TINY if tiny else SIGMA))
    with torch.no_grad():  # residual outputs scaled down so random blocks stay finite
        for block in transformer.transformer_blocks:
            for linear in (block.attn1.to_out[0], block.attn2.to_out[0], block.ff.net[2]):
                linear.weight.mul_(0.2)
    scheduler = DPMSolverMultistepScheduler()
    pipe = PixArtSigmaPipeline(
        tokenizer=None, text_encoder=None, vae=None, transformer=transformer.to(dtype).eval(), scheduler=scheduler
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def kwargs_for(tiny: bool, device: torch.device, dtype: torch.dtype, steps: int, size: int) -> dict[str, Any]:
    config = TINY if tiny else SIGMA
    g = torch.Generator().manual_seed(1)
    tokens = 8 if tiny else 300

    def text() -> torch.Tensor:
        return torch.randn(1, tokens, config["caption_channels"], generator=g).to(device, dtype)

    mask = torch.ones(1, tokens, device=device, dtype=torch.long)
    return {
        "prompt_embeds": text(),
        "prompt_attention_mask": mask,
        "negative_prompt": None,
        "negative_prompt_embeds": text(),
        "negative_prompt_attention_mask": mask,
        "guidance_scale": 4.5,
        "num_inference_steps": steps,
        "height": size,
        "width": size,
        "output_type": "latent",
        "use_resolution_binning": False,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with process_group_scope():
        device = choose_device()
        join_process_group(device)
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        steps = args.steps or (4 if args.tiny else 20)
        size = 64 if args.tiny else 1024
        pipe = build(args.tiny, device, dtype)
        kwargs = kwargs_for(args.tiny, device, dtype, steps, size)

        def call() -> torch.Tensor:
            return pipe(**kwargs, generator=torch.Generator(device).manual_seed(0)).images.float()

        rows, base = [], None
        world = int(os.environ.get("WORLD_SIZE", "1"))
        for mode in ("single", "cfg", "single+compile", "cfg+compile"):
            if mode.startswith("cfg") and world != 2:
                print(f"skipping {mode}: needs 2 processes under torchrun")
                continue
            compile_config = fastdit.Compile() if "compile" in mode else None
            parallel = fastdit.Parallel(cfg=2) if mode.startswith("cfg") else None
            if compile_config or parallel:
                fastdit.accelerate(pipe, parallel=parallel, compile=compile_config)
            try:
                out, times = time_calls(call, device, warmup=1, repeat=args.repeat, across_processes=True)
                seconds = max_across_processes(statistics.median(times), device)
            finally:
                if compile_config or parallel:
                    fastdit.disable(pipe)
                    torch._dynamo.reset()
            base = base if base is not None else (out, seconds)
            reference = base[0].cpu().numpy()
            latent_psnr = psnr(reference, out.cpu().numpy(), data_range=float(reference.max() - reference.min()))
            rows.append({"mode": mode, "seconds": round(seconds, 4), "latent_psnr": latent_psnr,
                         "latent_max_abs_err": float((out - base[0]).abs().max())})  # fmt: skip
        if int(os.environ.get("RANK", "0")) != 0:
            return
    by_mode = {r["mode"]: r for r in rows}
    cells = [
        (r["mode"], f"{r['seconds']:.3f}",
         f"{by_mode['single' if 'compile' not in r['mode'] else 'single+compile']['seconds'] / r['seconds']:.2f}x",
         f"{r['latent_psnr']:.2f}")
        for r in rows
    ]  # fmt: skip
    print(f"\nPixArt-Σ-shaped batched CFG, {size}x{size}, {steps} steps, {device_name(device)}\n")
    print(
        markdown_table(("mode", "seconds", "speed-up vs same mode on one GPU", "latent PSNR vs single (dB)"), cells),
        end="",
    )
    out = args.out or (Path(os.environ["OUT"]) / "cfg_batched.json" if "OUT" in os.environ else None)
    if out is not None:
        payload = {"benchmark": "cfg_batched", "date": date.today().isoformat(), "device": device_name(device),
                   "steps": steps, "size": size, "tiny": args.tiny, "results": rows}  # fmt: skip
        write_json(out, json_ready(payload))
        print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
