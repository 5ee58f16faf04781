"""``fastdit calibrate MODEL --scales PATH``: record static FP8's activation scales and check them on held-out seeds.

The pipeline generates the calibration prompts with the calibration seeds in its own dtype while every quantizable
Linear's largest absolute input is recorded; the scales are then used (``Quantize(mode="fp8_static")``) on the
calibration cases and on the held-out seeds the recording never saw, each against the unquantized outputs of the same
cases, and both figures are printed side by side and stored in the file. ``--quantize fp8_static,scales=PATH``
(``generate``, ``serve``) reads it back.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from fastdit.bench.heldout import CALIBRATION, HELDOUT, SplitBench, Variant
from fastdit.bench.report import markdown_table
from fastdit.bench.sweep import BenchRow
from fastdit.config import Quantize
from fastdit.session import Session

__all__ = ["record_scales"]


def _quality(row: BenchRow) -> dict[str, Any]:
    return {"psnr": row.psnr, "psnr_min": row.psnr_min, "ssim": row.ssim, "ssim_min": row.ssim_min}


def _table(rows: dict[str, BenchRow]) -> str:
    body = [
        [part, f"{r.psnr:.2f}", f"{r.psnr_min:.2f}", f"{r.ssim:.4f}", f"{r.ssim_min:.4f}"] for part, r in rows.items()
    ]
    return markdown_table(["part", "PSNR dB", "PSNR min dB", "SSIM", "SSIM min"], body)


def record_scales(
    session: Session, bench: SplitBench, out: Path, *, headroom: float, weight_scales: str, as_json: bool
) -> int:
    """Record the scales on the calibration cases, measure them on both parts, print the report, write the file.

    Args:
        session: The loaded, un-accelerated pipeline.
        bench: The split of cases (its block counter unused here).
        out: The scales file to write (atomically).
        headroom: ``Quantize.headroom`` the check runs with (and the file records).
        weight_scales: ``Quantize.weight_scales`` the check runs with (and the file records).
        as_json: End with one JSON line: the path and the measured quality.

    Returns:
        0 (the file is written).
    """
    from fastdit.bench.plain import json_ready
    from fastdit.bench.timing import run as run_cases
    from fastdit.calibration import calibrate_scales
    from fastdit.quantize import save_scales

    cases = bench.split.cases(CALIBRATION)
    scales = calibrate_scales(session.pipe, lambda: run_cases(session, cases, bench.kwargs, batch=bench.batch))
    config = Quantize(mode="fp8_static", scales=scales, headroom=headroom, weight_scales=weight_scales)
    variant = Variant("fp8_static", "fastdit", lambda: session.accelerate(quantize=config), session.disable)
    rows = {part: bench.measure_part(variant, part) for part in (CALIBRATION, HELDOUT)}
    inputs = sum(":" in name for name in scales.layers)  # attention modules' Q/K/V, for --attention cudnn-fp8
    print(
        f"{len(scales.layers) - inputs} layers and {inputs // 3} attention modules recorded on {len(cases)} "
        f"calibration cases ({scales.model})",
        file=sys.stderr,
    )
    print(_table(rows), file=sys.stderr if as_json else sys.stdout)
    provenance = {
        "headroom": headroom,
        "weight_scales": weight_scales,
        "prompts": list(bench.split.prompts),
        "calibration_seeds": list(bench.split.calibration_seeds),
        "heldout_seeds": list(bench.split.heldout_seeds),
        **{part: _quality(row) for part, row in rows.items()},
    }
    provenance = json_ready(provenance)
    save_scales(out, scales, provenance=provenance)
    print(f"wrote {out}", file=sys.stderr)
    if as_json:
        print(json.dumps({"path": str(out), **provenance}))
    return 0
