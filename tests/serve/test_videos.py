"""Video jobs: ``/v1/videos`` with a tiny Wan pipeline through the ``openai`` client, and the job store's bounds."""

from __future__ import annotations

import io
import re
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from fastdit.serve.jobs import RequestError
from fastdit.serve.videos import VideoStore
from tests.serve.conftest import API_KEY, LiveServer, serving, tiny_runner

openai = pytest.importorskip("openai")
pytest.importorskip("imageio_ffmpeg")

PROMPT = "a cat walking"
WAN_DEFAULTS = {
    "height": 32,
    "width": 32,
    "num_frames": 5,
    "num_inference_steps": 2,
    "guidance_scale": 5.0,
    "max_sequence_length": 16,
}


@pytest.fixture(scope="module")
def wan() -> Iterator[LiveServer]:
    """A tiny WanPipeline (text-to-video) served as model ``wan``."""
    with serving(tiny_runner("wan", "t2v", "wan", WAN_DEFAULTS)) as server:
        yield server


def _client(server: LiveServer) -> Any:
    return openai.OpenAI(base_url=server.api, api_key=API_KEY, max_retries=0, timeout=60)


def _quiet(call: Any, *args: Any, **kwargs: Any) -> Any:
    with warnings.catch_warnings():  # the client marks its video methods deprecated (OpenAI's own service)
        warnings.simplefilter("ignore", DeprecationWarning)
        return call(*args, **kwargs)


def _headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def test_the_openai_client_creates_polls_and_downloads_a_video(wan: LiveServer, tmp_path: Path) -> None:
    from fastdit.io import load_video
    from fastdit.session import Case, call_arguments

    client = _client(wan)
    created = _quiet(client.videos.create, prompt=PROMPT, size="32x32", extra_body={"seed": 4, "num_frames": 5})
    assert re.fullmatch(r"video_[0-9a-f]{32}", created.id) and created.status in ("queued", "in_progress")
    assert (created.size, created.seconds, created.model) == ("32x32", "0.25", "wan")  # 4 intervals at 16 fps
    done = _quiet(client.videos.poll, created.id, poll_interval_ms=50)
    assert done.status == "completed" and done.progress == 100 and done.completed_at >= done.created_at
    assert done.model_extra["fastdit"]["seeds"] == [4] and done.model_extra["fastdit"]["num_frames"] == 5
    content = _quiet(client.videos.download_content, created.id)
    path = tmp_path / "video.mp4"
    data = content.read()
    assert data[4:8] == b"ftyp", data[:64]  # an mp4 container
    path.write_bytes(data)
    frames = load_video(path)
    assert frames.shape == (5, 32, 32, 3)
    # The thumbnail is the first frame, lossless: exactly what the pipeline made.
    thumb = httpx.get(f"{wan.api}/videos/{created.id}/content", params={"variant": "thumbnail"}, headers=_headers())
    session = wan.runner.session
    expected = session.call(Case(PROMPT, 4), call_arguments(session.pipeline_class, WAN_DEFAULTS, {}))
    first = np.asarray(Image.open(io.BytesIO(thumb.content)).convert("RGB"))
    assert np.array_equal(first, np.round(expected[0] * 255).astype(np.uint8))


def test_list_and_delete(wan: LiveServer) -> None:
    client = _client(wan)
    ids = [_quiet(client.videos.create, prompt=PROMPT, extra_body={"seed": s}).id for s in (1, 2)]
    assert ids[0] != ids[1]
    listed = [video.id for video in _quiet(client.videos.list, limit=100)]
    assert listed.index(ids[1]) < listed.index(ids[0])  # newest first
    page = _quiet(client.videos.list, limit=1, order="asc")
    assert len(page.data) == 1 and page.has_more
    for video_id in ids:
        _quiet(client.videos.poll, video_id, poll_interval_ms=50)
        assert _quiet(client.videos.delete, video_id).deleted
    with pytest.raises(openai.NotFoundError):
        _quiet(client.videos.retrieve, ids[0])
    missing = httpx.get(f"{wan.api}/videos/{ids[0]}/content", headers=_headers())
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "video_id"
    metrics = httpx.get(f"{wan.url}/metrics").text  # counted by route template: ids never become label values
    assert 'fastdit_requests_total{endpoint="/v1/videos/{video_id}",status="200"}' in metrics
    assert ids[0] not in metrics


