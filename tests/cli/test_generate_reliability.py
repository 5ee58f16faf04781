"""``fastdit generate``: a step mask shorter than the run, the distributed timeout flag, and how a distributed run
that loses a rank (timeout, interrupt) ends: one line per rank, never a raw backend error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fastdit.cli import generate as generate_module
from fastdit.cli import main

pytestmark = pytest.mark.usefixtures("single_process")

TINY = ["--height", "32", "--width", "32", "--quiet"]


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["generate", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _never_load(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(generate_module, "timed_load", refuse)


def test_a_step_mask_shorter_than_the_run_is_refused_before_loading(
    tiny_flux_dir: Path, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _never_load(monkeypatch)
    out = tmp_path / "x.png"
    mask = ["--step-mask", "0,1", "--step-mask-num-steps", "2"]
    code, stdout, err = _run(
        capsys, "--model-path", str(tiny_flux_dir), "--prompt", "a", *TINY, "--steps", "3", *mask, "--out", str(out)
    )
    assert code == 2 and stdout == "" and not out.exists()
    (line,) = err.strip().splitlines()
    assert line.startswith("fastdit: error: argument --step-mask-num-steps 2: StepMask.num_steps=2: ")
    assert "this run has 3 steps" in line
