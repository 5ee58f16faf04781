"""``fastdit metrics [psnr] [ssim] A B [--json]``: compare two images, two videos, or two directories of images.

A is the reference, B the test. Directories are paired by file name (image files only, hidden files ignored); every
name must exist on both sides. Videos are compared frame by frame. Without metric names both are computed.

Output: a table with one row per image, frame or file, plus mean and min rows when there is more than one; with
``--json`` a single JSON line instead: ``psnr``/``ssim`` (means), and for directories and videos also
``psnr_min``/``ssim_min`` and ``count``. An infinite PSNR (identical inputs) is written as the string ``"inf"``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from fastdit.cli import CLIError
from fastdit.io import IMAGE_SUFFIXES, VIDEO_SUFFIXES, load_image, load_video
from fastdit.metrics import METRICS, Comparison, compare, json_safe

__all__ = ["add_parser", "run"]

_MAX_LISTED_NAMES = 10
_KIND_PHRASES = {"image": "an image file", "video": "a video file", "directory": "a directory"}
_DESCRIPTION = """\
Compare a reference A with a test B: two images, two videos (frame by frame) or two directories of images (paired
by file name). Without metric names, all metrics are computed.

Prints a table with one row per image, frame or file (plus mean and min rows); with --json one JSON line instead,
with the keys psnr and ssim (means) and, for videos and directories, psnr_min, ssim_min and count. An infinite PSNR
(identical inputs) is written as the string "inf".
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``metrics`` command.

    Args:
        subparsers: The action returned by ``ArgumentParser.add_subparsers``.

    Returns:
        The command's parser.
    """
    parser = subparsers.add_parser(
        "metrics",
        help="PSNR/SSIM between two images, videos or directories",
        description=_DESCRIPTION,
        usage="fastdit metrics [-h] [--json] [METRIC ...] A B",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "words",
        nargs="+",
        metavar="METRIC ... A B",
        help=f"metric names ({', '.join(METRICS)}; default: all), then the reference A and the test B",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return parser


def _split_words(words: list[str]) -> tuple[tuple[str, ...], Path, Path]:
    if len(words) < 2:
        raise CLIError(f"expected two inputs A and B after the metric names, got {words!r}")
    *names, path_a, path_b = words
    for name in names:
        if name not in METRICS:
            raise CLIError(f"argument METRIC: unknown metric {name!r} (choose from {', '.join(METRICS)})")
    chosen = tuple(dict.fromkeys(names)) or METRICS  # keep the user's order, drop repeats
    return chosen, Path(path_a), Path(path_b)


def _kind(path: Path, label: str) -> str:
    if not path.exists():
        raise CLIError(f"argument {label}: no such file or directory: '{path}'")
    if path.is_dir():
        return "directory"
    suffix = path.suffix.lower()
    if suffix in IMAGE_SUFFIXES:
        return "image"
    if suffix in VIDEO_SUFFIXES:
        return "video"
    known = ", ".join(sorted(IMAGE_SUFFIXES | VIDEO_SUFFIXES))
    raise CLIError(f"argument {label}: unsupported file type {suffix or '(none)'!r} of '{path}' (known: {known})")


def _load(path: Path, label: str, kind: str) -> np.ndarray:
    try:
        return load_video(path) if kind == "video" else load_image(path)
    except ImportError as error:
        raise CLIError(str(error)) from error
    except (OSError, ValueError) as error:
        raise CLIError(f"argument {label}: cannot read '{path}': {error}") from error


def _check_same_shape(path_a: Path, a: np.ndarray, path_b: Path, b: np.ndarray) -> None:
    if a.shape != b.shape:
        raise CLIError(f"size mismatch: A '{path_a}' has shape {a.shape}, B '{path_b}' has shape {b.shape}")


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED_NAMES])
    more = len(names) - _MAX_LISTED_NAMES
    return f"{shown} (and {more} more)" if more > 0 else shown


def _image_names(directory: Path) -> set[str]:
    return {
        entry.name
        for entry in directory.iterdir()
        if entry.is_file() and not entry.name.startswith(".") and entry.suffix.lower() in IMAGE_SUFFIXES
    }


def _paired_directories(dir_a: Path, dir_b: Path) -> list[str]:
    names_a, names_b = _image_names(dir_a), _image_names(dir_b)
    only_a, only_b = sorted(names_a - names_b), sorted(names_b - names_a)
    if only_a or only_b:
        parts = []
        if only_a:
            parts.append(f"only in A '{dir_a}': {_listed(only_a)}")
        if only_b:
            parts.append(f"only in B '{dir_b}': {_listed(only_b)}")
        raise CLIError("unpaired file names: " + "; ".join(parts))
    if not names_a:
        raise CLIError(f"argument A: no image files in directory '{dir_a}'")
    return sorted(names_a)


def _load_pairs(kind: str, path_a: Path, path_b: Path) -> tuple[list[str], list[np.ndarray], list[np.ndarray]]:
    if kind == "directory":
        names = _paired_directories(path_a, path_b)
        images_a, images_b = [], []
        for name in names:
            a, b = _load(path_a / name, "A", "image"), _load(path_b / name, "B", "image")
            _check_same_shape(path_a / name, a, path_b / name, b)
            images_a.append(a)
            images_b.append(b)
        return names, images_a, images_b
    a, b = _load(path_a, "A", kind), _load(path_b, "B", kind)
    _check_same_shape(path_a, a, path_b, b)
    if kind == "video":
        return [f"frame {index}" for index in range(len(a))], list(a), list(b)
    return [path_b.name], [a], [b]


def _format(name: str, value: float) -> str:
    if name == "psnr":
        return "inf" if value == float("inf") else f"{value:.2f}"
    return f"{value:.4f}"


def _table(labels: list[str], result: Comparison, names: tuple[str, ...]) -> str:
    headers = {"psnr": "PSNR (dB)", "ssim": "SSIM"}
    rows = [
        [label, *(_format(n, getattr(result, f"{n}_per_frame")[i]) for n in names)] for i, label in enumerate(labels)
    ]
    if result.count > 1:
        rows.append(["mean", *(_format(n, getattr(result, n)) for n in names)])
        rows.append(["min", *(_format(n, getattr(result, f"{n}_min")) for n in names)])
    header = ["", *(headers[n] for n in names)]
    widths = [max(len(row[col]) for row in [header, *rows]) for col in range(len(header))]
    lines = []
    for row in [header, *rows]:
        # Labels left-aligned, numbers right-aligned so that decimal points line up.
        cells = [row[0].ljust(widths[0]), *(cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _json_payload(result: Comparison, names: tuple[str, ...], multiple: bool) -> dict[str, Any]:
    payload: dict[str, Any] = {name: json_safe(getattr(result, name)) for name in names}
    if multiple:
        payload.update({f"{name}_min": json_safe(getattr(result, f"{name}_min")) for name in names})
        payload["count"] = result.count
    return payload


def run(args: argparse.Namespace) -> int:
    """Compute the requested metrics and print a table or one JSON line.

    Args:
        args: Parsed arguments of the ``metrics`` command.

    Returns:
        0 on success.

    Raises:
        CLIError: On a missing or unreadable input, mixed input kinds, unpaired names or a size mismatch.
    """
    names, path_a, path_b = _split_words(args.words)
    kind_a, kind_b = _kind(path_a, "A"), _kind(path_b, "B")
    if kind_a != kind_b:
        phrase_a, phrase_b = _KIND_PHRASES[kind_a], _KIND_PHRASES[kind_b]
        raise CLIError(f"A and B must be of one kind: A '{path_a}' is {phrase_a}, B '{path_b}' is {phrase_b}")
    labels, images_a, images_b = _load_pairs(kind_a, path_a, path_b)
    try:
        result = compare(images_a, images_b, metrics=names)
    except ValueError as error:
        raise CLIError(f"cannot compare A '{path_a}' with B '{path_b}': {error}") from error
    if args.json:
        print(json.dumps(_json_payload(result, names, multiple=kind_a != "image"), allow_nan=False))
    else:
        print(_table(labels, result, names))
    return 0
