"""``fastdit calibrate``'s search on the trained video reference: the spectral policy (and others) to a target.

The search of :func:`fastdit.bench.calibrate.calibrate_cache` — ladders climbed on the calibration seeds (0, 1) to
the first miss, the choice then run on the held-out seeds (101, 202) — on the video reference ``WanPipeline`` with
the 40 prompts and 30 steps of ``video_cache_frontier.py`` (whose session, split and per-clip quality it reuses).
The target is on the worst clip (each clip judged by its mean PSNR / SSIM over its frames against the uncached clip);
the worst frame is printed beside it.

    python benchmarks/calibrate_video.py --target-psnr 30 --policies spectral \\
        --out benchmarks/results/<date>_cpu_calibrate_video/spectral_default.json
"""

from __future__ import annotations

import argparse
import sys
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from video_cache_frontier import PATHS, VideoBench, video_session, video_split

from fastdit.bench.calibrate import POLICIES, Target, calibrate_cache, ladders
from fastdit.bench.heldout import transformer_blocks
from fastdit.bench.plain import json_ready
from fastdit.io import write_json
from fastdit.reference.video import VIDEO_REFERENCE_DEFAULTS
from fastdit.session import call_arguments


def _row(row) -> dict:
    return None if row is None else {k: v for k, v in row.to_dict().items() if k != "config"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", choices=tuple(PATHS), default="default")
    parser.add_argument("--target-psnr", type=float, default=None)
    parser.add_argument("--target-speedup", type=float, default=None)
    parser.add_argument("--policies", default="spectral", help=f"comma list among {','.join(POLICIES)}")
    parser.add_argument("--batch", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    target = Target(psnr=args.target_psnr, speedup=args.target_speedup)
    torch.set_num_threads(args.threads)
    session = video_session()
    kwargs = call_arguments(session.pipeline_class, {**VIDEO_REFERENCE_DEFAULTS, **PATHS[args.path]}, {})
    bench = VideoBench(session, video_split(), kwargs, transformer_blocks(session), batch=args.batch)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    try:
        result = calibrate_cache(
            bench,
            target,
            ladders(policies, VIDEO_REFERENCE_DEFAULTS["num_inference_steps"], None),
            progress=lambda row: print(
                f"  {row.name}: blocks {row.blocks_computed_fraction:.1%}, worst clip {row.worst[0]:.2f} dB "
                f"(frame {row.psnr_min:.2f}), SSIM worst clip {row.worst[1]:.3f}",
                flush=True,
            ),
        )
    finally:
        bench.close()
    payload = {
        "date": date.today().isoformat(),
        "path": args.path,
        "target": target.describe(),
        "policies": policies,
        "chosen": None if result.chosen is None else result.chosen[0],
        "calibration": _row(result.calibration),
        "heldout": _row(result.heldout),
        "candidates": [_row(r) for r in result.candidates],
    }
    write_json(args.out, json_ready(payload), indent=1)
    print("chosen:", payload["chosen"])
    for part in ("calibration", "heldout"):
        row = payload[part]
        if row is not None:
            print(f"  {part}: blocks {row['blocks_computed_fraction']:.1%}, PSNR mean / worst clip / worst frame "
                  f"{row['psnr']:.2f} / {row['psnr_clip_min']:.2f} / {row['psnr_min']:.2f} dB, "
                  f"SSIM worst clip {row['ssim_clip_min']:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
