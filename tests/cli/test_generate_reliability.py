"""``fastdit generate``: a step mask shorter than the run, the distributed timeout flag, and how a distributed run
that loses a rank (timeout, interrupt) ends: one line per rank, never a raw backend error."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fastdit.cli import build_parser, main
from fastdit.cli import generate as generate_module
from fastdit.cli.distributed import EXIT_FAILED, EXIT_INTERRUPTED, report_stop
from fastdit.cli.generate import plan_from_args
from fastdit.config import DEFAULT_TIMEOUT_S
from fastdit.parallel.failures import CollectiveError
from fastdit.testing.signals import default_sigint

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


def _plan(*argv: str) -> Any:
    return plan_from_args(build_parser().parse_args(["generate", *argv]))


def test_dist_timeout_sets_parallel_timeout_s(tiny_flux_dir: Path) -> None:
    plan = _plan("--model-path", str(tiny_flux_dir), "--prompt", "a", *TINY, "--parallel", "ulysses=1")
    assert plan.acceleration["parallel"].timeout_s == DEFAULT_TIMEOUT_S
    plan = _plan(
        "--model-path", str(tiny_flux_dir), "--prompt", "a", *TINY, "--parallel", "ulysses=1", "--dist-timeout", "7.5"
    )
    assert plan.acceleration["parallel"].timeout_s == 7.5


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dist-timeout", "5"], "argument --dist-timeout: applies only to a run with --parallel"),
        (
            ["--parallel", "ulysses=1", "--dist-timeout", "0"],
            "argument --dist-timeout 0: Parallel.timeout_s=0.0: must be a finite number >= 1",
        ),
    ],
)
def test_bad_dist_timeout_is_one_line(
    argv: list[str], message: str, tiny_flux_dir: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _never_load(monkeypatch)
    code, stdout, err = _run(capsys, "--model-path", str(tiny_flux_dir), "--prompt", "a", *TINY, *argv)
    assert code == 2 and stdout == ""
    assert err.strip().splitlines() == [f"fastdit: error: {message}"]


def _timeout(unanswered: list[int] | None) -> CollectiveError:
    cause = "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation to complete"
    return CollectiveError(rank=0, world_size=4, kind="timeout", timeout_s=3.0, unanswered=unanswered, cause=cause)


@pytest.mark.parametrize(
    ("stop", "code", "line"),
    [
        (
            _timeout([2]),
            EXIT_FAILED,
            "fastdit: error: rank 0 of 4: a collective timed out after 3 s: rank 2 stopped answering (stalled, "
            "stopped, or still busy elsewhere); --dist-timeout sets how long ranks wait",
        ),
        (
            CollectiveError(rank=1, world_size=2, kind="left", timeout_s=None, unanswered=[0], cause="reset"),
            EXIT_FAILED,
            "fastdit: error: rank 1 of 2: rank 0 left the run during a collective (killed, interrupted or ended by "
            "its own error: see its output)",
        ),
        (KeyboardInterrupt(), EXIT_INTERRUPTED, "fastdit: interrupted (rank 1 of 2)"),
    ],
)
def test_a_lost_rank_or_an_interrupt_under_torchrun_is_one_line(
    stop: BaseException, code: int, line: str, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert report_stop(stop) == code
    assert capsys.readouterr().err.splitlines() == [line]


def test_an_interrupt_of_one_process_is_left_to_the_command_line() -> None:
    with pytest.raises(KeyboardInterrupt):
        report_stop(KeyboardInterrupt())


def _children(pid: int) -> dict[int, int]:
    """The processes ``torchrun`` (``pid``) started, by their ``RANK``."""
    ranks = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):  # gone meanwhile, or not ours to read
            continue
        rank = [item[5:] for item in environ if item.startswith(b"RANK=")]
        if parent == pid and rank:
            ranks[int(rank[0])] = int(entry.name)
    return ranks


def _rank_lines(logs: Path) -> dict[int, list[str]]:
    """Each rank's stderr lines so far (``--redirects`` sends them to files, apart from torchrun's own)."""
    return {
        int(path.parent.name): [line.strip() for line in re.split(r"[\r\n]", path.read_text()) if line.strip()]
        for path in logs.glob("**/stderr.log")
    }


def _torchrun_until(
    tiny_flux_dir: Path, logs: Path, act: Callable[[subprocess.Popen], None], *flags: str
) -> dict[int, list[str]]:
    """Start a long 2-rank run, call ``act`` with the launcher once rank 0 denoises, wait for the end; return each
    rank's stderr lines."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"),
        *("--log-dir", str(logs), "--redirects", "3", "-m", "fastdit", "generate"),
        *("--model-path", str(tiny_flux_dir), "--prompt", "a cat", "--height", "32", "--width", "32"),
        *("--steps", "5000", "--parallel", "ulysses=2", *flags),
    ]
    launcher = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=default_sigint
    )
    try:
        deadline = time.monotonic() + 180
        while not any("/5000 [" in line for line in _rank_lines(logs).get(0, [])):  # rank 0's progress bar
            assert launcher.poll() is None and time.monotonic() < deadline, "the run did not reach its steps"
            time.sleep(0.2)
        act(launcher)
        launcher.wait(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode != 0
    return _rank_lines(logs)


def _assert_one_line_each(lines: dict[int, list[str]]) -> None:
    assert sorted(lines) == [0, 1]
    for rank, output in lines.items():
        assert not [line for line in output if "Traceback" in line or "gloo" in line], output
        ours = [line for line in output if line.startswith("fastdit:")]
        interrupted = f"fastdit: interrupted (rank {rank} of 2)"
        assert len(ours) == 1 and (ours[0] == interrupted or ours[0].startswith(f"fastdit: error: rank {rank} of 2: "))


@pytest.mark.slow
@pytest.mark.parametrize("target", ["torchrun", "rank1"])
def test_an_interrupted_torchrun_ends_each_rank_with_one_line(tiny_flux_dir: Path, tmp_path: Path, target: str) -> None:
    """Ctrl-C reaches torchrun, which passes SIGINT to every rank; or one rank alone is interrupted."""

    def interrupt(launcher: subprocess.Popen) -> None:
        os.kill(launcher.pid if target == "torchrun" else _children(launcher.pid)[1], signal.SIGINT)

    lines = _torchrun_until(tiny_flux_dir, tmp_path / "logs", interrupt)
    _assert_one_line_each(lines)
    if target == "rank1":  # the survivor says who left, instead of the backend's socket error
        assert lines[1][-1] == "fastdit: interrupted (rank 1 of 2)"
        assert lines[0][-1].startswith("fastdit: error: rank 0 of 2: rank 1 left the run during a collective")


@pytest.mark.slow
def test_a_stopped_rank_under_torchrun_ends_its_peer_after_dist_timeout(tiny_flux_dir: Path, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    waited: list[float] = []

    def stop_rank_1(launcher: subprocess.Popen) -> None:
        stopped = _children(launcher.pid)[1]
        os.kill(stopped, signal.SIGSTOP)
        start = time.monotonic()
        while not any(line.startswith("fastdit:") for line in _rank_lines(logs).get(0, [])):
            assert time.monotonic() - start < 60, "rank 0 kept waiting"
            time.sleep(0.1)
        waited.append(time.monotonic() - start)
        os.kill(stopped, signal.SIGKILL)  # torchrun would wait 30 s for a stopped rank to honour its SIGTERM

    lines = _torchrun_until(tiny_flux_dir, logs, stop_rank_1, "--dist-timeout", "3")
    assert 2.5 < waited[0] < 3.0 + 1.0 + 3.0  # the timeout, the answer grace, slack for a busy machine
    (line,) = [line for line in lines[0] if line.startswith("fastdit:")]
    assert line.startswith("fastdit: error: rank 0 of 2: a collective timed out after 3 s: rank 1 stopped answering")
    assert line.endswith("--dist-timeout sets how long ranks wait")
