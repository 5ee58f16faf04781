"""The web page at ``/``: served without a key, self-contained, and (in headless Chromium) it draws an image."""

from __future__ import annotations

import base64
import io
import re
import shutil
import subprocess

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.serve.conftest import API_KEY, LiveServer

CHROMIUM = next(
    (shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome") if shutil.which(name)), None
)


def test_the_page_is_served_without_a_key_and_loads_nothing_from_elsewhere(live_server: LiveServer) -> None:
    response = httpx.get(f"{live_server.url}/")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    page = response.text
    for element in ('id="prompt"', 'id="size"', 'id="steps"', 'id="seed"', 'id="image"', 'id="stats"'):
        assert element in page
    assert not re.search(r"(src|href)=\"(https?:)?//", page)  # no CDN: every byte comes from this server
    assert 'fetch("v1/images/generations"' in page  # relative: works behind a proxy under a path prefix


@pytest.mark.skipif(CHROMIUM is None, reason="needs a headless Chromium (apt-get install chromium); CI has none")
def test_headless_chromium_generates_an_image_with_the_page(live_server: LiveServer) -> None:
    query = "prompt=a%20handwritten%20digit%202&size=32x32&steps=6&seed=1&autorun=1"
    url = f"{live_server.url}/?{query}#key={API_KEY}"
    command = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--virtual-time-budget=60000",
        "--dump-dom",
        url,
    ]
    dom = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True).stdout
    match = re.search(r'<img id="image"[^>]*src="data:image/png;base64,([A-Za-z0-9+/=]+)"', dom)
    assert match is not None, dom[-2000:]
    assert re.search(r'id="status"[^>]*>done<', dom)
    assert "<td>seed</td><td>1</td>" in dom and "<td>cache</td><td>balanced</td>" in dom
    drawn = np.asarray(Image.open(io.BytesIO(base64.b64decode(match.group(1)))).convert("RGB"))
    body = {"prompt": "a handwritten digit 2", "size": "32x32", "num_inference_steps": 6, "seed": 1}
    api = httpx.post(
        f"{live_server.api}/images/generations", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120
    ).json()
    expected = np.asarray(Image.open(io.BytesIO(base64.b64decode(api["data"][0]["b64_json"]))).convert("RGB"))
    assert np.array_equal(drawn, expected)  # the page showed what the API makes for the same fields
