"""Context parallelism on a FLUX.1-dev-sized transformer: one GPU vs Ulysses vs ring (fastdit), time and quality.

The transformer has FLUX.1-dev's shape with random bf16 weights built directly on the device; the residual-branch
output projections are scaled by 0.2 so 57 random blocks stay finite. The pipeline gets ``prompt_embeds`` and
``pooled_prompt_embeds``, so no text encoder is loaded; the VAE is FLUX-shaped with random weights. Every mode runs
the same seeds; quality is PSNR/SSIM of the decoded images (and PSNR of the latents) against the single-device run.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        torchrun --nproc_per_node 2 benchmarks/cp_flux.py --out benchmarks/results/cp_flux_h200x2.json
    torchrun --nproc_per_node 2 benchmarks/cp_flux.py --tiny          # CPU smoke test over gloo, seconds

Every rank runs the single-device baseline on its own device (concurrently), then each parallel mode; rank 0 prints a
markdown table and writes JSON (to ``--out``, else ``$OUT/cp_flux.json`` when ``OUT`` is set).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path
from typing import Any

for _name in ("NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS", "TORCH_SYMM_MEM_DISABLE_MULTICAST"):
    # NVLink multicast is unavailable on the machines this runs on; set before torch initialises NCCL.
    os.environ.setdefault(_name, "0" if _name == "NCCL_NVLS_ENABLE" else "1")

import numpy as np  # noqa: E402 - after the NCCL environment
import torch  # noqa: E402

import fastdit  # noqa: E402
from fastdit.bench import compare_outputs, device_name, json_ready, markdown_table, time_calls  # noqa: E402
from fastdit.io import write_json  # noqa: E402
from fastdit.metrics import psnr  # noqa: E402
from fastdit.process import (  # noqa: E402
    choose_device,
    join_process_group,
    max_across_processes,
    process_count,
    process_group_scope,
    process_rank,
    synchronize,
)

FLUX_DEV = {
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": (16, 56, 56),
}
TINY = {**FLUX_DEV, "num_layers": 1, "num_single_layers": 2, "attention_head_dim": 16, "num_attention_heads": 4,
        "joint_attention_dim": 64, "pooled_projection_dim": 32, "axes_dims_rope": (4, 6, 6)}  # fmt: skip
# A fastdit mode is a layout plus options joined by "+", e.g. "ulysses+compile+chunks2".
LAYOUTS = ("single", "ulysses", "ring", "usp", "tp", "tp_ulysses", "cfg", "cfg_ulysses")
# compile: inductor blocks; graph: transformer calls (or, with cache, block calls) replayed as CUDA graphs
# (CudaGraph); cudagraphs: torch.compile's own mode="reduce-overhead"; cache: DBCache F1B0 on a fixed
# schedule computing every other step (random weights never hit a residual threshold: this measures the mechanics).
# blockgraph: CUDA graphs per block (CudaGraph(scope="blocks")) even without a cache.
# q8: FP8 rowwise quantization of the blocks' linears (fastdit.Quantize); cacheK: the fixed schedule computes every
# K-th step (cache = cache2); magP: MagCache preset P (balanced, fast, ultra) with the reference pipeline's packaged
# calibration, so its steps compute on the schedule they compute on there (28 steps only; whole steps skipped);
# vae: with compile, the VAE decoder is compiled too (Compile(vae=True)); ahead: the fixed-schedule DBCache decides
# ahead (DBCache.decide_ahead: its drift statistic is read a step later, so no step waits for the device);
# outer: with compile, the modules outside the blocks are compiled too (Compile(outer=True)); q8s: FP8 with static
# per-tensor activation scales (Quantize(mode="fp8_static")), recorded once on a call with seed + 1 before any mode
# runs; cudnnfp8: cuDNN's fused FP8 attention (Attention(backend="cudnn-fp8"), one GPU); cudnnfp8s: the same with
# static Q/K/V scales per attention module (Attention(scales=...)), recorded in the same calibration as q8s's;
# q8r: q8s with one weight scale per output channel (Quantize(weight_scales="row")); fuse: the projections that
# share an input as one matmul per group (Fuse: each stream's Q/K/V, the single blocks' Q/K/V + proj_mlp).
OPTIONS = (
    "compile",
    "graph",
    "blockgraph",
    "cudagraphs",
    "fp8",
    "chunks2",
    "chunks4",
    "cache",
    "cache3",
    "cache4",
    "q8",
    "magbalanced",
    "magfast",
    "magultra",
    "vae",
    "ahead",
    "outer",
    "q8s",
    "q8r",
    "cudnnfp8",
    "cudnnfp8s",
    "fuse",
)
# The static FP8 scales of the q8s option (recorded by run_modes).
STATIC_SCALES: dict[str, Any] = {}
ANCHOR_MODES = ("diffusers_ulysses", "cachedit_ulysses", "diffusers_tp", "diffusers_compile")
# diffusers_compile: one GPU, diffusers' own compile_repeated_blocks(fullgraph=True) of the transformer.
VAE_FLUX = {"block_out_channels": (128, 256, 512, 512), "layers_per_block": 2}
VAE_TINY = {"block_out_channels": (8, 8, 8, 8), "layers_per_block": 1, "norm_num_groups": 8}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model, 64x64, 4 steps (CPU smoke test)")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default 28; 4 with --tiny)")
    parser.add_argument("--size", type=int, default=None, help="image height and width (default 1024; 64 with --tiny)")
    parser.add_argument(
        "--modes",
        default="single,ulysses,ring,ulysses+fp8,usp",
        help=f"comma-separated: a layout ({', '.join(LAYOUTS)}) with options (+{', +'.join(OPTIONS)}), or an anchor "
        f"({', '.join(ANCHOR_MODES)}; last). usp needs 4+ processes",
    )
    parser.add_argument("--profile", default="", help="comma-separated modes to profile for one extra call each")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls per mode")
    parser.add_argument("--repeat", type=int, default=2, help="timed calls per mode (median reported)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--true-cfg",
        action="store_true",
        help="run FLUX's true CFG (true_cfg_scale 4, a negative prompt): two transformer calls per step, every mode",
    )
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default $OUT/cp_flux.json if OUT is set)")
    args = parser.parse_args()
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in ANCHOR_MODES and not _valid_mode(m)]
    if unknown:
        parser.error(f"--modes: unknown {unknown}; layouts {LAYOUTS}, options {OPTIONS}, anchors {ANCHOR_MODES}")
    anchors = [m for m in modes if m in ANCHOR_MODES]
    if len(anchors) > 1 or (anchors and modes[-1] != anchors[0]):
        # diffusers' and cache-dit's parallelism cannot be undone in-process: one anchor per run, last.
        parser.error(f"--modes {args.modes}: at most one of {ANCHOR_MODES}, and it must be the last mode")
    return args


def _valid_mode(mode: str) -> bool:
    layout, *options = mode.split("+")
    return layout in LAYOUTS and all(o in OPTIONS for o in options)


def setup() -> tuple[int, int, torch.device]:
    """Join the torchrun process group (NCCL on GPUs, gloo on CPU); a plain run is one process."""
    device = choose_device()
    join_process_group(device)
    return process_rank(), process_count(), device


def build_pipeline(tiny: bool, device: torch.device, dtype: torch.dtype, seed: int) -> Any:
    """FluxPipeline with a random FLUX-shaped transformer and VAE and no text encoders, built on ``device``."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    torch.manual_seed(seed)
    vae_config = {**(VAE_TINY if tiny else VAE_FLUX), "latent_channels": 16, "use_quant_conv": False,
                  "use_post_quant_conv": False, "shift_factor": 0.1159, "scaling_factor": 0.3611}  # fmt: skip
    vae_config["down_block_types"] = ("DownEncoderBlock2D",) * 4
    vae_config["up_block_types"] = ("UpDecoderBlock2D",) * 4
    with torch.device(device):
        transformer = FluxTransformer2DModel(**(TINY if tiny else FLUX_DEV))
        vae = AutoencoderKL(**vae_config)
    scale_residual_outputs(transformer, 0.2)
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15),
        vae=vae.to(dtype).eval(),
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        transformer=transformer.to(dtype).eval(),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def scale_residual_outputs(transformer: torch.nn.Module, factor: float) -> None:
    """Shrink the output projection of every residual branch so a deep random model does not blow up."""
    with torch.no_grad():
        for block in transformer.transformer_blocks:
            for linear in (block.attn.to_out[0], block.attn.to_add_out, block.ff.net[2], block.ff_context.net[2]):
                linear.weight.mul_(factor)
        for block in transformer.single_transformer_blocks:
            block.proj_out.weight.mul_(factor)


