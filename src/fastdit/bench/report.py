"""Reports of a sweep: a markdown table, strict JSON and a speed-versus-quality plot, each written atomically."""

from __future__ import annotations

import datetime
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastdit.bench.sweep import BenchRow, Sweep

__all__ = ["device_name", "markdown", "markdown_table", "plot", "report_json", "write_reports"]


def device_name(device: torch.device | str) -> str:
    """The hardware behind ``device``: the GPU's name, or the CPU's (its architecture where the name is unknown)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]], *, numeric: Sequence[bool] = ()) -> str:
    """A markdown table, one line per row (cells as given, through ``str``), with a trailing newline.

    Args:
        header: Column titles.
        rows: Cells, one sequence per row, as many as ``header``.
        numeric: Per column, whether to right-align it (missing entries: left).
    """
    align = ["---:" if i < len(numeric) and numeric[i] else "---" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"a row has {len(row)} cells for {len(header)} columns: {row!r}")
        lines.append("| " + " | ".join(str(cell) for cell in row) + " |")
    return "\n".join(lines) + "\n"


def _fmt_psnr(value: float) -> str:
    return "∞" if value == float("inf") else f"{value:.2f}"


def markdown(rows: Sequence[BenchRow], title: str) -> str:
    """A sweep as a markdown table under a ``# title`` (PSNR and SSIM against the baseline, mean / min)."""
    header = ("Configuration", "Latency (s/image)", "Speed-up", "Blocks computed", "PSNR (dB)", "SSIM", "Memory (GiB)")
    cells = [
        (
            row.name,
            f"{row.seconds:.3f}",
            f"{row.speedup:.2f}x",
            f"{row.blocks_computed_fraction:.1%}",
            f"{_fmt_psnr(row.psnr)} / {_fmt_psnr(row.psnr_min)}",
            f"{row.ssim:.4f} / {row.ssim_min:.4f}",
            "-" if row.peak_memory is None else f"{row.peak_memory / 2**30:.2f}",
        )
        for row in rows
    ]
    return f"# {title}\n\n" + markdown_table(header, cells, numeric=(False,) + (True,) * 6)


def _capped(rows: Sequence[BenchRow]) -> tuple[list[float], list[float], float]:
    finite = [v for r in rows for v in (r.psnr, r.psnr_min) if np.isfinite(v)]
    cap = (max(finite) + 5.0) if finite else 60.0  # where identical outputs (infinite PSNR) are drawn

    def capped(values: list[float]) -> list[float]:
        return [v if np.isfinite(v) else cap for v in values]

    return capped([r.psnr for r in rows]), capped([r.psnr_min for r in rows]), cap


def plot(rows: Sequence[BenchRow], path: Path, title: str) -> Path:
    """Speed-up and blocks computed against PSNR (mean, with a line down to the minimum), saved atomically.

    Points are numbered; the legend below the plots maps numbers to configurations (their names can be long).
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: never open a window or need a display
    import matplotlib.pyplot as plt

    from fastdit.io import atomic_output

    means, minima, cap = _capped(rows)
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.5 + 0.22 * len(rows)), sharey=True)
    for axis, x_values, label in (
        (axes[0], [r.speedup for r in rows], "speed-up vs baseline (×)"),
        (axes[1], [r.blocks_computed_fraction for r in rows], "blocks computed (fraction)"),
    ):
        for index, (row, x, mean, minimum) in enumerate(zip(rows, x_values, means, minima, strict=True)):
            axis.vlines(x, minimum, mean, color="tab:gray", linewidth=1)
            axis.plot(x, mean, "o", color=f"C{index % 10}", label=f"{index}: {row.name}")
            axis.annotate(str(index), (x, mean), textcoords="offset points", xytext=(4, 4), fontsize=8)
        axis.set_xlabel(label)
        axis.margins(x=0.15, y=0.1)
        axis.grid(alpha=0.3)
    axes[0].set_ylabel(f"PSNR vs baseline, mean and min (dB; identical at {cap:.0f})")
    handles, labels = axes[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=1, fontsize=8, frameon=False)
    figure.suptitle(title)
    figure.tight_layout(rect=(0, 0.06 * len(rows) / (1 + 0.05 * len(rows)), 1, 1))
    with atomic_output(path) as temp:
        figure.savefig(temp, format="png", dpi=120)
    plt.close(figure)
    return path


def report_json(sweep: Sweep, rows: Sequence[BenchRow]) -> dict[str, Any]:
    """The sweep and its rows as strict-JSON data (what ``bench.json`` holds)."""
    return {
        "model": sweep.source.name,
        "pipeline": sweep.pipeline_class.__name__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(sweep.device),
        "device_name": device_name(sweep.device),
        "dtype": str(sweep.dtype).removeprefix("torch."),
        "steps": sweep.num_steps,
        "call": {k: v for k, v in sweep.kwargs.items() if isinstance(v, (int, float, str, bool))},
        "prompts": sorted({c.prompt for c in sweep.cases if c.prompt is not None}),
        "seeds": sorted({c.seed for c in sweep.cases}),
        "warmup": sweep.warmup,
        "repeat": sweep.repeat,
        "rows": [row.to_dict() for row in rows],
    }


def write_reports(directory: Path, sweep: Sweep, rows: Sequence[BenchRow]) -> tuple[dict[str, Any], str]:
    """Write ``bench.json``, ``bench.md`` and ``bench.png`` into ``directory``.

    Returns:
        The JSON report and the markdown table.
    """
    from fastdit.io import write_json, write_text

    report = report_json(sweep, rows)
    write_json(directory / "bench.json", report)
    table = markdown(rows, sweep.title)
    write_text(directory / "bench.md", table)
    plot(rows, directory / "bench.png", sweep.title)
    return report, table
