"""The endpoints beyond image generation: edits, videos, LoRA adapters and the web page at ``/``.

Each handler checks everything it can before queueing (fields, uploaded files, what the model takes), answers 4xx
naming the field otherwise, and hands the pipeline work to the queue of :class:`~fastdit.serve.state.ServerState`,
so edits, video jobs and LoRA changes run one at a time with the image requests, on every rank alike.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from importlib import resources
from pathlib import Path
from typing import Any

from fastdit.serve import require
from fastdit.serve.inputs import decode_image, read_upload
from fastdit.serve.jobs import RequestError, build_edit_job, build_video_job, check_edit_model, invalid
from fastdit.serve.lora import LoraOp
from fastdit.serve.schemas import (
    EditRequest,
    ImageResponse,
    LoraCard,
    LoraList,
    LoraRequest,
    VideoError,
    VideoList,
    VideoObject,
    VideoRequest,
)
from fastdit.serve.state import ServerState, answer, cache_report, wait
from fastdit.serve.videos import VideoRecord, VideoStore
from fastdit.serve.worker import JobResult

__all__ = ["install"]

Request = require("fastapi").Request

logger = logging.getLogger("fastdit.serve")

_IMAGE_FIELDS = ("image", "image[]")


def _validated(model: type, data: dict[str, Any]) -> Any:
    """``model`` from form or JSON fields; a bad one is a 422 naming it (as FastAPI's own validation does)."""
    from pydantic import ValidationError

    try:
        return model.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        param = ".".join(str(part) for part in first.get("loc", ())) or None
        message = first.get("msg", "invalid value").removeprefix("Value error, ")
        raise (invalid(param, message) if param else RequestError(422, message)) from None


async def _form(request: Request) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """A multipart body's text fields and its files by field name (JSON bodies: fields only)."""
    content_type = request.headers.get("content-type", "")
    if content_type.startswith("application/json"):
        try:
            body = await request.json()
        except ValueError:
            raise RequestError(422, "the body is not valid JSON") from None
        if not isinstance(body, dict):
            raise RequestError(422, "the body must be a JSON object")
        return body, {}
    if not content_type.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        raise RequestError(415, f"send multipart/form-data (or JSON), not {content_type or 'no content type'!r}")
    form = await request.form()
    fields: dict[str, Any] = {}
    files: dict[str, list[Any]] = {}
    for key, value in form.multi_items():
        if isinstance(value, str):
            fields[key] = value
        else:
            files.setdefault(key, []).append(value)
    return fields, files


# ---- /v1/images/edits


async def _decoded(upload: Any, field: str, state: ServerState, mode: str = "RGB") -> Any:
    """An uploaded image, decoded off the event loop (a large PNG takes tens of milliseconds)."""
    data = await read_upload(upload, field, state.limits)
    return await asyncio.to_thread(decode_image, data, field, state.limits, mode=mode)


async def _edit(state: ServerState, request: Request) -> ImageResponse:
    fields, files = await _form(request)
    body = _validated(EditRequest, fields)
    check_edit_model(body, state.spec)  # an image model refuses any edit, whatever its files
    uploads = [upload for name in _IMAGE_FIELDS for upload in files.get(name, [])]
    if not uploads:
        raise invalid("image", "upload an image file (form field image, or image[] for several)")
    if len(uploads) > state.limits.max_images:
        raise invalid("image", f"at most {state.limits.max_images} images, got {len(uploads)}")
    images = [await _decoded(u, "image", state) for u in uploads]
    mask = await _decoded(files["mask"][0], "mask", state, mode="L") if files.get("mask") else None
    job = build_edit_job(body, images, mask, state.spec, state.limits, uuid.uuid4().hex)
    return await answer(state, body, job, request)


# ---- /v1/videos


def _store(state: ServerState) -> VideoStore:
    if state.videos is None:
        raise RequestError(
            400,
            f"model {state.spec.describe()} makes images; the video endpoints need a video pipeline",
            param="model",
            code="unsupported_model",
        )
    return state.videos


def _video_object(state: ServerState, record: VideoRecord) -> VideoObject:
    error = VideoError(**record.error) if record.error else None
    return VideoObject(
        id=record.id,
        model=record.model,
        status=record.status,
        progress=record.progress,
        created_at=record.created_at,
        completed_at=record.completed_at,
        expires_at=_store(state).expires_at(record),
        prompt=record.prompt,
        seconds=record.seconds,
        size=record.size,
        error=error,
        fastdit=record.report,
    )


def _video_report(state: ServerState, pending: Any, result: JobResult) -> dict[str, Any]:
    """fastdit's report of a finished video job (the ``fastdit`` field of its video object)."""
    started = pending.started or pending.enqueued
    return {
        "model": state.spec.name,
        "seeds": [case.seed for case in pending.job.cases],
        "num_frames": int(result.outputs[0].shape[0]),
        "num_inference_steps": pending.job.kwargs.get("num_inference_steps"),
        "timings": {
            "queue_s": started - pending.enqueued,
            "run_s": result.run_s,
            "total_s": time.perf_counter() - pending.enqueued,
        },
        "cache": cache_report(result).model_dump(),
    }


async def _finish_video(state: ServerState, record: VideoRecord, pending: Any, fps: float) -> None:
    """Wait for a video job, then write its mp4 (off the event loop) or record why it failed."""
    store = _store(state)
    try:
        result = await wait(state, pending)
    except RequestError as error:
        store.fail(record, error)
        return
    report = _video_report(state, pending, result)
    try:
        await asyncio.to_thread(store.complete, record, result.outputs[0], fps, report)
    except Exception as error:
        logger.error("writing video %s failed", record.id, exc_info=error)
        store.fail(record, RequestError(500, "the video could not be encoded", type="server_error", code="encode"))


def _on_progress(record: VideoRecord) -> Any:
    def progress(done: int, total: int) -> None:  # from the pipeline thread: one int assignment
        record.progress = min(99, int(100 * done / max(total, 1)))

    return progress


async def _create_video(state: ServerState, request: Request) -> VideoObject:
    store = _store(state)
    fields, files = await _form(request)
    body = _validated(VideoRequest, fields)
    image = None
    if files.get("input_reference"):
        image = await _decoded(files["input_reference"][0], "input_reference", state)
    elif "input_reference" in fields:
        raise invalid("input_reference", "upload an image file (a reference by URL or file id is not supported)")
    job = build_video_job(body, image, state.spec, state.limits, uuid.uuid4().hex)
    width, height = job.kwargs.get("width"), job.kwargs.get("height")
    frames = job.kwargs.get("num_frames")
    size = f"{width}x{height}" if width and height else "auto"
    seconds = f"{(frames - 1) / body.fps:g}" if frames else "auto"
    record = store.create(state.spec.name, body.prompt, size, seconds)
    try:
        pending = state.submit(job, on_start=lambda: store.start(record), progress=_on_progress(record))
    except RequestError:
        store.fail(record, RequestError(429, "not queued", code="not_queued"))
        store.delete(record.id)
        raise
    task = asyncio.create_task(_finish_video(state, record, pending, body.fps))
    state.tasks.add(task)
    task.add_done_callback(state.tasks.discard)
    return _video_object(state, record)


def _poll_headers(record: VideoRecord) -> dict[str, str]:
    # The openai client's poll() waits this long between retrievals of an unfinished job.
    return {} if record.done else {"openai-poll-after-ms": "500"}


def _content(state: ServerState, video_id: str, variant: str) -> Any:
    from fastapi.responses import FileResponse, Response

    record = _store(state).get(video_id)
    if variant not in ("video", "thumbnail"):
        raise invalid("variant", f"must be video or thumbnail, got {variant!r}")
    if record.status != "completed" or record.path is None:
        raise RequestError(409, f"video {video_id!r} is {record.status}, not completed", code="video_not_ready")
    if variant == "thumbnail":
        return Response(record.thumbnail, media_type="image/png")
    return FileResponse(record.path, media_type="video/mp4", filename=f"{record.id}.mp4")


def _install_videos(app: Any, state: ServerState, authorized: list[Any]) -> None:
    from fastapi import Query
    from fastapi.responses import JSONResponse

    @app.post("/v1/videos", response_model=VideoObject, dependencies=authorized)
    async def create_video(request: Request) -> VideoObject:
        return await _create_video(state, request)

    @app.get("/v1/videos", response_model=VideoList, dependencies=authorized)
    async def list_videos(
        after: str | None = None,
        limit: int = Query(20, ge=1, le=100),
        order: str = Query("desc", pattern="^(asc|desc)$"),
    ) -> VideoList:
        records, more = _store(state).page(after, limit, order)
        data = [_video_object(state, record) for record in records]
        first, last = (data[0].id, data[-1].id) if data else (None, None)
        return VideoList(data=data, first_id=first, last_id=last, has_more=more)

    @app.get("/v1/videos/{video_id}", response_model=VideoObject, dependencies=authorized)
    async def retrieve_video(video_id: str) -> Any:
        record = _store(state).get(video_id)
        body = _video_object(state, record).model_dump(mode="json")
        return JSONResponse(body, headers=_poll_headers(record))

    @app.get("/v1/videos/{video_id}/content", dependencies=authorized)
    async def video_content(video_id: str, variant: str = "video") -> Any:
        return _content(state, video_id, variant)

    @app.delete("/v1/videos/{video_id}", dependencies=authorized)
    async def delete_video(video_id: str) -> dict[str, Any]:
        _store(state).delete(video_id)
        return {"id": video_id, "object": "video.deleted", "deleted": True}


# ---- /v1/loras


def _lora_path(state: ServerState, text: str) -> Path:
    """``text`` resolved under the LoRA directory; anything outside it (``..``, absolute, links) is refused."""
    root = state.lora_dir
    assert root is not None
    candidate = (root / text).resolve()
    if not candidate.is_relative_to(root) or not candidate.exists():
        raise invalid("path", f"{text!r} is not a file or directory under the server's LoRA directory")
    return candidate


def _check_lora_allowed(state: ServerState, fuse: bool = True) -> None:
    if state.lora_dir is None:
        raise RequestError(
            403, "LoRA loading is off: start the server with --lora-dir DIR", param="path", code="lora_disabled"
        )
    refusal = state.engine.lora_refusal(fuse)
    if refusal is not None:
        raise RequestError(
            400, f"model {state.spec.describe()} cannot take LoRA adapters: {refusal}", code="unsupported_model"
        )


async def _run_lora(state: ServerState, op: LoraOp) -> list[dict[str, Any]]:
    cards = await wait(state, state.submit(op))
    state.lora_cards = cards
    return cards


def _install_loras(app: Any, state: ServerState, authorized: list[Any]) -> None:
    @app.post("/v1/loras", response_model=LoraCard, status_code=201, dependencies=authorized)
    async def load_lora(body: LoraRequest) -> LoraCard:
        _check_lora_allowed(state, body.fuse)
        path = _lora_path(state, body.path)
        op = LoraOp("load", body.name, str(path), body.path, body.scale, body.fuse)
        cards = await _run_lora(state, op)
        return LoraCard(**next(card for card in cards if card["name"] == body.name))

    @app.get("/v1/loras", response_model=LoraList, dependencies=authorized)
    async def list_loras() -> LoraList:
        return LoraList(data=[LoraCard(**card) for card in state.lora_cards])

    @app.delete("/v1/loras/{name}", dependencies=authorized)
    async def delete_lora(name: str) -> dict[str, Any]:
        _check_lora_allowed(state)
        await _run_lora(state, LoraOp("delete", name))
        return {"name": name, "object": "lora.deleted", "deleted": True}


# ---- the page


def _page() -> str:
    return resources.files("fastdit.serve").joinpath("static/index.html").read_text(encoding="utf-8")


def install(app: Any, state: ServerState, authorized: list[Any]) -> None:
    """Add the edit, video, LoRA and page routes to ``app``."""
    from fastapi.responses import HTMLResponse

    @app.post("/v1/images/edits", response_model=ImageResponse, dependencies=authorized)
    async def edits(request: Request) -> ImageResponse:
        return await _edit(state, request)

    _install_videos(app, state, authorized)
    _install_loras(app, state, authorized)
    page = _page()

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def index() -> HTMLResponse:
        return HTMLResponse(page)
