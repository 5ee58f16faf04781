"""``fastdit serve``: flags checked before loading, the exposure warning, and a 2-rank torchrun server."""

from __future__ import annotations

import base64
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from fastdit.cli import main
from fastdit.testing.signals import default_sigint
from tests.serve.conftest import API_KEY, LiveServer, free_port


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-n", "0"], "argument --max-n 0: max_n=0: must be positive"),
        (["--timeout-s", "nan"], "argument --timeout-s nan"),
        (["--queue-size", "-1"], "argument --queue-size -1"),
        (["--parallel", "ulysses=2"], "needs 2 processes"),
        (["--steps", "0"], "argument --steps 0: must be positive"),
        (["--cache", "bogus"], "argument --cache bogus"),
        (["--video-ttl-s", "0"], "argument --video-ttl-s 0.0: must be positive"),
        (["--max-videos", "-2"], "argument --max-videos -2: must be positive"),
        (["--max-frames", "0"], "argument --max-frames 0: max_frames=0: must be positive"),
        (["--lora-dir", "/no/such/loras"], "argument --lora-dir /no/such/loras: no such directory"),
        (["--video-dir", "/no/such/videos"], "argument --video-dir /no/such/videos: no such directory"),
    ],
)
def test_bad_flags_end_before_loading(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", *argv]) == 2
    assert message in capsys.readouterr().err


def test_binding_beyond_loopback_without_a_key_warns(capsys: pytest.CaptureFixture) -> None:
    from fastdit.cli.serve import _warn_exposed

    _warn_exposed("127.0.0.1", None)
    _warn_exposed("0.0.0.0", "key")
    assert capsys.readouterr().err == ""
    _warn_exposed("0.0.0.0", None)
    assert "without an API key" in capsys.readouterr().err


def test_serve_is_registered() -> None:
    from fastdit.cli import COMMANDS, build_parser

    assert "serve" in COMMANDS
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.api_key, args.max_n) == ("127.0.0.1", 8000, None, 4)


def _rank(launcher: int, rank: int) -> int:
    """The pid of ``rank`` among the processes torchrun (``launcher``) started."""
    for entry in Path("/proc").iterdir():
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if parent == launcher and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    raise LookupError(rank)


