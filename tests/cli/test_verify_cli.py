"""``fastdit verify``: the table, ``--json`` and ``--grid``, exit code 1 for a failed row and 2 for bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import fastdit.cli as cli
from fastdit.io import load_image

HEADER = "| Configuration | Latency | PSNR (dB) | SSIM | Peak memory | Result |"
# 12 steps keep the reference pipeline's cache row above 30 dB (measured 35.4) in a fraction of the default 28's time.
FAST = ["--steps", "12", "--warmup", "0"]


def _reference_available() -> bool:
    try:
        from fastdit.reference import reference_dir

        reference_dir()
    except (ImportError, FileNotFoundError):
        return False
    return True


needs_reference = pytest.mark.skipif(not _reference_available(), reason="the reference weights are not installed")


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(["verify", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@needs_reference
@pytest.mark.usefixtures("single_process")
def test_reference_pipeline_passes_in_one_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report, grid = tmp_path / "out" / "verify.json", tmp_path / "grid.png"
    code, out, err = _run(capsys, *FAST, "--json", str(report), "--grid", str(grid))
    assert code == 0, err
    assert out.startswith("# reference (FluxPipeline): 12 steps, 1 process, cpu") and HEADER in out
    assert "| skipped: needs 2 processes |" in out and "| skipped: needs 4 processes |" in out
    data = json.loads(report.read_text())
    rows = {row["name"]: row for row in data["rows"]}
    assert data["passed"] and data["world_size"] == 1 and rows["cache"]["status"] == "pass"
    assert 30 < rows["cache"]["psnr_min"] < 200 and rows["ulysses"]["reason"] == "needs 2 processes"
    assert load_image(grid).ndim == 3  # baseline and cache tiles
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["grid.png", "verify.json"]


@needs_reference
@pytest.mark.usefixtures("single_process")
def test_failed_row_exits_1_and_still_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A cache approximates: no cached run reaches 1000 dB, so the threshold override breaks the row.
    report = tmp_path / "verify.json"
    code, out, err = _run(capsys, *FAST, "--ladder", "cache", "--min-psnr", "1000", "--json", str(report))
    assert code == 1
    assert "| fail: PSNR" in out and "fastdit: verify: cache failed: PSNR" in err
    data = json.loads(report.read_text())
    assert not data["passed"] and data["rows"][1]["status"] == "fail"


@pytest.mark.usefixtures("single_process")
def test_tiny_target(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "tiny:flux", "--ladder", "cache,tp", "--warmup", "0")
    assert code == 0, err
    assert out.startswith("# tiny:flux:flux (FluxPipeline): 2 steps, 1 process") and "| tp | - |" in out


@pytest.mark.usefixtures("single_process")
def test_pipeline_directory_target(tiny_flux_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, str(tiny_flux_dir), "--ladder", "cache", "--steps", "2", "--prompt", "a cat")
    assert code == 0, err
    assert out.startswith(f"# {tiny_flux_dir} (FluxPipeline): 2 steps") and "| pass |" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--ladder", "cache,pp"],
            "argument --ladder cache,pp: unknown ladder entry 'pp'; known: cache, fuse, ulysses",
        ),
        (["no-such-model"], "unknown target 'no-such-model': not a registered model name, tiny:FAMILY"),
        (["tiny:no-such-family"], "unknown target 'tiny:no-such-family'"),
        (["tiny:flux:nope"], "unknown target 'tiny:flux:nope': family 'flux' has no tiny pipeline 'nope'"),
        (["--min-psnr", "nan"], "argument --min-psnr nan: must be a finite number"),
        (["--steps", "0"], "argument --steps 0: must be positive"),
        (["tests.cache.toy_joint_dit:nothing"], "target 'tests.cache.toy_joint_dit:nothing': cannot import 'nothing'"),
        (
            ["tests.cache.toy_joint_dit:example"],
            "target 'tests.cache.toy_joint_dit:example': ToyJointDiT is not a pipeline",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, *argv)
    assert code == cli.EXIT_USAGE and out == ""
    assert err.startswith(f"fastdit: error: {message}") and err.count("\n") == 1, err


def _torchrun_verify(argv: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "fastdit", "verify"]
    return subprocess.run([*command, *argv], capture_output=True, text=True, env=env, timeout=480)


@needs_reference
@pytest.mark.slow
def test_torchrun_reference_ladder(tmp_path: Path) -> None:
    report, grid = tmp_path / "verify.json", tmp_path / "grid.png"
    done = _torchrun_verify([*FAST, "--json", str(report), "--grid", str(grid)])
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(HEADER) == 1  # rank 0 prints
    data: dict[str, Any] = json.loads(report.read_text())
    statuses = {row["name"]: row["status"] for row in data["rows"]}
    assert data["world_size"] == 2 and data["passed"]
    assert {name: statuses[name] for name in ("cache", "ulysses", "ring", "tp", "tep", "vaep")} == dict.fromkeys(
        ("cache", "ulysses", "ring", "tp", "tep", "vaep"), "pass"
    )
    assert statuses["usp"] == "skipped" and statuses["cfg"] == "not available"  # no CFG in the default call
    assert grid.is_file()


THIRD_PARTY = "tests.cache.toy_joint_dit:pipeline"


@pytest.mark.usefixtures("single_process")
def test_a_third_party_pipeline_function_with_its_adapter(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, THIRD_PARTY, "--ladder", "cache", "--warmup", "0")
    assert code == 0, err
    assert out.startswith(f"# {THIRD_PARTY} (ToyJointPipeline): 8 steps, 1 process, cpu")
    assert "| cache (DBCache F1B0, threshold 0.3) |" in out and out.rstrip().endswith("| pass |")


@pytest.mark.slow
def test_torchrun_third_party_ladder(tmp_path: Path) -> None:
    """The integration proof: a model fastdit does not know, its adapter as inspect proposes it (plus the CP plan
    its report points to), verified over 2 processes: cache, Ulysses and ring pass, TP and VAE rows say why not."""
    report = tmp_path / "verify.json"
    done = _torchrun_verify(
        [THIRD_PARTY, "--warmup", "0", "--ladder", "cache,ulysses,ring,tp,vaep", "--json", str(report)]
    )
    assert done.returncode == 0, done.stderr
    statuses = {row["name"]: row["status"] for row in json.loads(report.read_text())["rows"]}
    assert statuses == {
        "baseline": "baseline",
        "cache": "pass",
        "ulysses": "pass",
        "ring": "pass",
        "tp": "not available",
        "vaep": "not available",
    }
