"""Bad input, auth, a full queue, timeouts and errors, through plain HTTP against a stand-in engine (no model)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from fastdit.errors import FieldError
from fastdit.serve.jobs import ModelSpec
from fastdit.serve.limits import Limits
from fastdit.serve.worker import Job, JobResult, JobTimeoutError


class FakeEngine:
    """Returns black images at once, or holds each run until :attr:`release` is set, or raises :attr:`error`."""

    heartbeat_s = None

    def __init__(self, *, hold: bool = False, error: BaseException | None = None) -> None:
        self.release = threading.Event()
        if not hold:
            self.release.set()
        self.error = error
        self.stopped_early = threading.Event()
        self.jobs: list[Job] = []

    def run(self, job: Job, should_stop: Callable[[], bool] | None = None, progress: Any = None) -> JobResult:
        self.jobs.append(job)
        while not self.release.wait(0.01):
            if should_stop is not None and should_stop():
                self.stopped_early.set()
                raise JobTimeoutError
        if self.error is not None:
            raise self.error
        size = (job.kwargs.get("height", 32), job.kwargs.get("width", 32), 3)
        return JobResult([np.zeros(size, np.float32) for _ in job.cases], 0.01, {}, "none")

    def heartbeat(self) -> None:
        pass

    def lora(self, op: Any) -> list[dict[str, Any]]:
        raise AssertionError("no LoRA in these tests")

    def lora_refusal(self, fuse: bool = True) -> str | None:
        return "a stand-in engine"

    def stop(self) -> None:
        self.release.set()


def _spec() -> ModelSpec:
    from diffusers import FluxPipeline

    from fastdit.reference import REFERENCE_DEFAULTS

    return ModelSpec("reference", FluxPipeline, dict(REFERENCE_DEFAULTS), unit=4)


@pytest.fixture
def make_client() -> Iterator[Callable[..., Any]]:
    from fastapi.testclient import TestClient

    from fastdit.serve.app import create_app

    clients: list[Any] = []

    def make(engine: FakeEngine | None = None, api_key: str | None = None, **limits: Any) -> Any:
        app = create_app(engine or FakeEngine(), _spec(), limits=Limits(**limits), api_key=api_key)
        client = TestClient(app, raise_server_exceptions=False)
        client.__enter__()  # runs the lifespan: the queue's consumer
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


def _post(client: Any, **body: Any) -> Any:
    return client.post("/v1/images/generations", json={"prompt": "a handwritten digit 1", **body})


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"size": "33x32"}, "size"),
        ({"size": "thirty"}, "size"),
        ({"size": "4096x32"}, "size"),
        ({"n": 5}, "n"),
        ({"n": 0}, "n"),
        ({"num_inference_steps": 101}, "num_inference_steps"),
        ({"num_inference_steps": 0}, "num_inference_steps"),
        ({"prompt": "x" * 4001}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"negative_prompt": "y" * 4001}, "negative_prompt"),
        ({"guidance_scale": -1}, "guidance_scale"),
        ({"seed": -1}, "seed"),
        ({"cache": "bogus"}, "cache"),
        ({"response_format": "gif"}, "response_format"),
    ],
)
def test_bad_input_is_422_naming_the_field(make_client: Callable[..., Any], body: dict, param: str) -> None:
    response = _post(make_client(), **body)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"].startswith(param)


def test_a_missing_prompt_and_another_model(make_client: Callable[..., Any]) -> None:
    client = make_client()
    missing = client.post("/v1/images/generations", json={"n": 1})
    assert missing.status_code == 422 and missing.json()["error"]["param"] == "prompt"
    other = _post(client, model="dall-e-3")
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"


def test_a_body_that_is_not_json_names_no_field(make_client: Callable[..., Any]) -> None:
    response = make_client().post(
        "/v1/images/generations", content=b"{prompt: nope", headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 422
    assert response.json()["error"] == {
        "message": "the body is not valid JSON",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_json",
    }


def test_limits_are_configurable(make_client: Callable[..., Any]) -> None:
    client = make_client(max_n=8, max_side=64, max_steps=10, max_prompt_chars=10)
    assert _post(client, prompt="short", n=8, size="64x64", num_inference_steps=10).status_code == 200
    assert _post(client, prompt="short", size="68x64").json()["error"]["param"] == "size"
    assert _post(client, prompt="far too long a prompt").json()["error"]["param"] == "prompt"
    assert _post(client, prompt="short").json()["error"]["param"] == "num_inference_steps"  # the model's 28


def test_auth(make_client: Callable[..., Any]) -> None:
    client = make_client(api_key="k")
    assert _post(client).status_code == 401
    assert client.get("/v1/models").status_code == 401
    ok = client.post(
        "/v1/images/generations", json={"prompt": "a", "size": "32x32"}, headers={"Authorization": "Bearer k"}
    )
    assert ok.status_code == 200 and len(ok.json()["data"]) == 1


def test_a_full_queue_is_429_with_retry_after(make_client: Callable[..., Any]) -> None:
    engine = FakeEngine(hold=True)
    client = make_client(engine, queue_size=1)
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(_post, client)
        _wait_for(lambda: len(engine.jobs) == 1)
        waiting = pool.submit(_post, client)
        _wait_for(lambda: client.get("/health").json()["queue"] == 2)
        refused = _post(client)
        assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
        assert refused.json()["error"]["code"] == "queue_full"
        engine.release.set()
        assert running.result().status_code == waiting.result().status_code == 200
    text = client.get("/metrics").text
    assert 'fastdit_requests_total{endpoint="/v1/images/generations",status="429"} 1.0' in text


def test_a_slow_request_is_504_and_its_run_stops(make_client: Callable[..., Any]) -> None:
    engine = FakeEngine(hold=True)
    client = make_client(engine, timeout_s=0.3)
    response = _post(client)
    assert response.status_code == 504 and response.json()["error"]["code"] == "timeout"
    _wait_for(engine.stopped_early.is_set)  # the single process stops the pipeline at its next step
    engine.release.set()
    assert _post(client).status_code == 200  # and serves the next request


@pytest.mark.parametrize(
    ("error", "status", "param"),
    [
        (RuntimeError("boom in /secret/path/model.safetensors"), 500, None),
        (FieldError("call", "height", 36, "must be a multiple of 16"), 422, "size"),
    ],
)
def test_job_errors_never_leak(make_client: Callable[..., Any], error: BaseException, status: int, param: Any) -> None:
    response = _post(make_client(FakeEngine(error=error)))
    assert response.status_code == status
    body = response.json()["error"]
    assert body["param"] == param
    assert "/secret" not in response.text and "Traceback" not in response.text
    if status == 500:
        assert body["message"] == "internal server error"


def _wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.01)


def test_a_directory_is_served_under_its_own_name_not_its_path(tmp_path: Any) -> None:
    from types import SimpleNamespace

    from diffusers import FluxPipeline

    from fastdit.session import ModelSource

    source = ModelSource(str(tmp_path), "diffusers.FluxPipeline", path=tmp_path)
    session = SimpleNamespace(source=source, pipeline_class=FluxPipeline, pipe=SimpleNamespace())
    assert ModelSpec.of(session).name == tmp_path.name
    assert ModelSpec.of(session, name="flux-dev").name == "flux-dev"


def test_a_queued_request_whose_client_disconnects_is_dropped() -> None:
    import socket

    import httpx
    import uvicorn

    from fastdit.serve.app import create_app

    engine = FakeEngine(hold=True)
    app = create_app(engine, _spec(), limits=Limits(queue_size=4))
    with socket.socket() as probe:  # a free loopback port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base, body = f"http://127.0.0.1:{port}", {"prompt": "a", "size": "32x32"}
    try:
        _wait_for(lambda: server.started)
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(httpx.post, f"{base}/v1/images/generations", json=body, timeout=30)
            _wait_for(lambda: len(engine.jobs) == 1)
            with pytest.raises(httpx.ReadTimeout):  # gives up while queued; the client closes its connection
                httpx.post(f"{base}/v1/images/generations", json=body, timeout=0.5)
            dropped = "fastdit_dropped_requests_total 1.0"
            _wait_for(lambda: dropped in httpx.get(f"{base}/metrics").text)
            engine.release.set()
            assert running.result().status_code == 200
        _wait_for(lambda: httpx.get(f"{base}/health").json()["queue"] == 0)
        assert len(engine.jobs) == 1  # the abandoned request never ran
    finally:
        engine.release.set()
        server.should_exit = True
        thread.join(timeout=10)