@pytest.mark.parametrize(
    ("data", "files", "param", "words"),
    [
        ({"num_frames": "6"}, None, "num_frames", "one more than a multiple of 4"),
        ({"num_frames": "999"}, None, "num_frames", "at most 257"),
        ({"size": "40x32"}, None, "size", "multiples of 16"),
        ({"seconds": "nan"}, None, "seconds", "finite"),
        ({}, {"input_reference": ("a.png", b"\x89PNG", "image/png")}, "input_reference", "not an image file"),
        ({"model": "sora-2"}, None, "model", "not served here"),
    ],
)
def test_bad_video_requests_name_the_field(wan: LiveServer, data: dict, files: Any, param: str, words: str) -> None:
    response = httpx.post(
        f"{wan.api}/videos", data={"prompt": PROMPT, **data}, files=files or {"x": ("", b"")}, headers=_headers()
    )
    assert 400 <= response.status_code < 500, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_a_text_to_video_model_takes_no_reference_image(wan: LiveServer) -> None:
    buffer = io.BytesIO()
    Image.new("RGB", (32, 32)).save(buffer, format="PNG")
    response = httpx.post(f"{wan.api}/videos", json={"prompt": PROMPT}, headers=_headers())
    assert response.status_code == 200  # JSON bodies work too
    with_image = httpx.post(
        f"{wan.api}/videos",
        data={"prompt": PROMPT},
        files={"input_reference": ("a.png", buffer.getvalue(), "image/png")},
        headers=_headers(),
    )
    assert with_image.status_code == 422 and "text-to-video" in with_image.json()["error"]["message"]
    _quiet(_client(wan).videos.poll, response.json()["id"], poll_interval_ms=50)


def test_an_image_model_refuses_video_jobs(live_server: LiveServer) -> None:
    response = httpx.post(f"{live_server.api}/videos", json={"prompt": PROMPT}, headers=_headers())
    assert response.status_code == 400 and response.json()["error"]["code"] == "unsupported_model"
    assert "'reference' (FluxPipeline) makes images" in response.json()["error"]["message"]


def _video_app(engine: Any, **limits: Any) -> Any:
    from diffusers import WanPipeline
    from fastapi.testclient import TestClient

    from fastdit.serve.app import create_app
    from fastdit.serve.jobs import ModelSpec
    from fastdit.serve.limits import Limits

    spec = ModelSpec("wan", WanPipeline, dict(WAN_DEFAULTS), unit=16, video=True, frame_unit=4)
    return TestClient(create_app(engine, spec, limits=Limits(**limits)), raise_server_exceptions=False)


