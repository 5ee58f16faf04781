"""Draw a grid of reference-pipeline samples: digits 0-9 (columns) x seeds (rows), and report the digit accuracy.

    python tools/sample_grid.py                           # docs/images/reference_grid.png
    python tools/sample_grid.py --true-cfg 3 --out cfg.png  # the two-forward true-CFG path

Accuracy is read by an SVC fitted on scikit-learn's 8x8 digits (needs scikit-learn).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from fastdit.reference import REFERENCE_DEFAULTS, load_reference_pipeline
from fastdit.reference.digits import digit_accuracy, fit_digit_classifier, generate_digits

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", type=Path, default=None, help="pipeline directory (default: the packaged one)")
    p.add_argument("--out", type=Path, default=ROOT / "docs/images/reference_grid.png", help="PNG to write")
    p.add_argument("--seeds", type=int, default=4, help="rows: seeds 0..N-1")
    p.add_argument("--steps", type=int, default=REFERENCE_DEFAULTS["num_inference_steps"], help="sampling steps")
    p.add_argument("--true-cfg", type=float, default=1.0, help="true_cfg_scale (> 1 adds the empty negative prompt)")
    p.add_argument("--zoom", type=int, default=2, help="nearest-neighbour upscale of each tile")
    p.add_argument("--device", default="cpu", help="torch device")
    return p.parse_args(argv)


def grid_image(images: np.ndarray, rows: int, cols: int, zoom: int, pad: int = 2) -> Image.Image:
    """Tile ``(rows * cols, H, W, 3)`` images in [0, 1] row-major, with a grey gap between tiles."""
    h, w = images.shape[1] * zoom, images.shape[2] * zoom
    canvas = np.full((rows * (h + pad) + pad, cols * (w + pad) + pad, 3), 0.5, dtype=np.float32)
    for i, img in enumerate(images):
        r, c = divmod(i, cols)
        tile = img.repeat(zoom, axis=0).repeat(zoom, axis=1)
        canvas[pad + r * (h + pad) : pad + r * (h + pad) + h, pad + c * (w + pad) : pad + c * (w + pad) + w] = tile
    return Image.fromarray((canvas.clip(0, 1) * 255).round().astype(np.uint8))


def main(argv: list[str] | None = None) -> None:
    """Generate, save the grid, print timing and accuracy."""
    args = parse_args(argv)
    if args.weights is None:
        pipe = load_reference_pipeline(args.device)
    else:
        from diffusers import FluxPipeline

        pipe = FluxPipeline.from_pretrained(args.weights, dtype=torch.float32, local_files_only=True)
        pipe = pipe.to(args.device)
        pipe.set_progress_bar_config(disable=True)
    digits = [d for _ in range(args.seeds) for d in range(10)]
    seeds = [s for s in range(args.seeds) for _ in range(10)]
    overrides = {"num_inference_steps": args.steps}
    if args.true_cfg > 1.0:
        overrides.update(negative_prompt="", true_cfg_scale=args.true_cfg)
    start = time.perf_counter()
    images = generate_digits(pipe, digits, seeds, **overrides)
    elapsed = time.perf_counter() - start
    args.out.parent.mkdir(parents=True, exist_ok=True)
    grid_image(images, args.seeds, 10, args.zoom).save(args.out)
    accuracy = digit_accuracy(images, digits, fit_digit_classifier())
    print(f"{len(images)} images in {elapsed:.2f}s on {args.device}; digit accuracy {accuracy:.1%}; wrote {args.out}")


if __name__ == "__main__":
    main()
