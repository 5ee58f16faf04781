"""``fastdit.bench.report`` and ``plain``: markdown, JSON and the plot of a sweep."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from PIL import Image

import fastdit
from fastdit.bench import BenchRow, Sweep, json_ready, markdown, markdown_table, plain, plain_options, write_reports
from fastdit.session import Case, ModelSource

ROWS = [
    BenchRow("baseline", None, seconds=1.0, peak_memory=2**30),
    BenchRow("fast", plain(fastdit.FBCache()), 0.5, 2.0, 0.5, 3, 30.0, 25.0, 0.98, 0.9, None),
]


def test_markdown_table() -> None:
    table = markdown_table(("a", "b"), [(1, "x"), ("y", 2.5)], numeric=(False, True))
    assert table == "| a | b |\n|---|---:|\n| 1 | x |\n| y | 2.5 |\n"
    with pytest.raises(ValueError, match="2 columns"):
        markdown_table(("a", "b"), [(1,)])


def test_markdown_of_rows() -> None:
    lines = markdown(ROWS, "title").splitlines()
    assert lines[:2] == ["# title", ""]
    assert lines[2].startswith("| Configuration | Latency (s/image) |") and lines[3] == "|---|" + "---:|" * 6
    assert lines[4] == "| baseline | 1.000 | 1.00x | 100.0% | ∞ / ∞ | 1.0000 / 1.0000 | 1.00 |"
    assert lines[5] == "| fast | 0.500 | 2.00x | 50.0% | 30.00 / 25.00 | 0.9800 / 0.9000 | - |"


def test_plain_data() -> None:
    config = plain(fastdit.FBCache(threshold=0.2))
    assert config["type"] == "DBCache" and config["threshold"] == 0.2 and plain(None) is None
    options = plain_options({"cache": fastdit.FBCache(), "other": 3})
    assert options["cache"]["fn"] == 1 and options["other"] == 3
    assert json_ready({"a": [math.inf, 1.0, (-math.inf,)], "b": math.nan}) == {"a": ["inf", 1.0, ["-inf"]], "b": "nan"}


def test_write_reports(tmp_path: Path) -> None:
    sweep = Sweep(
        source=ModelSource("m", "diffusers.FluxPipeline"),
        pipeline_class=type("FluxPipeline", (), {}),
        kwargs={"height": 32, "image": object()},
        cases=[Case("b", 1), Case("a", 0), Case("a", 1)],
        configs=[("fast", fastdit.FBCache())],
        num_steps=4,
    )
    report, table = write_reports(tmp_path, sweep, ROWS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json", "bench.md", "bench.png"]
    assert json.loads((tmp_path / "bench.json").read_text()) == report
    assert (tmp_path / "bench.md").read_text() == table and table.startswith("# m: 3 images, 4 steps, cpu\n")
    assert report["pipeline"] == "FluxPipeline" and report["call"] == {"height": 32}  # plain values only
    assert report["prompts"] == ["a", "b"] and report["seeds"] == [0, 1] and report["rows"][0]["psnr"] == "inf"
    with Image.open(tmp_path / "bench.png") as image:
        assert image.format == "PNG"
