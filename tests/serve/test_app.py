"""The endpoints through the official ``openai`` client and plain HTTP, against a live uvicorn server."""

from __future__ import annotations

import base64
import io
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.serve.conftest import API_KEY, LiveServer

openai = pytest.importorskip("openai")

PROMPT = "a handwritten digit 3"


def _client(server: LiveServer) -> Any:
    return openai.OpenAI(base_url=server.api, api_key=API_KEY, max_retries=0, timeout=60)


def _image(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def _generate(server: LiveServer, **extra: Any) -> Any:
    n = extra.pop("n", 1)
    return _client(server).images.generate(
        model="reference", prompt=PROMPT, n=n, size="32x32", response_format="b64_json", extra_body=extra
    )


def test_openai_client_generates_images_with_their_own_seeds(live_server: LiveServer) -> None:
    both = _generate(live_server, n=2, seed=7, num_inference_steps=4, cache="none")
    assert len(both.data) == 2
    first, second = (_image(item.b64_json) for item in both.data)
    assert first.shape == (32, 32, 3) and not np.array_equal(first, second)
    again = _generate(live_server, seed=8, num_inference_steps=4, cache="none")
    assert np.array_equal(_image(again.data[0].b64_json), second)  # image i of a request has seed + i
    report = both.model_extra["fastdit"]
    assert report["seeds"] == [7, 8] and report["num_inference_steps"] == 4
    assert report["width"] == report["height"] == 32
    assert report["cache"]["preset"] == "none" and report["cache"]["cached_steps"] == 0
    assert set(report["timings"]) == {"queue_s", "run_s", "encode_s", "total_s"}


def test_the_image_equals_a_direct_session_call(live_server: LiveServer) -> None:
    """What the server sends is the PNG of what :meth:`Session.call` returns for the same prompt and seed."""
    from fastdit.session import Case, call_arguments

    served = _image(_generate(live_server, seed=3, num_inference_steps=4, cache="none").data[0].b64_json)
    runner = live_server.runner  # idle between requests: call its pipeline as a request with cache="none" does
    kwargs = call_arguments(runner.session.pipeline_class, runner.session.source.defaults, {"num_inference_steps": 4})
    runner._install("none")
    expected = runner.session.call(Case(PROMPT, 3), kwargs)
    assert np.array_equal(served, np.round(expected * 255).astype(np.uint8))


def test_each_request_runs_its_own_schedule(live_server: LiveServer) -> None:
    """Different step counts in turn: each request reports the cache counts it gets when run on its own."""
    alone = {steps: _alone(live_server, steps) for steps in (10, 16)}
    runs = [_generate(live_server, seed=1, num_inference_steps=steps) for steps in (10, 16, 10, 16)]
    reports = [r.model_extra["fastdit"]["cache"] for r in runs]
    assert [r["steps"] for r in reports] == [10, 16, 10, 16]
    for steps, report in zip((10, 16, 10, 16), reports, strict=True):
        assert (report["cached_steps"], report["blocks_computed_fraction"]) == alone[steps]
    assert all(r["preset"] == "balanced" and 0 < r["cached_steps"] < r["steps"] for r in reports)
    assert all(r["cached_steps"] + r["computed_steps"] == r["steps"] for r in reports)
    images = [_image(r.data[0].b64_json) for r in runs]
    assert np.array_equal(images[0], images[2]) and np.array_equal(images[1], images[3])


def _alone(server: LiveServer, steps: int) -> tuple[int, float]:
    """Cached steps and blocks computed of one run with a freshly installed cache (the server is idle)."""
    from fastdit.serve.worker import DEFAULT_CACHE, cache_counts
    from fastdit.session import Case, call_arguments

    runner = server.runner
    runner._install("none")
    runner._install(DEFAULT_CACHE)  # new hooks: no state from any earlier run
    kwargs = call_arguments(
        runner.session.pipeline_class, runner.session.source.defaults, {"num_inference_steps": steps}
    )
    runner.session.call(Case(PROMPT, 1), kwargs)
    counts = cache_counts(runner.session.summary())
    return counts["cached_steps"], counts["blocks_computed"] / counts["blocks_total"]


def test_models_health_and_metrics(live_server: LiveServer) -> None:
    models = _client(live_server).models.list()
    assert [m.id for m in models.data] == ["reference"]
    assert httpx.get(f"{live_server.url}/health").json()["status"] == "ok"
    _generate(live_server, seed=0, num_inference_steps=6)
    text = httpx.get(f"{live_server.url}/metrics").text
    assert 'fastdit_requests_total{endpoint="/v1/images/generations",status="200"}' in text
    assert 'fastdit_request_seconds_bucket{endpoint="/v1/images/generations",le="0.5"}' in text
    assert "fastdit_queue_depth 0.0" in text
    ratio = float(next(line for line in text.splitlines() if line.startswith("fastdit_cache_hit_ratio ")).split()[1])
    assert 0 < ratio < 1
    assert 'fastdit_cache_steps_total{outcome="cached"}' in text


def test_a_key_is_required(live_server: LiveServer) -> None:
    body = {"prompt": PROMPT, "num_inference_steps": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.post(f"{live_server.api}/images/generations", json=body, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=live_server.api, api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{live_server.url}/health").status_code == 200  # probes need no key


def test_bad_input_names_the_field_through_the_client(live_server: LiveServer) -> None:
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        _client(live_server).images.generate(prompt=PROMPT, size="30x32", extra_body={"num_inference_steps": 2})
    assert caught.value.body["param"] == "size" and "multiples of 4" in caught.value.body["message"]


def test_compatible_requests_without_a_cache_are_batched(live_server: LiveServer, reference_runner: Any) -> None:
    """Queued requests of one size and step count share a call, each image keeping its seed: as made one by one."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.serve.conftest import serving

    with serving(reference_runner, max_batch=4) as server:
        # One request of four images is one call of four.
        four = _generate(server, n=4, seed=20, num_inference_steps=6, cache="none")
        assert four.model_extra["fastdit"]["batched_with"] == 4
        # Three requests queued behind a long one join one call.
        with ThreadPoolExecutor(4) as pool:
            blocker = pool.submit(_generate, server, seed=0, num_inference_steps=40, cache="none")
            _wait_queue(server, 1)
            queued = [pool.submit(_generate, server, seed=s, num_inference_steps=6, cache="none") for s in (21, 22, 23)]
            _wait_queue(server, 4)
            blocker.result()
            batched = [f.result() for f in queued]
        assert [r.model_extra["fastdit"]["batched_with"] for r in batched] == [3, 3, 3]
        cached = _generate(server, n=2, seed=1, num_inference_steps=6)  # the server's cache: one image per call
        assert cached.model_extra["fastdit"]["batched_with"] == 1
    alone = [_generate(live_server, seed=s, num_inference_steps=6, cache="none") for s in range(20, 24)]
    made_alone = [_image(r.data[0].b64_json).astype(int) for r in alone]
    made_batched = [_image(item.b64_json).astype(int) for item in four.data]
    made_batched_too = [_image(r.data[0].b64_json).astype(int) for r in batched]
    for a, b in zip(made_alone, made_batched, strict=True):
        assert np.abs(a - b).max() <= 1  # the same up to the order of float sums, then uint8 rounding
    for a, b in zip(made_alone[1:], made_batched_too, strict=True):
        assert np.abs(a - b).max() <= 1


def _wait_queue(server: LiveServer, depth: int) -> None:
    """Wait until ``depth`` requests are queued or running."""
    import time

    deadline = time.monotonic() + 30
    while httpx.get(f"{server.url}/health").json()["queue"] != depth:
        assert time.monotonic() < deadline, f"the queue never held {depth}"
        time.sleep(0.01)
