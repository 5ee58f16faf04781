"""``POST /v1/images/edits`` with a tiny FLUX Kontext pipeline, through the ``openai`` client and plain HTTP."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.serve.conftest import API_KEY, LiveServer, serving, tiny_runner

openai = pytest.importorskip("openai")

PROMPT = "make the cat red"
KONTEXT_DEFAULTS = {
    "num_inference_steps": 2,
    "guidance_scale": 2.5,
    "max_sequence_length": 16,
    "_auto_resize": False,  # Kontext scales inputs to ~1 MP unless told not to
    "max_area": 32 * 32,
}


@pytest.fixture(scope="module")
def kontext() -> Iterator[LiveServer]:
    """A tiny FluxKontextPipeline served as model ``kontext`` (no cache)."""
    with serving(tiny_runner("flux", "kontext", "kontext", KONTEXT_DEFAULTS)) as server:
        yield server


def _png(seed: int, size: int = 32) -> bytes:
    # Noise for small images (each seed its own); a huge one is flat so that its file stays small.
    if size > 64:
        pixels = np.full((size, size, 3), seed, dtype=np.uint8)
    else:
        pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _decode(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def _client(server: LiveServer) -> Any:
    return openai.OpenAI(base_url=server.api, api_key=API_KEY, max_retries=0, timeout=60)


def _post(server: LiveServer, files: Any, **data: Any) -> httpx.Response:
    return httpx.post(
        f"{server.api}/images/edits",
        files=files,
        data={"prompt": PROMPT, **{k: str(v) for k, v in data.items()}},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )


def test_the_openai_client_edits_an_image_as_the_pipeline_does(kontext: LiveServer) -> None:
    from fastdit.session import Case, call_arguments

    result = _client(kontext).images.edit(
        image=("cat.png", _png(0), "image/png"),
        prompt=PROMPT,
        size="32x32",
        response_format="b64_json",
        extra_body={"seed": 5, "num_inference_steps": 2},
    )
    served = _decode(result.data[0].b64_json)
    report = result.model_extra["fastdit"]
    assert report["seeds"] == [5] and (report["width"], report["height"]) == (32, 32)
    session = kontext.runner.session  # idle between requests: the same call, made directly
    image = Image.open(io.BytesIO(_png(0))).convert("RGB")
    overrides = {"image": image, "width": 32, "height": 32, "num_inference_steps": 2}
    expected = session.call(Case(PROMPT, 5), call_arguments(session.pipeline_class, KONTEXT_DEFAULTS, overrides))
    assert np.array_equal(served, np.round(expected * 255).astype(np.uint8))


def test_plain_http_multipart_uses_the_uploaded_image(kontext: LiveServer) -> None:
    first = _post(kontext, {"image": ("a.png", _png(1), "image/png")}, seed=3, n=2)
    assert first.status_code == 200, first.text
    body = first.json()
    assert len(body["data"]) == 2 and body["fastdit"]["seeds"] == [3, 4]
    other = _post(kontext, {"image": ("b.png", _png(2), "image/png")}, seed=3)
    assert not np.array_equal(_decode(body["data"][0]["b64_json"]), _decode(other.json()["data"][0]["b64_json"]))


@pytest.mark.parametrize(
    ("files", "data", "param", "words"),
    [
        ({"image": ("x.png", b"not a png", "image/png")}, {}, "image", "not an image file"),
        ({}, {}, "image", "upload an image file"),
        (
            [("image[]", ("a.png", _png(1), "image/png")), ("image[]", ("b.png", _png(2), "image/png"))],
            {},
            "image",
            "takes one input image, got 2",
        ),
        ({"image": ("a.png", _png(1, size=4096), "image/png")}, {}, "image", "at most 2048"),
        ({"image": ("a.png", _png(1), "image/png"), "mask": ("m.png", _png(3), "image/png")}, {}, "mask", "no mask"),
        ({"image": ("a.png", _png(1), "image/png")}, {"strength": 0.5}, "strength", "no strength"),
        ({"image": ("a.png", _png(1), "image/png")}, {"size": "30x32"}, "size", "multiples of 4"),
        ({"image": ("a.png", _png(1), "image/png")}, {"seed": -1}, "seed", "greater than or equal to 0"),
    ],
)
def test_bad_edits_are_422_naming_the_field(
    kontext: LiveServer, files: Any, data: dict, param: str, words: str
) -> None:
    response = _post(kontext, files, **data)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]


def test_a_json_body_is_refused(kontext: LiveServer) -> None:
    response = httpx.post(
        f"{kontext.api}/images/edits",
        content=b"prompt=x",
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "text/plain"},
    )
    assert response.status_code == 415 and "multipart/form-data" in response.json()["error"]["message"]


def test_a_model_that_takes_no_image_is_named(live_server: LiveServer) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        _client(live_server).images.edit(image=("a.png", _png(0), "image/png"), prompt=PROMPT)
    error = caught.value.body
    assert error["param"] == "image" and error["code"] == "unsupported_model"
    assert "'reference' (FluxPipeline) takes no input image" in error["message"]
