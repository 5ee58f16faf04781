"""Fixtures of the server tests: the reference pipeline behind a real uvicorn server on a free loopback port."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

API_KEY = "test-key"
"""The key the live server requires."""


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class LiveServer:
    """A running server: its base URL and the runner behind it."""

    url: str
    runner: Any

    @property
    def api(self) -> str:
        """The OpenAI base URL."""
        return f"{self.url}/v1"


@pytest.fixture(scope="package")
def reference_runner() -> Any:
    """The reference pipeline on the CPU with the server's default cache (``balanced``), loaded once."""
    import torch

    from fastdit.cache.presets import cache_config
    from fastdit.serve.worker import Runner
    from fastdit.session import Session, resolve_model

    try:
        source = resolve_model(None, None)
    except ValueError as error:  # weights not installed
        pytest.skip(str(error))
    session = Session.load(source, device="cpu", dtype=torch.float32)
    return Runner(session, {"cache": cache_config("balanced")}, "balanced")


@contextlib.contextmanager
def serving(runner: Any, app_options: dict[str, Any] | None = None, **limits: Any) -> Iterator[LiveServer]:
    """``create_app`` over ``runner`` with ``limits`` (and ``app_options``: ``create_app``'s keywords), served by
    uvicorn in a thread; requires :data:`API_KEY`."""
    import uvicorn

    from fastdit.serve.app import create_app
    from fastdit.serve.jobs import ModelSpec
    from fastdit.serve.limits import Limits
    from fastdit.serve.worker import Driver

    spec = ModelSpec.of(runner.session, runner.default_cache)
    app = create_app(Driver(runner), spec, limits=Limits(**limits), api_key=API_KEY, **(app_options or {}))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", runner)
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def tiny_runner(family: str, variant: str, name: str, defaults: dict[str, Any], options: dict | None = None) -> Any:
    """A runner over the tiny pipeline ``variant`` of ``family``, served as model ``name`` with call ``defaults``."""
    from fastdit.serve.worker import Runner
    from fastdit.session import ModelSource, Session
    from fastdit.testing.pipelines import build_tiny

    pipe, _ = build_tiny(family, variant)
    source = ModelSource(name, f"diffusers.{type(pipe).__name__}", defaults=defaults)
    return Runner(Session(pipe, source, "cpu"), options or {}, "none")


@pytest.fixture(scope="package")
def live_server(reference_runner: Any) -> Iterator[LiveServer]:
    """The reference pipeline behind a live server (at most 50 steps a request)."""
    with serving(reference_runner, max_steps=50) as server:
        yield server
