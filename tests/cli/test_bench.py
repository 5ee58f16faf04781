"""``fastdit bench``: baseline plus configurations on the same prompts and seeds → bench.json, bench.md, bench.png."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from fastdit.cache.presets import DEFAULT_CACHE_PRESET, cache_config
from fastdit.cli import CLIError, main
from fastdit.cli.options import cache_from_spec
from fastdit.config import StepMask, TaylorSeer
from fastdit.session import Session

pytestmark = pytest.mark.usefixtures("single_process")

TINY = ["--height", "32", "--width", "32", "--steps", "4", "--quiet", "--warmup", "0"]
CONFIGS = "none;fbcache,threshold=0.5,warmup_steps=1"


def test_bench_writes_json_markdown_and_plot(tiny_flux_dir: Path, tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "bench"
    argv = ["bench", "--model-path", str(tiny_flux_dir), "--configs", CONFIGS, "--prompts", "2", "--seeds", "0,1"]
    assert main([*argv, *TINY, "--out", str(out), "--json", "--save-images"]) == 0
    captured = capsys.readouterr()
    assert sorted(p.name for p in out.iterdir()) == ["bench.json", "bench.md", "bench.png", "images"]

    report = json.loads((out / "bench.json").read_text())
    assert json.loads(captured.out.strip().splitlines()[-1]) == report["rows"]
    assert report["model"] == str(tiny_flux_dir) and report["steps"] == 4 and report["seeds"] == [0, 1]
    assert len(report["prompts"]) == 2
    baseline, none, cached = report["rows"]
    assert [baseline["name"], none["name"], cached["name"]] == [
        "baseline",
        "none",
        "fbcache,threshold=0.5,warmup_steps=1",
    ]
    assert baseline["speedup"] == 1.0 and baseline["psnr"] == "inf"
    assert none["config"] is None and none["psnr"] == "inf" and none["ssim_min"] == 1.0  # runs are deterministic
    assert cached["config"]["threshold"] == 0.5 and cached["config"]["max_continuous_cached_steps"] == 3
    assert cached["blocks_computed_fraction"] < 1 and cached["cached_steps"] > 0
    assert 20 < cached["psnr_min"] <= cached["psnr"] < float("inf")
    assert all(row["seconds"] > 0 and row["peak_memory"] for row in report["rows"])

    table = (out / "bench.md").read_text().splitlines()
    header = "| Configuration | Latency (s/image) | Speed-up | Blocks computed | PSNR (dB) | SSIM | Memory (GiB) |"
    assert header in table
    assert any(line.startswith("| none |") and "∞ / ∞" in line for line in table)
    assert any(line.startswith("| fbcache,threshold=0.5") for line in table)
    with Image.open(out / "bench.png") as plot:
        assert plot.format == "PNG" and plot.width > 400
    assert sorted(p.name for p in (out / "images" / "02").iterdir()) == ["0000.png", "0001.png", "0002.png", "0003.png"]


@pytest.mark.parametrize(
    ("configs", "needle"),
    [
        ("none;turbo", "turbo"),
        ("fbcache;fbcache", "twice"),
        ("fn=1,speed=9", "speed=9"),
        ("fbcache,threshold=-2", "threshold"),
        ("none,threshold=0.1", "none"),
        ("", "no configuration"),
    ],
)
def test_bad_configs_exit_2_before_loading(
    configs: str, needle: str, tiny_flux_dir: Path, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Session, "load", lambda *_, **__: pytest.fail("loaded before checking --configs"))
    out = tmp_path / "bench"
    assert main(["bench", "--model-path", str(tiny_flux_dir), "--configs", configs, *TINY, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("fastdit: error: argument --configs") and needle in err
    assert not out.exists()


def test_config_too_large_for_the_model_fails_before_any_run(tiny_flux_dir: Path, tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "bench"
    assert (
        main(["bench", "--model-path", str(tiny_flux_dir), "--configs", "fbcache;dbcache", *TINY, "--out", str(out)])
        == 2
    )
    err = capsys.readouterr().err
    assert "'dbcache'" in err and "fn=8" in err
    assert not out.exists()


def test_bench_seeds_and_out_are_checked(tiny_flux_dir: Path, tmp_path: Path, capsys: Any) -> None:
    base = ["bench", "--model-path", str(tiny_flux_dir), *TINY]
    assert main([*base, "--seeds", "0,x", "--out", str(tmp_path / "b")]) == 2
    assert "--seeds" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert main([*base, "--out", str(tmp_path / "file")]) == 2
    assert "--out" in capsys.readouterr().err


def test_config_specs() -> None:
    assert cache_from_spec("none", 10) is None
    assert cache_from_spec("fbcache", 10) == cache_config("fbcache")
    assert cache_from_spec("fn=1,bn=1,threshold=0.2,taylorseer=1", 10) == cache_config(
        DEFAULT_CACHE_PRESET, fn=1, bn=1, threshold=0.2, taylorseer=TaylorSeer(order=1)
    )
    # A step list keeps its commas; a preset mask is laid out over the run's steps.
    assert cache_from_spec("fbcache,step_mask=0,1,5,threshold=0.3", 10) == cache_config(
        "fbcache", step_mask=StepMask(compute_steps=(0, 1, 5)), threshold=0.3
    )
    assert cache_from_spec("fast,step-mask=ultra", 12).step_mask == StepMask.preset("ultra", 12)
    assert cache_from_spec("prune,max_pruned_ratio=0.3", 10).max_pruned_ratio == 0.3
    with pytest.raises(CLIError, match="max_pruned_ratio"):
        cache_from_spec("fbcache,max_pruned_ratio=0.3", 10)