def embeddings(tiny: bool, device: torch.device, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    config = TINY if tiny else FLUX_DEV
    g = torch.Generator().manual_seed(seed + 1)
    tokens = 16 if tiny else 512
    return {
        "prompt_embeds": torch.randn(1, tokens, config["joint_attention_dim"], generator=g).to(device, dtype),
        "pooled_prompt_embeds": torch.randn(1, config["pooled_projection_dim"], generator=g).to(device, dtype),
    }


def generate(pipe: Any, kwargs: dict[str, Any], seed: int, device: torch.device) -> tuple[np.ndarray, np.ndarray]:
    """One pipeline call; returns (images in [0, 1], latents) as float32 arrays."""
    latents = pipe(**kwargs, generator=torch.Generator(device).manual_seed(seed), output_type="latent").images
    with torch.no_grad():
        unpacked = pipe._unpack_latents(latents, kwargs["height"], kwargs["width"], pipe.vae_scale_factor)
        decoded = pipe.vae.decode(unpacked / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor).sample
    images = (decoded.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy()
    return images, latents.float().cpu().numpy()


def timed(run: Callable[[], Any], args: argparse.Namespace, device: torch.device) -> tuple[Any, float]:
    """Warm up, then the median wall time over ``repeat`` calls (the slowest rank's, under parallelism)."""
    result, times = time_calls(run, device, warmup=args.warmup, repeat=args.repeat, across_processes=True)
    return result, max_across_processes(statistics.median(times), device)


def cache_for(options: list[str], steps: int) -> fastdit.DBCache | fastdit.MagCache | None:
    """F1B0 computing every K-th step (a fixed schedule; ``cache``: K = 2, ``cacheK``), a MagCache preset on the
    reference calibration (``magP``), or ``None`` without one."""
    preset = next((o.removeprefix("mag") for o in options if o.startswith("mag")), None)
    if preset is not None:
        from fastdit.cache.magcache import magcache_preset, reference_calibration

        return magcache_preset(preset, reference_calibration(steps))
    every = next((2 if o == "cache" else int(o.removeprefix("cache")) for o in options if o.startswith("cache")), None)
    if every is None:
        return None
    mask = fastdit.StepMask(compute_steps=tuple(range(0, steps, every)), policy="static")
    return fastdit.DBCache(fn=1, bn=0, warmup_steps=0, step_mask=mask, decide_ahead="ahead" in options)


def accelerate_mode(pipe: Any, mode: str, world_size: int, steps: int) -> Callable[[], None]:
    """Apply ``mode`` to ``pipe``; return its undo."""
    if mode in ANCHOR_MODES:
        return accelerate_anchor(pipe, mode, world_size)
    layout, *options = mode.split("+")
    compile_config = compile_for(options)
    chunks = next((int(o.removeprefix("chunks")) for o in options if o.startswith("chunks")), 1)
    degrees = {
        "single": None,
        "ulysses": {"ulysses": world_size},
        "ring": {"ring": world_size},
        "usp": {"ulysses": 2, "ring": world_size // 2},  # 4+ processes: Ulysses pairs, ring across them
        "tp": {"tp": world_size},
        "tp_ulysses": {"tp": 2, "ulysses": world_size // 2},  # 4+ processes: TP pairs, Ulysses across them
        "cfg": {"cfg": 2},  # 2 processes, --true-cfg: the cond and uncond calls of each step on their own GPU
        "cfg_ulysses": {"cfg": 2, "ulysses": world_size // 2},  # 4+ processes
    }[layout]
    parallel = fastdit.Parallel(**degrees, ulysses_chunks=chunks, comm_fp8="fp8" in options) if degrees else None
    cache = cache_for(options, steps)
    graphs = graphs_for(options)
    quantize = fastdit.Quantize(mode="fp8") if "q8" in options else None
    if "q8s" in options or "q8r" in options:
        weights = "row" if "q8r" in options else "tensor"
        quantize = fastdit.Quantize(mode="fp8_static", scales=STATIC_SCALES["scales"], weight_scales=weights)
    attention = fastdit.Attention(backend="cudnn-fp8") if "cudnnfp8" in options else None
    if "cudnnfp8s" in options:
        attention = fastdit.Attention(backend="cudnn-fp8", scales=STATIC_SCALES["scales"])
    fuse = fastdit.Fuse() if "fuse" in options else None
    requested = (parallel, compile_config, cache, graphs, quantize, attention, fuse)
    if all(option is None for option in requested):
        return lambda: None
    fastdit.accelerate(
        pipe,
        parallel=parallel,
        compile=compile_config,
        cuda_graph=graphs,
        cache=cache,
        quantize=quantize,
        attention=attention,
        fuse=fuse,
    )

    def undo() -> None:
        fastdit.disable(pipe)
        if compile_config is not None:
            torch._dynamo.reset()  # the next mode compiles afresh instead of piling guards onto the same code

    return undo


def compile_for(options: list[str]) -> fastdit.Compile | None:
    """The Compile config of a mode's options (``graph`` alone graphs eager kernels, without dynamo)."""
    if not {"compile", "cudagraphs"} & set(options):
        return None
    return fastdit.Compile(
        mode="reduce-overhead" if "cudagraphs" in options else None, vae="vae" in options, outer="outer" in options
    )


def graphs_for(options: list[str]) -> fastdit.CudaGraph | None:
    """The CudaGraph config of a mode's options."""
    if not {"graph", "blockgraph"} & set(options):
        return None
    return fastdit.CudaGraph(scope="blocks" if "blockgraph" in options else "auto")


def accelerate_anchor(pipe: Any, mode: str, world_size: int) -> Callable[[], None]:
    """diffusers' or cache-dit's own Ulysses or compile (no undo: these run last, one per process)."""
    if mode == "diffusers_compile":
        pipe.transformer.compile_repeated_blocks(fullgraph=True)
    elif mode == "diffusers_ulysses":
        from diffusers import ContextParallelConfig

        pipe.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world_size))
    elif mode == "diffusers_tp":
        from diffusers.models._modeling_parallel import TensorParallelConfig

        pipe.transformer.enable_parallelism(config=TensorParallelConfig(tp_degree=world_size))
    else:
        import cache_dit

        parallelism = cache_dit.ParallelismConfig(ulysses_size=world_size)
        cache_dit.enable_cache(pipe, cache_config=None, parallelism_config=parallelism)
    return lambda: None


def library(mode: str) -> str:
    if mode in ("diffusers_ulysses", "diffusers_tp", "diffusers_compile"):
        import diffusers

        return f"diffusers {diffusers.__version__}"
    if mode == "cachedit_ulysses":
        from importlib.metadata import version

        return f"cache-dit {version('cache-dit')}"
    return "fastdit"


def profile_call(run: Callable[[], Any], mode: str, rank: int, device: torch.device) -> dict[str, Any]:
    """One call under ``torch.profiler``: wall time, GPU kernel time, NCCL kernel time and count, top kernels."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device, barrier=True)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        run()
        synchronize(device, barrier=True)
        wall = time.perf_counter() - start
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    # Kernels only: the profiler also lists an "nccl:*" annotation spanning each kernel on the device timeline.
    nccl = [e for e in kernels if e.name.startswith(("ncclDevKernel", "ncclKernel"))]
    summary = {
        "mode": mode,
        "rank": rank,
        "wall_s": round(wall, 4),
        "kernel_s": round(sum(e.device_time for e in kernels) / 1e6, 4),
        "nccl_kernel_s": round(sum(e.device_time for e in nccl) / 1e6, 4),
        "nccl_calls": len(nccl),
        "nccl_mean_us": round(sum(e.device_time for e in nccl) / max(len(nccl), 1), 1),
        "kernels": len(kernels),
    }
    sort = "device_time_total" if device.type == "cuda" else "cpu_time_total"
    summary["top"] = prof.key_averages().table(sort_by=sort, row_limit=15)
    return summary


def main() -> None:
    args = parse_args()
    with process_group_scope():  # ends the group setup() joins, once every mode has run
        rank, world_size, device = setup()
        rows, profiles, steps, size = run_modes(args, world_size, device, rank)
        if rank == 0:
            report(rows, profiles, args, world_size, device, steps, size)


def run_modes(
    args: argparse.Namespace, world_size: int, device: torch.device, rank: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int, int]:
    """Every mode of ``--modes`` in turn on one pipeline: its row, profiles, and the steps and size used."""
    steps = args.steps or (4 if args.tiny else 28)
    size = args.size or (64 if args.tiny else 1024)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    pipe = build_pipeline(args.tiny, device, dtype, args.seed)
    kwargs = {**embeddings(args.tiny, device, dtype, args.seed), "height": size, "width": size,
              "num_inference_steps": steps, "guidance_scale": 3.5}  # fmt: skip
    if args.true_cfg:
        negative = embeddings(args.tiny, device, dtype, args.seed + 7)
        kwargs.update(true_cfg_scale=4.0, negative_prompt_embeds=negative["prompt_embeds"],
                      negative_pooled_prompt_embeds=negative["pooled_prompt_embeds"])  # fmt: skip
    if any({"q8s", "q8r", "cudnnfp8s"} & set(mode.split("+")) for mode in args.modes.split(",")):
        from fastdit.calibration import calibrate_scales

        # Another seed than the measured one: the static FP8 rows' quality is a held-out figure.
        scales = calibrate_scales(pipe, functools.partial(generate, pipe, kwargs, args.seed + 1, device))
        STATIC_SCALES["scales"] = scales
    rows, baseline, profiles = [], None, []
    for mode in args.modes.split(","):
        if (
            (mode.split("+")[0] not in ("single", "diffusers_compile") and world_size == 1)
            or (mode.split("+")[0] in ("usp", "tp_ulysses", "cfg_ulysses") and (world_size < 4 or world_size % 2))
            or (mode.split("+")[0] == "cfg" and world_size != 2)
        ):
            print(f"skipping {mode}: needs more processes under torchrun (usp, tp_ulysses: an even number, 4+)")
            continue
        undo = accelerate_mode(pipe, mode, world_size, steps)
        memory = model_memory(device)
        try:
            call = functools.partial(generate, pipe, kwargs, args.seed, device)
            (images, latents), seconds = timed(call, args, device)
            if mode in args.profile.split(","):
                profiles.append(profile_call(call, mode, rank, device))
            computed = blocks_computed(pipe)
        finally:
            undo()
        if baseline is None:
            baseline = (images, latents, seconds)
        row = {**score(mode, seconds, images, latents, baseline, world_size), **memory, **peak_memory(device)}
        rows.append({**row, **computed})
    return rows, profiles, steps, size


def blocks_computed(pipe: Any) -> dict[str, Any]:
    """The cache's share of block evaluations computed and its cached steps in the last call (empty without one)."""
    try:
        cache = fastdit.summary(pipe).transformers.get("transformer", {}).get("cache")
    except ValueError:  # the mode applied nothing
        return {}
    if not cache:
        return {}
    branches = cache["branches"].values()
    total = sum(b["blocks_total"] for b in branches)
    return {
        "blocks_computed": round(sum(b["blocks_computed"] for b in branches) / max(total, 1), 4),
        "cached_steps": sum(len(b["cached_steps"]) for b in branches),
    }


def model_memory(device: torch.device) -> dict[str, float]:
    """GiB allocated on this rank's device once a mode is applied (the pipeline's weights there), the max over ranks."""
    if device.type != "cuda":
        return {}
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return {"model_gib": round(max_across_processes(torch.cuda.memory_allocated(device) / 2**30, device), 2)}


def peak_memory(device: torch.device) -> dict[str, float]:
    """Peak GiB allocated on this rank's device during the mode's calls, the max over ranks."""
    if device.type != "cuda":
        return {}
    return {"peak_gib": round(max_across_processes(torch.cuda.max_memory_allocated(device) / 2**30, device), 2)}


def score(mode: str, seconds: float, images, latents, baseline, world_size: int) -> dict[str, Any]:
    """Time and quality of one mode against the single-device baseline."""
    base_images, base_latents, base_seconds = baseline
    latent_range = float(base_latents.max() - base_latents.min())
    quality = compare_outputs(list(base_images), list(images))
    return {
        "mode": mode,
        "library": library(mode),
        "degree": 1 if mode.split("+")[0] in ("single", "diffusers_compile") else world_size,  # tp_ulysses: the product
        "seconds": round(seconds, 4),
        "speedup": round(base_seconds / seconds, 3),
        "psnr": quality.psnr,
        "ssim": quality.ssim,
        "latent_psnr": psnr(base_latents[0], latents[0], data_range=latent_range),
        "latent_max_abs_err": float(np.abs(base_latents - latents).max()),
    }


def report(rows: list[dict[str, Any]], profiles: list[dict[str, Any]], args, world_size: int, device, steps, size):
    name = device_name(device)
    print(f"\nFLUX.1-dev-sized transformer ({'tiny' if args.tiny else 'full'}), {size}x{size}, {steps} steps, "
          f"{world_size} x {name}\n")  # fmt: skip
    header = ("mode", "library", "degree", "seconds", "speed-up", "PSNR (dB)", "SSIM", "latent PSNR", "latent max err",
              "model GiB/GPU", "peak GiB/GPU")  # fmt: skip
    cells = [
        (
            r["mode"],
            r["library"],
            r["degree"],
            f"{r['seconds']:.3f}",
            f"{r['speedup']:.2f}x",
            f"{r['psnr']:.2f}",
            f"{r['ssim']:.4f}",
            f"{r['latent_psnr']:.2f}",
            f"{r['latent_max_abs_err']:.2e}",
            r.get("model_gib", "-"),
            r.get("peak_gib", "-"),
        )
        for r in rows
    ]
    print(markdown_table(header, cells), end="")
    for p in profiles:
        print(f"\nprofile {p['mode']} (rank {p['rank']}): wall {p['wall_s']} s, kernels {p['kernel_s']} s "
              f"({p['kernels']}), NCCL {p['nccl_kernel_s']} s in {p['nccl_calls']} calls "
              f"(mean {p['nccl_mean_us']} us)")  # fmt: skip
        print(p["top"])
    out = args.out or (Path(os.environ["OUT"]) / "cp_flux.json" if "OUT" in os.environ else None)
    if out is None:
        return
    payload = {
        "benchmark": "cp_flux",
        "date": date.today().isoformat(),
        "device": name,
        "world_size": world_size,
        "torch": torch.__version__,
        "config": {"tiny": args.tiny, "steps": steps, "size": size, "warmup": args.warmup, "repeat": args.repeat},
        "results": rows,
        "profiles": [{k: v for k, v in p.items() if k != "top"} for p in profiles],
    }
    write_json(out, json_ready(payload))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
