"""``fastdit generate``: tiny pipelines loaded from disk, outputs, JSON, cache flags, and every bad input → exit 2."""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from fastdit.cache.presets import DEFAULT_CACHE_PRESET, cache_config
from fastdit.cli import build_parser, main
from fastdit.cli.generate import plan_from_args
from fastdit.cli.options import cache_flags
from fastdit.config import DBCache, DBPrune, StepMask, TaylorSeer, config_fields
from fastdit.io import load_image, load_video
from fastdit.session import Session
from fastdit.testing.pipelines import save_tiny
from fastdit.testing.signals import default_sigint

pytestmark = pytest.mark.usefixtures("single_process")

TINY = ["--height", "32", "--width", "32", "--steps", "2", "--quiet"]


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["generate", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _last_json(text: str) -> dict[str, Any]:
    return json.loads(text.strip().splitlines()[-1])


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("fastdit: error:")]


@pytest.fixture(scope="module")
def tiny_wan_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(save_tiny("wan", str(tmp_path_factory.mktemp("tiny-wan")), "t2v"))


def test_model_path_writes_the_image_and_json(tiny_flux_dir: Path, tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "cat.png"
    code, stdout, _ = _run(
        capsys, "--model-path", str(tiny_flux_dir), "--prompt", "a cat", *TINY, "--out", str(out), "--json"
    )
    assert code == 0
    assert load_image(out).shape == (32, 32, 3)
    payload = _last_json(stdout)
    assert stdout.strip().count("\n") == 0  # with --json, stdout holds the JSON line alone
    assert payload["model"] == str(tiny_flux_dir)
    assert payload["out"] == str(out) and payload["files"] == [str(out)]
    assert payload["steps"] == 2 and payload["world_size"] == 1
    assert payload["seconds"] > 0 and payload["load_seconds"] > 0
    assert "speedup" not in payload and "cached_steps" not in payload
    assert [p.name for p in tmp_path.iterdir()] == ["cat.png"]  # atomic write: no temporary left behind


def test_registered_model_reads_its_environment_variable(
    tiny_flux_dir: Path, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLUX_DIR", str(tiny_flux_dir))
    code, stdout, _ = _run(capsys, "flux", "--prompt", "a cat", *TINY, "--out", str(tmp_path / "a.png"), "--json")
    assert code == 0
    assert _last_json(stdout)["model"] == "flux"
    assert (tmp_path / "a.png").is_file()


def test_several_prompts_fill_a_directory_in_prompt_order(tiny_flux_dir: Path, tmp_path: Path, capsys: Any) -> None:
    base = ["--model-path", str(tiny_flux_dir), *TINY, "--seed", "3"]
    code, _, _ = _run(capsys, *base, "--prompt", "a cat", "--prompt", "a red dog", "--out", str(tmp_path / "many"))
    assert code == 0
    assert sorted(p.name for p in (tmp_path / "many").iterdir()) == ["0000.png", "0001.png"]
    code, _, _ = _run(capsys, *base, "--prompt", "a red dog", "--out", str(tmp_path / "dog.png"))
    assert code == 0
    first, second = load_image(tmp_path / "many" / "0000.png"), load_image(tmp_path / "many" / "0001.png")
    # Each prompt runs alone with the same seed: the second image equals the one-prompt run of its prompt.
    np.testing.assert_array_equal(second, load_image(tmp_path / "dog.png"))
    assert not np.array_equal(first, second)


def test_cache_with_summary_and_compare(tiny_flux_dir: Path, capsys: Any) -> None:
    code, stdout, err = _run(
        capsys,
        "--model-path",
        str(tiny_flux_dir),
        "--prompt",
        "a cat",
        *TINY,
        "--steps",
        "6",
        "--cache",
        "fbcache",
        "--cache-threshold",
        "0.5",
        "--cache-warmup-steps",
        "1",
        "--summary",
        "--compare",
        "--track-memory",
        "--json",
    )
    assert code == 0
    payload = _last_json(stdout)
    assert payload["steps"] == 6
    assert payload["acceleration"]["cache"]["threshold"] == 0.5
    assert payload["acceleration"]["cache"]["max_continuous_cached_steps"] == 3  # from the fbcache preset
    assert 1 <= payload["cached_steps"] <= 5
    assert 0 < payload["blocks_computed_fraction"] < 1
    for key in ("baseline_seconds", "speedup", "psnr", "psnr_min", "ssim", "ssim_min", "peak_memory_bytes"):
        assert key in payload, key
    assert isinstance(payload["psnr"], float) and payload["psnr"] > 20
    assert 0 < payload["ssim"] <= 1
    assert "steps cached" in err  # the --summary statistics (on stderr with --json)
    assert "speed-up" in err


def test_threshold_zero_is_identical_to_the_baseline(tiny_flux_dir: Path, capsys: Any) -> None:
    code, stdout, _ = _run(
        capsys,
        "--model-path",
        str(tiny_flux_dir),
        "--prompt",
        "a cat",
        *TINY,
        "--cache-threshold",
        "0",
        "--compare",
        "--json",
    )
    assert code == 0
    payload = _last_json(stdout)
    assert payload["acceleration"]["cache"]["type"] == "DBCache"  # a field flag alone implies --cache
    assert payload["cached_steps"] == 0 and payload["blocks_computed_fraction"] == 1.0
    assert payload["psnr"] == "inf" and payload["ssim"] == 1.0


def test_video_pipeline_writes_mp4(tiny_wan_dir: Path, tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "clip.mp4"
    code, stdout, _ = _run(
        capsys,
        "--model-path",
        str(tiny_wan_dir),
        "--prompt",
        "a cat",
        *TINY,
        "--frames",
        "5",
        "--out",
        str(out),
        "--json",
    )
    assert code == 0
    assert load_video(out).shape == (5, 32, 32, 3)
    assert _last_json(stdout)["frames"] == 5


def test_video_frames_must_fit_the_temporal_vae_factor(tiny_wan_dir: Path, tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "clip.mp4"
    code, _, err = _run(
        capsys, "--model-path", str(tiny_wan_dir), "--prompt", "a", *TINY, "--frames", "6", "--out", str(out)
    )
    assert code == 2
    assert _error_lines(err) == [
        "fastdit: error: argument --frames 6: must be one more than a multiple of 4 for WanPipeline "
        "(temporal VAE factor), e.g. 5"
    ]
    assert not out.exists()
    code, _, err = _run(
        capsys, "--model-path", str(tiny_wan_dir), "--prompt", "a", *TINY, "--out", str(tmp_path / "x.png")
    )
    assert code == 2 and "a video needs one of the suffixes" in err


def test_only_rank_zero_writes(
    tiny_flux_dir: Path, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "1")
    code, stdout, _ = _run(
        capsys, "--model-path", str(tiny_flux_dir), "--prompt", "a", *TINY, "--out", str(tmp_path / "x.png")
    )
    assert code == 0
    assert stdout == "" and not (tmp_path / "x.png").exists()


def test_every_cache_field_has_a_flag() -> None:
    fields = {name for cls in (DBCache, DBPrune) for name, _, _ in config_fields(cls)}
    nested = {f"taylorseer_{name}" for name, _, _ in config_fields(TaylorSeer) if name != "order"}
    nested |= {f"step_mask_{name}" for name, _, _ in config_fields(StepMask) if name != "compute_steps"}
    flags = {flag.field: flag.flag for flag in cache_flags()}
    assert set(flags) == fields | nested
    assert flags["fn"] == "--cache-fn" and flags["warmup_steps"] == "--cache-warmup-steps"
    assert flags["taylorseer"] == "--taylorseer" and flags["step_mask"] == "--step-mask"
    assert flags["step_mask_policy"] == "--step-mask-policy"
    help_text = build_parser()._subparsers._group_actions[0].choices["generate"].format_help()
    for flag in flags.values():
        assert flag in help_text


def _plan(*argv: str) -> Any:
    return plan_from_args(build_parser().parse_args(["generate", *argv]))


def test_field_flags_override_the_preset(tiny_flux_dir: Path) -> None:
    plan = _plan(
        "--model-path", str(tiny_flux_dir), "--prompt", "a", "--steps", "12", "--cache", "fast", "--taylorseer", "2",
        "--step-mask", "medium", "--cache-max-cached-steps", "5", "--cache-separate-cfg", "false",
    )  # fmt: skip
    expected = cache_config(
        "fast", taylorseer=TaylorSeer(order=2), step_mask=StepMask.preset("medium", 12), max_cached_steps=5,
        separate_cfg=False,
    )  # fmt: skip
    assert plan.acceleration == {"cache": expected}
    assert plan.num_steps == 12 and plan.kwargs["num_inference_steps"] == 12
    plan = _plan(
        "--model-path", str(tiny_flux_dir), "--prompt", "a", "--cache", "--step-mask", "0,1,5", "--taylorseer", "0"
    )
    assert plan.acceleration["cache"] == cache_config(
        DEFAULT_CACHE_PRESET, taylorseer=None, step_mask=StepMask(compute_steps=(0, 1, 5), policy="dynamic")
    )
    assert _plan("--model-path", str(tiny_flux_dir), "--prompt", "a", "--cache", "none").acceleration == {}
    plan = _plan(
        "--model-path", str(tiny_flux_dir), "--prompt", "a", "--step-mask", "0,2", "--step-mask-policy", "static"
    )
    assert plan.acceleration["cache"].step_mask == StepMask(compute_steps=(0, 2), policy="static")


def test_threads(tiny_flux_dir: Path) -> None:
    before = torch.get_num_threads()
    try:
        _plan("--model-path", str(tiny_flux_dir), "--prompt", "a", "--threads", "2", "--device", "cpu")
        assert torch.get_num_threads() == 2
        _plan("--prompt", "a handwritten digit 1", "--device", "cpu")  # the reference pipeline: one thread
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


BAD_BEFORE_LOADING = [
    (["nosuchmodel", "--prompt", "a"], "MODEL 'nosuchmodel'"),
    (["flux", "--prompt", "a"], "FLUX_DIR"),
    (["--model-path", "{missing}", "--prompt", "a"], "--model-path"),
    (["--model-path", "{tiny}", "--prompt", "a", "--steps", "-1"], "--steps -1"),
    (["--model-path", "{tiny}", "--prompt", "a", "--height", "0"], "--height 0"),
    (["--model-path", "{tiny}", "--prompt", "a", "--repeat", "0"], "--repeat 0"),
    (["--model-path", "{tiny}", "--prompt", "a", "--threads", "0"], "--threads 0"),
    (["--model-path", "{tiny}", "--prompt", "a", "--parallel", "ulysses=3"], "--parallel ulysses=3"),
    (["--model-path", "{tiny}", "--prompt", "a", "--parallel", "ulysses:2"], "--parallel"),
    (["--model-path", "{tiny}", "--prompt", "a", "--parallel", "heads=2"], "--parallel"),
    (["--model-path", "{tiny}", "--prompt", "a", "--cache", "turbo"], "--cache turbo"),
    (["--prompt", "a", "--cache", "flux"], "fastdit generate flux --cache"),
    (["--model-path", "{tiny}", "--prompt", "a", "--cache-threshold", "abc"], "--cache-threshold"),
    (["--model-path", "{tiny}", "--prompt", "a", "--cache-threshold", "-1"], "--cache-threshold -1"),
    (["--model-path", "{tiny}", "--prompt", "a", "--cache-max-pruned-ratio", "0.5"], "--cache-max-pruned-ratio"),
    (["--model-path", "{tiny}", "--prompt", "a", "--taylorseer", "3"], "--taylorseer 3"),
    (["--model-path", "{tiny}", "--prompt", "a", "--step-mask", "sometimes"], "--step-mask"),
    (["--model-path", "{tiny}", "--prompt", "a", "--step-mask-policy", "static"], "--step-mask-policy static"),
    (
        ["--model-path", "{tiny}", "--prompt", "a", "--step-mask", "fast", "--step-mask-policy", "x"],
        "--step-mask-policy x",
    ),
    (["--model-path", "{tiny}", "--prompt", "a", "--cache", "prune", "--taylorseer", "1"], "--taylorseer 1"),
    (["--model-path", "{tiny}", "--prompt", "a", "--attention", "warp"], "--attention backend=warp"),
    (
        ["--model-path", "{tiny}", "--prompt", "a", "--load", "rank-0"],
        "argument --load rank-0: must be one of 'every-rank', 'rank0', 'node-rank0'",
    ),
    (["--model-path", "{tiny}", "--prompt", "a", "--frames", "9"], "--frames 9"),
    (["--model-path", "{tiny}", "--prompt", "a", "--out", "{out}/x.gif"], "an image needs one of the suffixes"),
    (["--model-path", "{tiny}", "--prompt", "a", "--prompt", "b", "--out", "{out}/x.png"], "--out"),
    (["--model-path", "{tiny}", "--prompt", "a", "--compare"], "--compare"),
    (["--model-path", "{tiny}"], "--prompt"),
    # Outputs that cannot be written.
    (["--model-path", "{tiny}", "--prompt", "a", "--out", "{file}/x.png"], "file is a file, not a directory"),
    (["--model-path", "{tiny}", "--prompt", "a", "--out", "{file}/new/x.png"], "file is a file, not a directory"),
    (["--model-path", "{tiny}", "--prompt", "a", "--prompt", "b", "--out", "{file}"], "need a directory"),
    (["--model-path", "{tiny}", "--prompt", "a", "--out", "/proc/x.png"], "/proc is not writable"),
    # Model directories that are not what they should be.
    (["--model-path", "{tiny}/model_index.json", "--prompt", "a"], "is a file, not a directory"),
    (["flux", "--model-path", "{wan}", "--prompt", "a"], "holds a WanPipeline"),
    (["--model-path", "{no-vae}", "--prompt", "a"], "missing vae/"),
    (["--model-path", "{truncated}", "--prompt", "a"], "diffusion_pytorch_model.safetensors is truncated"),
    (["--model-path", "{garbled-header}", "--prompt", "a"], "has a garbled header"),
    # Absurd numbers.
    (["--model-path", "{tiny}", "--prompt", "a", "--seed", "99999999999999999999999"], "must be at most"),
    (["--model-path", "{tiny}", "--prompt", "a", "--steps", "1000000000000"], "--steps 1000000000000: must be at"),
    (["--model-path", "{tiny}", "--prompt", "a", "--steps", "100000"], "--steps 100000: must be at most 10000"),
    (["--model-path", "{tiny}", "--prompt", "a", "--height", "20000"], "--height 20000: must be at most 16384"),
    (["--model-path", "{tiny}", "--prompt", "a", "--repeat", "100000"], "--repeat 100000: must be at most"),
    (["--model-path", "{tiny}", "--prompt", "a", "--true-cfg", "inf"], "--true-cfg inf: must be a finite number"),
    (["--model-path", "{tiny}", "--prompt", "a", "--guidance", "nan"], "--guidance nan: must be a finite number"),
]


@pytest.mark.parametrize(("argv", "needle"), BAD_BEFORE_LOADING, ids=[n for _, n in BAD_BEFORE_LOADING])
def test_bad_input_exits_2_before_loading(
    argv: list[str],
    needle: str,
    tiny_flux_dir: Path,
    tiny_wan_dir: Path,
    broken_flux_dirs: dict[str, Path],
    tmp_path: Path,
    capsys: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("FLUX_DIR", raising=False)

    def refuse(*_: Any, **__: Any) -> None:
        raise AssertionError("loaded weights before checking the arguments")

    monkeypatch.setattr(Session, "load", refuse)
    out = tmp_path / "out"
    (tmp_path / "file").write_text("not a directory")
    values = {
        "tiny": str(tiny_flux_dir),
        "wan": str(tiny_wan_dir),
        "missing": str(tmp_path / "nowhere"),
        "out": str(out),
        "file": str(tmp_path / "file"),
        **{kind: str(path) for kind, path in broken_flux_dirs.items()},
    }
    argv = [a.format(**values) for a in argv]
    code, stdout, err = _run(capsys, *argv, *([] if "--out" in argv else ["--out", str(out / "x.png")]))
    assert code == 2
    lines = _error_lines(err)
    assert len(lines) == 1 and needle in lines[0], err
    assert stdout == "" and not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # nothing created, not even a directory


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_output_directory_exits_2_before_loading(
    tiny_flux_dir: Path, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Session, "load", lambda *_, **__: pytest.fail("loaded weights before checking --out"))
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        code, _, err = _run(capsys, "--model-path", str(tiny_flux_dir), "--prompt", "a", "--out", f"{locked}/x.png")
    finally:
        locked.chmod(0o700)
    assert code == 2 and _error_lines(err) == [
        f"fastdit: error: argument --out {locked}/x.png: {locked} is not writable (Permission denied)"
    ]


BAD_AFTER_LOADING = [
    (["--height", "30"], {}, "--height 30"),
    (["--true-cfg", "1e30"], {}, "argument --true-cfg 1e+30 is far above the usual guidance scales"),
    (["--width", "34"], {}, "--width 34"),
    (["--cache", "dbcache"], {}, "fn=8"),
    # The tiny model has 2 heads: tp=3 is refused by the plan check, before any process group is formed.
    (["--parallel", "tp=3"], {"WORLD_SIZE": "3", "RANK": "0"}, "not divisible by tp=3"),
    (["--cuda-graph"], {}, "argument --cuda-graph"),
    (["--cuda-graph", "--cache", "fbcache"], {}, "argument --cuda-graph"),
]


@pytest.mark.parametrize(("argv", "env", "needle"), BAD_AFTER_LOADING, ids=[n for *_, n in BAD_AFTER_LOADING])
def test_bad_input_found_after_loading_writes_nothing(
    argv: list[str],
    env: dict[str, str],
    needle: str,
    tiny_flux_dir: Path,
    tmp_path: Path,
    capsys: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "out" / "x.png"
    code, stdout, err = _run(
        capsys, "--model-path", str(tiny_flux_dir), "--prompt", "a", *TINY, *argv, "--out", str(out)
    )
    assert code == 2
    lines = _error_lines(err)
    assert len(lines) == 1 and needle in lines[0], err
    assert stdout == "" and not out.parent.exists()


@pytest.mark.parametrize(
    ("kind", "needle"),
    [
        ("garbled-config", "--model-path {dir}: cannot be loaded as FluxPipeline: OSError: "),
        ("nan-weights", "likely cause: the weights of transformer hold NaN or inf values"),
    ],
)
def test_broken_weights_found_while_loading_or_running_write_nothing(
    kind: str, needle: str, broken_flux_dirs: dict[str, Path], tmp_path: Path, capsys: Any
) -> None:
    directory = broken_flux_dirs[kind]
    out = tmp_path / "out" / "x.png"
    code, stdout, err = _run(capsys, "--model-path", str(directory), "--prompt", "a", *TINY, "--out", str(out))
    assert code == 2
    lines = _error_lines(err)
    assert len(lines) == 1 and needle.format(dir=directory) in lines[0], err
    assert stdout == "" and list(tmp_path.iterdir()) == []


def test_a_failed_save_of_several_outputs_leaves_none(
    tiny_flux_dir: Path, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_save, calls = Image.Image.save, []

    def full_disk_at_the_third(self: Image.Image, *args: Any, **kwargs: Any) -> None:
        calls.append(1)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(self, *args, **kwargs)

    monkeypatch.setattr(Image.Image, "save", full_disk_at_the_third)
    prompts = [arg for index in range(6) for arg in ("--prompt", f"a cat number {index}")]
    out = tmp_path / "cats"
    code, stdout, err = _run(capsys, "--model-path", str(tiny_flux_dir), *prompts, *TINY, "--out", str(out))
    assert code == 2
    assert _error_lines(err) == [
        f"fastdit: error: argument --out {out}: cannot save ([Errno 28] No space left on device); nothing was saved"
    ]
    assert stdout == "" and list(tmp_path.iterdir()) == []  # no image, no staging directory


def test_out_expands_home_and_collapses_dot_dot(
    tiny_flux_dir: Path, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    base = ["--model-path", str(tiny_flux_dir), "--prompt", "a", *TINY]
    code, stdout, _ = _run(capsys, *base, "--out", "~/x.png", "--json")
    assert code == 0 and _last_json(stdout)["out"] == str(home / "x.png")
    assert [p.name for p in home.iterdir()] == ["x.png"]
    code, stdout, _ = _run(capsys, *base, "--out", "a/sub/../y.png", "--json")
    assert code == 0 and _last_json(stdout)["out"] == "a/y.png"
    assert sorted(str(p.relative_to(work)) for p in work.rglob("*")) == ["a", "a/y.png"]  # no empty a/sub


def test_errors_after_the_pipeline_import_are_one_line(tiny_flux_dir: Path) -> None:
    """Importing a pipeline prints no notes about missing optional backends (torchvision) before the error."""
    done = _subprocess("--model-path", str(tiny_flux_dir), "--prompt", "a", *TINY, "--height", "30")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "fastdit: error: argument --height 30: must be a multiple of 4 for FluxPipeline (VAE factor × patch size)"
    ]


@pytest.mark.skipif(os.name != "posix", reason="SIGINT to a child process is POSIX")
def test_ctrl_c_is_one_line_and_exit_130(tiny_flux_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "never.png"
    argv = ["--model-path", str(tiny_flux_dir), "--prompt", "a", "--height", "32", "--width", "32"]
    env = {**os.environ, "FASTDIT_TEST_THREADS": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "fastdit", "generate", *argv, "--steps", "10000", "--out", str(out)]
    child = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env, preexec_fn=default_sigint)
    assert child.stderr is not None
    seen = ""
    while seen.count("/10000") < 2:  # the progress bar moved: the denoising loop is running
        char = child.stderr.read(1)
        assert char, f"the run ended before denoising: {seen}"
        seen += char
    child.send_signal(signal.SIGINT)
    rest = child.stderr.read()
    assert child.wait(timeout=120) == 130
    lines = [line for line in (seen + rest).splitlines() if line.strip()]  # the pipe reads "\r" as "\n"
    assert lines[-1] == "fastdit: interrupted"
    assert "Traceback" not in seen + rest and not list(tmp_path.iterdir())


def _subprocess(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FASTDIT_TEST_THREADS": "1", "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, "-m", "fastdit", "generate", *argv], capture_output=True, text=True, env=env, timeout=240
    )


def test_python_m_fastdit_generate(tiny_flux_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "cat.png"
    done = _subprocess("--model-path", str(tiny_flux_dir), "--prompt", "a cat", *TINY, "--out", str(out), "--json")
    assert done.returncode == 0, done.stderr
    assert _last_json(done.stdout)["out"] == str(out) and out.is_file()


# A second interpreter start for an exit path the default run already takes through ``python -m``
# (test_errors_after_the_pipeline_import_are_one_line) and in process (test_bad_input_exits_2_before_loading).
@pytest.mark.slow
def test_python_m_fastdit_generate_bad_flag_exits_2(tiny_flux_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "cat.png"
    done = _subprocess("--model-path", str(tiny_flux_dir), "--prompt", "a cat", "--steps", "-3", "--out", str(out))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == "fastdit: error: argument --steps -3: must be positive"
    assert not out.exists()


def _torchrun_generate(argv: list[str], out: Path) -> dict[str, Any]:
    """``torchrun --nproc-per-node 2 -m fastdit generate ... --compare --json``; the one JSON line rank 0 prints."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "fastdit", "generate"]
    done = subprocess.run(
        [*command, *argv, "--compare", "--out", str(out), "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    json_lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(json_lines) == 1  # only rank 0 reports
    return json.loads(json_lines[0])


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ulysses=2", "tp=2"])
def test_torchrun_parallel_writes_once(tiny_flux_dir: Path, tmp_path: Path, parallel: str) -> None:
    out = tmp_path / "cp.png"
    argv = ["--model-path", str(tiny_flux_dir), "--prompt", "a cat", *TINY, "--parallel", parallel]
    payload = _torchrun_generate(argv, out)
    key, degree = parallel.split("=")
    assert payload["world_size"] == 2 and payload["acceleration"]["parallel"][key] == int(degree)
    # Exact up to the order of float sums: measured 142 dB; a split or gather bug costs tens of dB.
    assert payload["psnr_min"] == "inf" or payload["psnr_min"] > 100
    assert [p.name for p in tmp_path.iterdir()] == ["cp.png"]


def _reference_available() -> bool:
    try:
        from fastdit.reference import reference_dir

        reference_dir()
    except (ImportError, FileNotFoundError):
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(not _reference_available(), reason="the reference pipeline's weights are not installed")
@pytest.mark.parametrize("parallel", ["ulysses=2", "ring=2", "tp=2"])
def test_torchrun_reference_pipeline_matches_one_process(parallel: str, tmp_path: Path) -> None:
    """28 steps of the trained reference pipeline on 2 processes equal the same process's unsplit run."""
    payload = _torchrun_generate(["--prompt", "a handwritten digit 5", "--parallel", parallel], tmp_path / "five.png")
    assert payload["world_size"] == 2 and payload["steps"] == 28
    assert payload["psnr_min"] == "inf" or payload["psnr_min"] > 60
    assert payload["ssim_min"] > 0.999


@pytest.mark.skipif(not _reference_available(), reason="the reference pipeline's weights are not installed")
def test_reference_pipeline_compares_by_default(tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "digit3.png"
    code, stdout, _ = _run(
        capsys, "--prompt", "a handwritten digit 3", "--cache", "--quiet", "--out", str(out), "--json"
    )
    assert code == 0
    payload = _last_json(stdout)
    assert payload["model"] == "reference" and payload["steps"] == 28
    assert payload["blocks_computed_fraction"] < 0.6
    assert payload["psnr_min"] > 30 and payload["ssim_min"] > 0.9
    assert load_image(out).shape == (32, 32, 3)


def test_quantize_int8_weight_with_summary_and_compare(tiny_flux_dir: Path, capsys: Any) -> None:
    pytest.importorskip("torchao")
    code, stdout, err = _run(
        capsys,
        "--model-path",
        str(tiny_flux_dir),
        "--prompt",
        "a cat",
        *TINY,
        "--quantize",
        "int8_weight,exclude=*.norm1.linear",
        "--summary",
        "--compare",
        "--json",
    )
    assert code == 0, err
    payload = _last_json(stdout)
    assert payload["acceleration"]["quantize"]["mode"] == "int8_weight"
    report = payload["quantized"]["transformer"]
    assert report["num_quantized"] > 0 and report["bytes_after"] < report["bytes_before"] / 1.8
    assert payload["psnr"] >= 35, payload["psnr"]
    assert "linear layers quantized (int8_weight)" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine may run FP8")
def test_quantize_fp8_on_cpu_names_the_flag(tiny_flux_dir: Path, capsys: Any) -> None:
    pytest.importorskip("torchao")
    code, _, err = _run(capsys, "--model-path", str(tiny_flux_dir), "--prompt", "a cat", *TINY, "--quantize", "fp8")
    assert code == 2
    (line,) = _error_lines(err)
    assert line.startswith("fastdit: error: argument --quantize fp8: ") and "compute capability 8.9" in line


@pytest.fixture(scope="module")
def tiny_stable_audio_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(save_tiny("stable_audio", str(tmp_path_factory.mktemp("tiny-stable-audio"))))


def test_audio_pipeline_saves_wav_and_compares_waveforms(
    capsys: pytest.CaptureFixture[str], tiny_stable_audio_dir: Path, tmp_path: Path
) -> None:
    import wave

    out = tmp_path / "hammer.wav"
    argv = ("--model-path", str(tiny_stable_audio_dir), "--prompt", "a cat", "--steps", "2", "--cache", "--compare")
    code, stdout, err = _run(capsys, *argv, "--out", str(out), "--json")
    assert code == 0, err
    payload = _last_json(stdout)
    assert payload["files"] == [str(out)] and payload["snr"] == "inf" and payload["ssim"] == 1.0
    with wave.open(str(out)) as read:  # stereo at the tiny VAE's 16 Hz, 8 s
        assert (read.getnchannels(), read.getframerate(), read.getnframes()) == (2, 16, 128)
    code, _, err = _run(capsys, *argv, "--out", str(tmp_path / "hammer.png"))
    assert code == 2 and _error_lines(err) == [
        f"fastdit: error: argument --out {tmp_path / 'hammer.png'}: audio needs one of the suffixes .wav"
    ]


@pytest.mark.skipif(importlib.util.find_spec("cudnn") is not None, reason="nvidia-cudnn-frontend is installed")
def test_fp8_attention_without_its_package_names_the_package(tiny_flux_dir: Path, capsys: Any) -> None:
    args = ("--model-path", str(tiny_flux_dir), "--prompt", "a cat", *TINY, "--attention", "cudnn-fp8")
    code, _, err = _run(capsys, *args)
    assert code == 2
    (line,) = _error_lines(err)
    assert line.startswith("fastdit: error: cannot accelerate ") and "pip install nvidia-cudnn-frontend" in line


def test_an_attention_backend_on_one_device(tiny_flux_dir: Path, capsys: Any) -> None:
    args = ("--model-path", str(tiny_flux_dir), "--prompt", "a cat", *TINY, "--attention", "math", "--json")
    code, stdout, _ = _run(capsys, *args)
    assert code == 0
    assert _last_json(stdout)["acceleration"]["attention"]["backend"] == "math"


def test_fuse_with_summary_and_compare(tiny_flux_dir: Path, capsys: Any) -> None:
    flags = ("--fuse", "--summary", "--compare", "--json")
    code, stdout, err = _run(capsys, "--model-path", str(tiny_flux_dir), "--prompt", "a cat", *TINY, *flags)
    assert code == 0, err
    payload = _last_json(stdout)
    assert payload["acceleration"]["fuse"] == {"type": "Fuse", "exclude": []}
    report = payload["fused"]["transformer"]
    assert report["num_groups"] > 0 and report["misses"] == 0 and report["hits"] > 0
    assert "groups" not in report
    # float32 on the CPU: the fused matmul's rounding only (identical here: "inf")
    assert payload["psnr"] == "inf" or payload["psnr"] >= 60, payload["psnr"]
    assert "projections fused into" in err


def test_fuse_names_the_flag_of_a_bad_field(tiny_flux_dir: Path, capsys: Any) -> None:
    code, _, err = _run(capsys, "--model-path", str(tiny_flux_dir), "--prompt", "a cat", *TINY, "--fuse", "groups=2")
    assert code == 2
    (line,) = _error_lines(err)
    assert line.startswith("fastdit: error: argument --fuse: 'groups=2'") and "exclude" in line
