"""VAE parallelism: decode time and per-rank peak activation memory, 1 rank vs N, for the FLUX.1 VAE shape (``--vae
flux``, an image) or the Wan 2.1 VAE (``--vae wan``, a video of ``--frames`` frames).

The VAE has the published FLUX.1 ``AutoencoderKL`` config (or diffusers' default ``AutoencoderKLWan``, the Wan 2.1
VAE) with random weights (the cost does not depend on the values). Each layout runs in its own processes
(``mp.spawn``: gloo on CPU, NCCL on GPU): one untimed decode, then ``--repeats`` timed ones. Peak activation memory
is measured during one decode: on CUDA ``torch.cuda.max_memory_allocated`` above the memory held before it; on the
CPU the peak resident set size (sampled every millisecond by a thread) above the resident size before it, which
counts the allocator's whole footprint and is a coarser measure. The parallel output is checked against the one-
rank output.

    python benchmarks/vae_parallel.py --size 256 --ranks 2 --out benchmarks/results/2026-12-01_cpu_vae_parallel.json
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fastdit.bench import json_ready, markdown_table
from fastdit.io import write_json
from fastdit.metrics import compare

DATE = "2026-12-01"
FLUX_VAE: dict[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 16,
    "block_out_channels": (128, 256, 512, 512),
    "down_block_types": ("DownEncoderBlock2D",) * 4,
    "up_block_types": ("UpDecoderBlock2D",) * 4,
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _PeakRss:
    """The largest resident set size seen while active, sampled by a thread."""

    def __enter__(self) -> _PeakRss:
        self.start = self.peak = _rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _rss_bytes())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())


def _decode_peak(vae: torch.nn.Module, z: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, int]:
    """One decode and the activation memory it needed above what was held before."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        held = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = vae.decode(z).sample
        torch.cuda.synchronize(device)
        return out, torch.cuda.max_memory_allocated(device) - held
    with _PeakRss() as peak:
        out = vae.decode(z).sample
    return out, peak.peak - peak.start


def _build(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.Tensor]:
    """The VAE (random weights, seeded) and its latent for ``--size`` (and ``--frames`` for a video VAE)."""
    generator = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    if args.vae == "wan":
        from diffusers import AutoencoderKLWan

        vae = AutoencoderKLWan()  # diffusers' default config is the Wan 2.1 VAE
        frames = (args.frames - 1) // 4 + 1
        return vae, torch.randn(1, 16, frames, args.size // 8, args.size // 8, generator=generator)
    from diffusers import AutoencoderKL

    return AutoencoderKL(**FLUX_VAE), torch.randn(1, 16, args.size // 8, args.size // 8, generator=generator)


def _rank(rank: int, world: int, args: argparse.Namespace, store: str, results: Any) -> None:
    from fastdit.components.vae_parallel import apply_vae_parallel
    from fastdit.components.vae_plans import plan_for

    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda", 0 if args.share_gpu else rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(args.threads)
    # NCCL refuses two ranks on one GPU; gloo takes CUDA tensors (through host memory): per-rank memory stays
    # meaningful on a shared GPU, the time does not.
    backend = "nccl" if cuda and not args.share_gpu else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    dtype = torch.bfloat16 if cuda else torch.float32
    vae, z = _build(args)
    vae = vae.to(device, dtype).eval()
    z = z.to(device, dtype)
    if world > 1:
        apply_vae_parallel(vae, plan_for(vae), None)
    with torch.no_grad():
        out, peak = _decode_peak(vae, z, device)
        times = []
        for _ in range(args.repeats):
            dist.barrier()
            if cuda:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            vae.decode(z)
            if cuda:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
    results[rank] = {"peak_bytes": peak, "seconds": min(times), "out": out.float().cpu() if rank == 0 else None}
    dist.destroy_process_group()


def _run(world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(world, args, os.path.join(tmp, "store"), results), nprocs=world, join=True)
        return [results[r] for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vae", choices=("flux", "wan"), default="flux", help="FLUX.1 image VAE or Wan 2.1 video VAE")
    parser.add_argument("--size", type=int, default=512, help="image height and width (pixels)")
    parser.add_argument("--frames", type=int, default=17, help="video frames (--vae wan; 4k + 1)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2], help="parallel layouts to compare with 1 rank")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even when CUDA is available")
    parser.add_argument(
        "--share-gpu",
        action="store_true",
        help="every rank on GPU 0 over gloo (one GPU: per-rank memory and bf16 exactness, not speed)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.cuda.get_device_name(0) if cuda else f"CPU ({args.threads} thread(s) per rank)"
    if cuda and args.share_gpu:
        device += " (all ranks on one GPU, gloo)"
    rows, reference = [], None
    for world in [1, *args.ranks]:
        ranks = _run(world, args)
        if world == 1:
            reference = ranks[0]["out"]
        err = (ranks[0]["out"] - reference).abs().max().item()
        image, expected = ((t.clamp(-1, 1) + 1) / 2 for t in (ranks[0]["out"], reference))
        # Frames channels-last, (N, H, W, C): one image per frame of a video, PSNR and SSIM min over the frames.
        frames = [t.movedim(1, -1).reshape(-1, *t.shape[-2:], t.shape[1]).numpy() for t in (expected, image)]
        quality = compare(*frames, data_range=1.0)
        rows.append(
            {
                "ranks": world,
                "decode_s": max(r["seconds"] for r in ranks),
                "peak_activation_mib_per_rank": max(r["peak_bytes"] for r in ranks) / 2**20,
                "max_abs_diff_vs_1_rank": err,
                "psnr_db_vs_1_rank": quality.psnr_min,
                "ssim_vs_1_rank": quality.ssim_min,
            }
        )
    what = "FLUX.1 VAE" if args.vae == "flux" else f"Wan 2.1 VAE, {args.frames} frames"
    print(f"{what} decode, {args.size}x{args.size}, {device}")
    header = list(rows[0])
    cells = [[f"{v:.3g}" if isinstance(v, float) else v for v in row.values()] for row in rows]
    print(markdown_table(header, cells, numeric=[True] * len(header)), end="")
    if args.out is not None:
        config = (
            FLUX_VAE if args.vae == "flux" else {"class": "AutoencoderKLWan (default config)", "frames": args.frames}
        )
        payload = {"date": DATE, "device": device, "vae": args.vae, "size": args.size, "config": config, "rows": rows}
        payload["dtype"] = "bfloat16" if cuda else "float32"
        write_json(args.out, json_ready(payload))


if __name__ == "__main__":
    main()
