"""Speed versus worst-image quality of every cache configuration ``cache_frontier.py`` measured, by library.

Each point is one configuration on the held-out seeds (never used for tuning): x the share of block evaluations
it computed, y the PSNR of its worst image against the uncached output. Each library's Pareto front (fewest blocks
for a given worst image) is drawn as a line; the frontier goals are the shaded corners. Caches that skip attention
rather than blocks (PAB, FasterCache) appear a second time, hollow, at the share of attention calls they computed.
Several files merge (the anchors of ``cache_anchors.py`` beside the frontier; a configuration in two files is drawn
once, from the first); rows of another call path (``"path": "cfg"``, the true-CFG call) are drawn only with
``--path cfg``.

    python benchmarks/plot_frontier.py benchmarks/results/<date>_cpu_cache_frontier/frontier.json \\
        benchmarks/results/<date>_cpu_cache_anchors/anchors.json --out docs/images/cache_frontier.png
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

PSNR_CAP = 60.0  # identical outputs have infinite PSNR: drawn at the top of the axis
ATTENTION = "attention computed (PAB, FasterCache)"
COLOURS = {
    "fastdit MagCache": "tab:red",
    "fastdit DBCache / DBPrune": "tab:green",
    ATTENTION: "tab:gray",
}


def _value(x: Any) -> float:
    return PSNR_CAP if x in ("inf", float("inf")) else min(float(x), PSNR_CAP)


def series(rows: list[dict[str, Any]], part: str) -> dict[str, list[tuple[float, float, str]]]:
    """``{label: [(blocks %, worst PSNR, name)]}``; fastdit's rows split into MagCache and the block caches."""
    out: dict[str, list[tuple[float, float, str]]] = {}
    for row in rows:
        measured = row[part]
        if "no cache" in row["name"]:  # a check of the harness itself (an uncached path against another)
            continue
        label = row["library"]
        attention = measured.get("attention_computed_fraction")
        if attention is not None and attention < measured["blocks_computed_fraction"] - 1e-9:
            # Attention-level caches compute every block they do not skip whole: drawn a second time at the share
            # of attention calls they computed (an upper bound of their saving, the MLPs still run).
            point = (100 * attention, _value(measured["psnr_min"]), row["name"])
            out.setdefault(ATTENTION, []).append(point)
        if label == "fastdit":
            kind = (measured.get("config") or {}).get("type")
            label = "fastdit MagCache" if kind == "MagCache" else "fastdit DBCache / DBPrune"
        point = (100 * measured["blocks_computed_fraction"], _value(measured["psnr_min"]), row["name"])
        out.setdefault(label, []).append(point)
    return out


def pareto(points: list[tuple[float, float, str]]) -> list[tuple[float, float]]:
    """The points no other point beats on both axes (fewer blocks and a better worst image), by blocks."""
    front: list[tuple[float, float]] = []
    best = -math.inf
    for blocks, psnr, _ in sorted(points, key=lambda p: (p[0], -p[1])):
        if psnr > best:
            front.append((blocks, psnr))
            best = psnr
    return front


def merged(files: list[dict[str, Any]], path: str = "default") -> dict[str, Any]:
    """The rows of ``files`` on call path ``path`` (a row without one is on the default path), each one once."""
    rows, seen = [], set()
    for data in files:
        for row in data["results"]:
            key = (row["library"], row["name"])
            if row.get("path", "default") == path and key not in seen:
                seen.add(key)
                rows.append(row)
    return {**files[0], "results": rows, "path": path}


def plot(data: dict[str, Any], out: Path, part: str = "heldout") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 5.5), dpi=120)
    for bar, colour in (((30, 30), "tab:green"), ((40, 35), "tab:olive")):
        ax.fill_between([0, bar[0]], bar[1], PSNR_CAP, color=colour, alpha=0.08, lw=0)
        ax.plot([bar[0], bar[0], 0], [PSNR_CAP, bar[1], bar[1]], color=colour, lw=0.8, ls=":")
        ax.annotate(f"goal: <= {bar[0]}% at >= {bar[1]} dB", (1, bar[1] + 0.5), color=colour, fontsize=8)
    markers = {"fastdit MagCache": "o", "fastdit DBCache / DBPrune": "s", ATTENTION: "D"}
    for label, points in sorted(series(data["results"], part).items()):
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        colour = COLOURS.get(label, "tab:orange" if label.startswith("diffusers") else "tab:blue")
        marker = markers.get(label, "^")
        if label == ATTENTION:  # hollow: not block evaluations, and no front of their own
            ax.scatter(xs, ys, s=22, marker=marker, facecolors="none", edgecolors=colour, label=label)
            continue
        ax.scatter(xs, ys, s=18, alpha=0.55, marker=marker, color=colour, label=label)
        front = pareto(points)
        ax.plot([p[0] for p in front], [p[1] for p in front], color=colour, lw=1.2, alpha=0.9)
    ax.set_xlim(0, 100)
    ax.set_ylim(15, PSNR_CAP + 1)
    ax.set_xlabel("block evaluations computed (% of an uncached run)")
    ax.set_ylabel("worst image PSNR vs uncached (dB)")
    seeds = data.get("split", {}).get(part)
    where = ", true CFG" if data.get("path") == "cfg" else ""
    ax.set_title(
        f"Cache configurations on the reference pipeline{where}, {part} seeds {seeds}, {data.get('steps')} steps"
    )
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(out)  # atomically: a reader never sees half an image
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("frontier", type=Path, nargs="+", help="frontier.json (cache_frontier.py), anchors.json ...")
    parser.add_argument("--out", type=Path, required=True, help="PNG to write")
    parser.add_argument("--part", choices=("heldout", "calibration"), default="heldout")
    parser.add_argument("--path", choices=("default", "cfg"), default="default", help="which call path to draw")
    args = parser.parse_args()
    files = [json.loads(path.read_text()) for path in args.frontier]
    print(plot(merged(files, args.path), args.out, args.part))


if __name__ == "__main__":
    main()
