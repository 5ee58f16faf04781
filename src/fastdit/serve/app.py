"""The FastAPI application: OpenAI's image endpoint in front of one pipeline that runs one job at a time.

Requests are checked (:func:`fastdit.serve.jobs.build_job`), then wait in a bounded queue; one consumer task takes
them in order and runs each on a single worker thread (the one thread that ever calls the pipeline and, under
``torchrun``, the collectives). A full queue answers 429 with ``Retry-After``; a request not answered within
:attr:`Limits.timeout_s` answers 504 (a single process also stops its run at the next step). Errors are OpenAI's
error object; an unexpected one is a generic 500 whose details go to the server log only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastdit.serve import require
from fastdit.serve.jobs import ModelSpec, RequestError, build_job, invalid
from fastdit.serve.limits import Limits
from fastdit.serve.schemas import (
    ImageRequest,
    ImageResponse,
    ModelCard,
    ModelList,
)
from fastdit.serve.state import Engine, JobQueue, ServerState, answer, error_response
from fastdit.serve.videos import VideoStore
from fastdit.serve.worker import Job

__all__ = ["create_app"]

# A module global: FastAPI resolves the handlers' (postponed) annotations here. ``require`` names a missing package.
Request = require("fastapi").Request

logger = logging.getLogger("fastdit.serve")


async def _generate(state: ServerState, body: ImageRequest, request: Any = None) -> ImageResponse:
    return await answer(state, body, build_job(body, state.spec, state.limits, uuid.uuid4().hex), request)


def _auth(api_key: str | None) -> Callable[..., None]:
    def check(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise RequestError(
                401,
                "missing or wrong API key: send Authorization: Bearer <key>",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    return check


def _install_handlers(app: Any) -> None:
    from fastapi.exceptions import RequestValidationError

    @app.exception_handler(RequestError)
    async def request_error(_request: Request, error: RequestError) -> Any:
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, error: RequestValidationError) -> Any:
        first = error.errors()[0] if error.errors() else {}
        if first.get("type") == "json_invalid":  # its location is a character offset, not a field
            return error_response(RequestError(422, "the body is not valid JSON", code="invalid_json"))
        location = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = ".".join(location) or None
        message = first.get("msg", "invalid request").removeprefix("Value error, ")
        return error_response(invalid(param, message) if param else RequestError(422, message))

    @app.exception_handler(Exception)
    async def unexpected(_request: Request, error: Exception) -> Any:
        logger.error("unhandled error", exc_info=error)
        return error_response(RequestError(500, "internal server error", type="server_error"))


def _install_metrics_middleware(app: Any, state: ServerState) -> None:
    @app.middleware("http")
    async def count(request: Request, call_next: Callable[[Request], Any]) -> Any:
        start = time.perf_counter()
        status = 500
        try:
            response = await call_next(request)
            status = response.status_code
            return response
        finally:
            # The route's template (/v1/videos/{video_id}), never the raw path: label values stay bounded.
            route = request.scope.get("route")
            endpoint = getattr(route, "path", None) or "other"
            state.metrics.observe(endpoint, status, time.perf_counter() - start)


def _install_routes(app: Any, state: ServerState, api_key: str | None) -> None:
    from fastapi import Depends
    from fastapi.responses import JSONResponse, Response

    authorized = [Depends(_auth(api_key))]

    @app.post("/v1/images/generations", response_model=ImageResponse, dependencies=authorized)
    async def generations(body: ImageRequest, request: Request) -> ImageResponse:
        return await _generate(state, body, request)

    @app.get("/v1/models", response_model=ModelList, dependencies=authorized)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=state.spec.name, created=state.created)])

    @app.get("/health")
    async def health() -> Any:
        status = "failed" if state.failure is not None else "warming_up" if state.warming else "ok"
        body: dict[str, Any] = {"status": status, "model": state.spec.name, "queue": state.outstanding}
        if state.warmup:
            body["warmup"] = {"done": state.warmed, "total": len(state.warmup)}
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        text, content_type = state.metrics.render()
        return Response(text, media_type=content_type)

    from fastdit.serve import endpoints

    endpoints.install(app, state, authorized)


def create_app(
    engine: Engine,
    spec: ModelSpec,
    *,
    limits: Limits | None = None,
    api_key: str | None = None,
    on_fatal: Callable[[BaseException], None] | None = None,
    warmup: list[Job] | None = None,
    lora_dir: Any = None,
    videos: VideoStore | None = None,
) -> Any:
    """Build the FastAPI application.

    Args:
        engine: Runs jobs (:class:`fastdit.serve.worker.Driver`).
        spec: The served model (:meth:`ModelSpec.of`).
        limits: Request and queue limits (default :class:`Limits`).
        api_key: When set, ``/v1/*`` needs ``Authorization: Bearer <api_key>`` (401 otherwise).
        on_fatal: Called with the error after which the server cannot run jobs (a lost rank): stop serving.
        warmup: Jobs to run before serving (:func:`fastdit.serve.jobs.warmup_jobs`); ``/health`` answers 503
            ``warming_up`` until they are done.
        lora_dir: The directory ``POST /v1/loras`` may load from (``None``: LoRA loading is off).
        videos: Where video jobs are kept (video models; default: a temporary directory, one hour, 100 jobs).

    Returns:
        The application; its :class:`ServerState` is ``app.state.server``.

    Raises:
        ImportError: A package the server needs is missing (named): the HTTP stack, or imageio and imageio-ffmpeg
            for a video model.
    """
    fastapi = require("fastapi")
    require("prometheus_client")
    if spec.video:
        require("imageio")
        require("imageio_ffmpeg")
        videos = VideoStore() if videos is None else videos  # (an empty store is falsy: it has a length)
    state = ServerState(engine, spec, limits or Limits(), on_fatal, warmup, videos)
    state.lora_dir = None if lora_dir is None else Path(lora_dir).resolve()

    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        state.queue = JobQueue()  # bound to the loop that serves
        consumer = asyncio.create_task(state.consume())
        try:
            yield
        finally:
            consumer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await consumer
            await asyncio.to_thread(state.close)

    app = fastapi.FastAPI(title="fastdit", version=_version(), lifespan=lifespan)
    app.state.server = state
    _install_handlers(app)
    _install_metrics_middleware(app, state)
    _install_routes(app, state, api_key)
    return app


def _version() -> str:
    from fastdit import __version__

    return __version__