def _poll(client: Any, video_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while (body := client.get(f"/v1/videos/{video_id}").json())["status"] in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return body


@pytest.mark.parametrize(
    ("error", "code", "message"),
    [
        (RuntimeError("boom in /secret/weights/model.safetensors"), "server_error", "internal server error"),
        (None, "timeout", "longer than 0.3 s"),
    ],
)
def test_a_failed_job_says_why_without_traceback_or_path(error: Any, code: str, message: str) -> None:
    from tests.serve.test_limits import FakeEngine

    engine = FakeEngine(hold=error is None, error=error)
    with _video_app(engine, timeout_s=0.3) as client:
        created = client.post("/v1/videos", json={"prompt": PROMPT})
        assert created.status_code == 200
        body = _poll(client, created.json()["id"])
        engine.release.set()
        content = client.get(f"/v1/videos/{body['id']}/content")
    assert body["status"] == "failed" and body["error"]["code"] == code and message in body["error"]["message"]
    assert "/secret" not in str(body) and "Traceback" not in str(body)
    assert content.status_code == 409 and content.json()["error"]["code"] == "video_not_ready"


def test_the_store_evicts_finished_jobs_after_their_ttl_and_beyond_its_count(tmp_path: Path) -> None:
    frames = np.zeros((3, 16, 16, 3), np.float32)
    store = VideoStore(tmp_path, ttl_s=0.2, max_videos=2)
    first = store.create("m", "p", "16x16", "1")
    store.complete(first, frames, 8.0, {})
    assert first.path is not None and first.path.is_file() and not list(tmp_path.glob(".fastdit-*"))
    second = store.create("m", "p", "16x16", "1")
    third = store.create("m", "p", "16x16", "1")  # room made by dropping the oldest finished job, file included
    assert not first.path.exists()
    with pytest.raises(RequestError) as caught:
        store.get(first.id)
    assert caught.value.status == 404
    with pytest.raises(RequestError) as caught:
        store.create("m", "p", "16x16", "1")  # both kept jobs are unfinished: refused, nothing dropped
    assert caught.value.status == 429 and len(store) == 2
    with pytest.raises(RequestError) as caught:
        store.delete(second.id)
    assert caught.value.status == 409
    store.fail(second, RequestError(500, "x", code="c"))
    store.complete(third, frames, 8.0, {})
    time.sleep(0.3)
    with pytest.raises(RequestError):
        store.get(third.id)
    assert len(store) == 0 and not list(tmp_path.iterdir())


def test_a_video_model_without_imageio_ffmpeg_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    real = importlib.import_module

    def without(name: str, *args: Any) -> Any:
        if name == "imageio_ffmpeg":
            raise ModuleNotFoundError("No module named 'imageio_ffmpeg'")
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", without)
    from tests.serve.test_limits import FakeEngine

    with pytest.raises(ImportError, match=r"needs the package 'imageio-ffmpeg': pip install imageio-ffmpeg"):
        _video_app(FakeEngine())


@pytest.mark.slow
def test_an_image_to_video_model_takes_the_reference_image() -> None:
    """``input_reference`` goes to the pipeline's ``image``: required, and the video starts from it."""
    with serving(tiny_runner("wan", "i2v", "wan-i2v", WAN_DEFAULTS)) as server:
        missing = httpx.post(f"{server.api}/videos", json={"prompt": PROMPT}, headers=_headers())
        assert missing.status_code == 422 and missing.json()["error"]["param"] == "input_reference"
        thumbnails = []
        for shade in (0, 255):
            buffer = io.BytesIO()
            Image.new("RGB", (32, 32), (shade, shade, shade)).save(buffer, format="PNG")
            created = httpx.post(
                f"{server.api}/videos",
                data={"prompt": PROMPT, "seed": "1"},
                files={"input_reference": ("a.png", buffer.getvalue(), "image/png")},
                headers=_headers(),
            )
            assert created.status_code == 200, created.text
            done = _quiet(_client(server).videos.poll, created.json()["id"], poll_interval_ms=50)
            assert done.status == "completed", done
            thumb = httpx.get(
                f"{server.api}/videos/{done.id}/content", params={"variant": "thumbnail"}, headers=_headers()
            )
            thumbnails.append(np.asarray(Image.open(io.BytesIO(thumb.content))).astype(int))
        assert not np.array_equal(thumbnails[0], thumbnails[1])  # another first image, another video
        from fastdit.session import Case, call_arguments

        session = server.runner.session  # idle: the same call, made directly with the black image
        black = Image.new("RGB", (32, 32))
        kwargs = call_arguments(session.pipeline_class, WAN_DEFAULTS, {"image": black})
        expected = session.call(Case(PROMPT, 1), kwargs)
        assert np.array_equal(thumbnails[0], np.round(expected[0] * 255).astype(int))
