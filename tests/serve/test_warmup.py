"""Warm-up per size: the jobs it runs, ``/health`` until it is done, and ``--warmup-sizes`` checked before loading."""

from __future__ import annotations

import time
from typing import Any

import pytest

from fastdit.cli import main
from fastdit.serve.jobs import ModelSpec, warmup_jobs
from fastdit.serve.limits import Limits
from tests.serve.test_limits import FakeEngine, _spec


def _sizes(jobs: list[Any]) -> list[tuple[int, int, int]]:
    return [(job.kwargs.get("width"), job.kwargs.get("height"), len(job.cases)) for job in jobs]


def test_one_job_per_size_and_per_batch_size() -> None:
    from dataclasses import replace

    from fastdit.cache.presets import cache_config

    spec = _spec()
    jobs = warmup_jobs(spec, Limits(max_batch=3), [(64, 32), (32, 64)], repeats=1)
    assert _sizes(jobs) == [(32, 32, 1), (64, 32, 1), (64, 32, 2), (64, 32, 3), (32, 64, 1), (32, 64, 2), (32, 64, 3)]
    assert all(job.batch == len(job.cases) for job in jobs)  # a batch of k images is one call of k
    cached = replace(spec, default_cache=cache_config("balanced"))  # a step cache is never batched
    assert _sizes(warmup_jobs(cached, Limits(max_batch=3), [(64, 32)], repeats=0)) == [(64, 32, 1)]


def _wait_for(condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_health_says_warming_up_until_every_warm_up_run_is_done() -> None:
    from fastapi.testclient import TestClient

    from fastdit.serve.app import create_app

    engine = FakeEngine(hold=True)
    warmup = warmup_jobs(_spec(), Limits(), [(64, 32), (32, 48)], repeats=0)
    with TestClient(create_app(engine, _spec(), warmup=warmup), raise_server_exceptions=False) as client:
        _wait_for(lambda: len(engine.jobs) == 1)
        health = client.get("/health")
        assert health.status_code == 503
        assert health.json() | {"queue": 0} == {
            "status": "warming_up",
            "model": "reference",
            "queue": 0,
            "warmup": {"done": 0, "total": 2},
        }
        refused = client.post("/v1/images/generations", json={"prompt": "a"})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "warming_up"
        assert int(refused.headers["Retry-After"]) >= 1
        engine.release.set()
        _wait_for(lambda: client.get("/health").status_code == 200)
        assert client.get("/health").json()["warmup"] == {"done": 2, "total": 2}
        assert client.post("/v1/images/generations", json={"prompt": "a", "size": "32x32"}).status_code == 200
    assert _sizes(engine.jobs[:2]) == [(64, 32, 1), (32, 48, 1)]


def test_a_failed_warm_up_ends_the_server() -> None:
    from fastapi.testclient import TestClient

    from fastdit.serve.app import create_app

    failures: list[BaseException] = []
    engine = FakeEngine(error=RuntimeError("out of memory"))
    warmup = warmup_jobs(_spec(), Limits(), [(64, 32)], repeats=0)
    app = create_app(engine, _spec(), warmup=warmup, on_fatal=failures.append)
    with TestClient(app, raise_server_exceptions=False) as client:
        _wait_for(lambda: failures)
        assert client.get("/health").json()["status"] == "failed"
    assert str(failures[0]) == "out of memory"


@pytest.fixture
def _no_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    from fastdit.session import Session

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)

    def refuse(*_args: Any, **_kwargs: Any) -> None:
        raise AssertionError("loaded the model before checking the flags")

    monkeypatch.setattr(Session, "load", refuse)


@pytest.mark.usefixtures("_no_loading")
@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("1024x", "argument --warmup-sizes 1024x: '1024x': must be WIDTHxHEIGHT"),
        ("32x32,,64x64", "argument --warmup-sizes 32x32,,64x64: '(empty)': must be WIDTHxHEIGHT"),
        ("32x32,0x64", "'0x64': width and height must be positive"),
        ("4096x32", "argument --warmup-sizes 4096x32: '4096x32' exceeds --max-side 2048"),
    ],
)
def test_bad_warmup_sizes_end_before_loading(value: str, message: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", "--warmup-sizes", value]) == 2
    assert message in capsys.readouterr().err


def test_a_size_off_the_models_unit_ends_after_loading_before_serving(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import fastdit.cli.serve as serve

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(serve, "_serve", lambda *_args: pytest.fail("served"))
    assert main(["serve", "--warmup-sizes", "32x32,30x32"]) == 2
    assert "argument --warmup-sizes 30x32: must be a multiple of 4" in capsys.readouterr().err


def test_video_models_warm_up_at_their_frame_count() -> None:
    from diffusers import WanPipeline

    spec = ModelSpec("wan", WanPipeline, {"num_frames": 81, "height": 480, "width": 832}, unit=16, video=True)
    jobs = warmup_jobs(spec, Limits(max_batch=4), [(320, 320)], repeats=1)
    assert [(job.kwargs["num_frames"], job.kwargs["width"], len(job.cases)) for job in jobs] == [
        (81, 832, 1),
        (81, 320, 1),
    ]