def _start_torchrun(port: int, timeout_s: float = 60, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FASTDIT_API_KEY": API_KEY}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "fastdit", "serve"]
    command += ["--cache", "--parallel", "ulysses=2", "--port", str(port), "--dist-timeout", f"{timeout_s:g}", *extra]
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait_healthy(url: str, launcher: subprocess.Popen) -> None:
    deadline = time.monotonic() + 240
    while True:
        assert launcher.poll() is None, launcher.stderr.read() if launcher.stderr else ""
        assert time.monotonic() < deadline, "the torchrun server did not start"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


def _images(url: str, caches: tuple[str, ...] = ("none", "balanced")) -> tuple[list[np.ndarray], list[dict]]:
    images, reports = [], []
    for cache in caches:
        body = {"prompt": "a handwritten digit 5", "seed": 2, "num_inference_steps": 12, "cache": cache}
        response = httpx.post(
            f"{url}/v1/images/generations", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120
        )
        assert response.status_code == 200, response.text
        payload = response.json()
        images.append(np.asarray(Image.open(io.BytesIO(base64.b64decode(payload["data"][0]["b64_json"])))))
        reports.append(payload["fastdit"]["cache"])
    return images, reports


def test_a_torchrun_server_answers_like_one_process_and_ends_when_a_rank_dies(
    live_server: LiveServer, tmp_path: Path
) -> None:
    port = free_port()
    lora = _lora_dir(live_server, tmp_path)
    extra = ("--warmup-sizes", "32x32", *(("--lora-dir", str(lora)) if lora is not None else ()))
    launcher = _start_torchrun(port, extra=extra)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, launcher)
        split, split_reports = _images(url)
        whole, whole_reports = _images(live_server.url)
        for a, b in zip(split, whole, strict=True):
            # Exact up to the order of float sums across the split, then uint8 rounding: at most one level.
            assert np.abs(a.astype(int) - b.astype(int)).max() <= 1
        assert split_reports == whole_reports and split_reports[1]["cached_steps"] > 0
        if lora is not None:  # without peft the server runs without adapters
            _check_lora_in_lockstep(url, lora, split[0])
        os.kill(_rank(launcher.pid, 1), signal.SIGKILL)
        assert launcher.wait(timeout=90) != 0  # the whole job ends; nothing waits forever
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def _lora_dir(server: LiveServer, tmp_path: Path) -> Path | None:
    """A directory with a LoRA of the reference transformer (``one/``) and a file that is none (``bad.safetensors``);
    ``None`` without peft."""
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        return None
    from tests.serve.test_lora import _make_lora

    _make_lora(server.runner.session.pipe.transformer, tmp_path / "one", seed=1)
    (tmp_path / "bad.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    return tmp_path


def _check_lora_in_lockstep(url: str, lora: Path, baseline: np.ndarray) -> None:
    """Every rank loads the adapter (the image is one process's with it), refuses a bad file alike, and deletes it."""
    import torch

    from fastdit.session import Case, Session, call_arguments, resolve_model

    headers = {"Authorization": f"Bearer {API_KEY}"}
    bad = httpx.post(f"{url}/v1/loras", json={"name": "bad", "path": "bad.safetensors"}, headers=headers, timeout=120)
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "path"
    loaded = httpx.post(f"{url}/v1/loras", json={"name": "one", "path": "one"}, headers=headers, timeout=120)
    assert loaded.status_code == 201, loaded.text
    adapted, _ = _images(url, caches=("none",))
    source = resolve_model(None, None)
    session = Session.load(source, device="cpu", dtype=torch.float32)
    session.pipe.load_lora_weights(str(lora / "one"), adapter_name="one")
    kwargs = call_arguments(session.pipeline_class, source.defaults, {"num_inference_steps": 12})
    expected = np.round(session.call(Case("a handwritten digit 5", 2), kwargs) * 255).astype(int)
    assert np.abs(adapted[0].astype(int) - expected).max() <= 1
    assert httpx.delete(f"{url}/v1/loras/one", headers=headers, timeout=120).status_code == 200
    again, _ = _images(url, caches=("none",))
    assert np.array_equal(again[0], baseline)


@pytest.mark.slow
def test_a_stalled_rank_ends_an_idle_torchrun_server_within_its_timeout() -> None:
    """The idle server's pings find a rank that stopped answering (torchrun does not notice a stopped process)."""
    port = free_port()
    launcher = _start_torchrun(port, timeout_s=20)
    stalled = None
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", launcher)
        stalled = _rank(launcher.pid, 1)
        os.kill(stalled, signal.SIGSTOP)
        start = time.monotonic()
        rank0 = _rank(launcher.pid, 0)
        while _alive(rank0):
            assert time.monotonic() - start < 60, "the server did not notice the stalled rank"
            time.sleep(0.5)
        assert time.monotonic() - start < 20 * 4 / 3 + 10  # at most one ping interval plus the timeout, and slack
    finally:
        if stalled is not None:
            os.kill(stalled, signal.SIGCONT)  # let it take torchrun's SIGTERM
        if launcher.poll() is None:
            try:
                launcher.wait(timeout=60)
            except subprocess.TimeoutExpired:
                launcher.kill()
                launcher.wait()
    assert launcher.returncode != 0
    stderr = launcher.stderr.read() if launcher.stderr else ""
    assert "fastdit: error: rank 0 of 2: a collective timed out after 20 s: rank 1 stopped answering" in stderr


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
def test_fastdit_serve_in_one_process_serves_until_interrupted() -> None:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FASTDIT_API_KEY": API_KEY}
    command = [sys.executable, "-m", "fastdit", "serve", "--cache", "fast", "--port", str(port), "--steps", "6"]
    server = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint
    )
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, server)
        assert httpx.get(f"{url}/v1/models").status_code == 401  # the key came from the environment
        response = httpx.post(
            f"{url}/v1/images/generations",
            json={"prompt": "a handwritten digit 0", "seed": 4},
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=120,
        )
        report = response.json()["fastdit"]
        assert report["num_inference_steps"] == 6 and report["cache"]["preset"] == "fast"
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=60) == 130
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    stderr = server.stderr.read() if server.stderr else ""
    assert stderr.strip().splitlines()[-1] == "fastdit: interrupted" and "Traceback" not in stderr


@pytest.mark.slow
def test_fastdit_serve_runs_video_jobs_of_a_video_model_after_its_warm_up(tmp_path: Path) -> None:
    """A video model served from a directory: warm-up at a size first, then a job whose mp4 lands in --video-dir."""
    import warnings

    openai = pytest.importorskip("openai")
    pytest.importorskip("imageio_ffmpeg")
    from fastdit.testing.pipelines import save_tiny

    model = save_tiny("wan", str(tmp_path / "wan"), "t2v")
    videos = tmp_path / "videos"
    videos.mkdir()
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FASTDIT_API_KEY": API_KEY}
    command = [sys.executable, "-m", "fastdit", "serve", "--model-path", model, "--steps", "2", "--port", str(port)]
    command += ["--warmup-sizes", "32x32", "--video-dir", str(videos), "--model-name", "tiny-wan"]
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, server)
        assert httpx.get(f"{url}/health").json()["warmup"] == {"done": 1, "total": 1}
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            video = client.videos.create(model="tiny-wan", prompt="a cat", size="32x32", extra_body={"num_frames": 5})
            video = client.videos.poll(video.id, poll_interval_ms=100)
        assert video.status == "completed", video
        assert [path.name for path in videos.iterdir()] == [f"{video.id}.mp4"]
        images = httpx.post(
            f"{url}/v1/images/generations", json={"prompt": "a cat"}, headers={"Authorization": f"Bearer {API_KEY}"}
        )
        assert images.status_code == 400 and images.json()["error"]["code"] == "unsupported_model"
    finally:
        server.terminate()
        server.wait(timeout=60)
