"""What the server's handlers share: the job queue, its one consumer, and the answers built from job results.

:class:`ServerState` holds the queue (bounded: a full one answers 429), the single worker thread that runs every
pipeline call (and, under ``torchrun``, every collective), the video store and the metrics; :func:`wait` and
:func:`answer` are how a handler hands a job over and turns its result into OpenAI's response or error object.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from fastdit.serve.jobs import ModelSpec, RequestError, compatible, invalid, merge, request_field
from fastdit.serve.limits import Limits
from fastdit.serve.lora import LoraError, LoraOp
from fastdit.serve.metrics import Metrics
from fastdit.serve.schemas import (
    CacheReport,
    ErrorResponse,
    ImageData,
    ImageRequest,
    ImageResponse,
    RunReport,
    Timings,
)
from fastdit.serve.videos import VideoStore
from fastdit.serve.worker import Job, JobResult, JobTimeoutError, Progress

__all__ = ["Engine", "JobQueue", "ServerState", "answer", "cache_report", "error_response", "wait"]

logger = logging.getLogger("fastdit.serve")


class Engine(Protocol):
    """What the app drives: :class:`fastdit.serve.worker.Driver`, or a stand-in in tests."""

    @property
    def heartbeat_s(self) -> float | None: ...

    def run(
        self, job: Job, should_stop: Callable[[], bool] | None = None, progress: Progress | None = None
    ) -> JobResult: ...

    def lora(self, op: LoraOp) -> list[dict[str, Any]]: ...

    def lora_refusal(self, fuse: bool = True) -> str | None: ...

    def heartbeat(self) -> None: ...

    def stop(self) -> None: ...


@dataclass
class _Pending:
    job: Job | LoraOp  # a LoRA operation waits in the same queue: it must not run while a job does
    future: asyncio.Future
    enqueued: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)
    started: float | None = None
    on_start: Callable[[], None] | None = None
    progress: Progress | None = None


class JobQueue(asyncio.Queue):
    """A FIFO queue from which the consumer can also take later items that fit a batch, leaving the rest in order."""

    def take(self, predicate: Callable[[_Pending], bool]) -> list[_Pending]:
        """Remove and return the queued items ``predicate`` accepts (asked once each, in queue order)."""
        taken = [item for item in self._queue if predicate(item)]  # the deque asyncio.Queue subclasses keep items in
        for item in taken:
            self._queue.remove(item)
        return taken


def _split(result: JobResult, batch: list[_Pending]) -> list[JobResult]:
    """Each request's share of a batched result: its own images; the call's time and cache counts."""
    if len(batch) == 1:
        return [result]
    parts, start = [], 0
    for pending in batch:
        end = start + len(pending.job.cases)
        parts.append(replace(result, outputs=result.outputs[start:end]))
        start = end
    return parts


def _fatal_errors() -> tuple[type[BaseException], ...]:
    from fastdit.parallel.failures import CollectiveError

    return (CollectiveError,)


class ServerState:
    """The queue, its one consumer and what they measured; :func:`create_app` keeps it as ``app.state.server``.

    Args:
        engine: Runs jobs.
        spec: The served model.
        limits: Request and queue limits.
        on_fatal: Called once, from the event loop, with an error after which no job can run (a lost rank).
        warmup: Jobs run before the first request (the server reports ``warming_up`` until they are done).
        videos: The video jobs' store (video models only).
    """

    def __init__(
        self,
        engine: Engine,
        spec: ModelSpec,
        limits: Limits,
        on_fatal: Callable[[BaseException], None] | None = None,
        warmup: list[Job] | None = None,
        videos: VideoStore | None = None,
    ) -> None:
        self.engine, self.spec, self.limits, self.on_fatal = engine, spec, limits, on_fatal
        self.warmup = list(warmup or [])
        self.warmed = 0  # warm-up jobs done
        self.videos = videos
        self.tasks: set[asyncio.Task] = set()  # video jobs being awaited (kept referenced until done)
        self.lora_dir: Path | None = None
        self.lora_cards: list[dict[str, Any]] = []  # the adapters loaded, as the last LoRA operation reported
        self.metrics = Metrics()
        self.created = int(time.time())
        self.queue = JobQueue()
        self.outstanding = 0  # queued + running: what the limit counts
        self.failure: BaseException | None = None
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="fastdit-pipeline")
        self.run_s_average: float | None = None
        self.metrics.queue_depth.set_function(lambda: self.outstanding)

    def retry_after(self) -> int:
        """Seconds a refused client should wait: the queue ahead of it at the average run time (at least 1)."""
        per_job = self.run_s_average or 1.0
        return max(1, math.ceil(per_job * max(self.outstanding, 1)))

    @property
    def warming(self) -> bool:
        """Whether warm-up jobs are still to run."""
        return self.warmed < len(self.warmup)

    def submit(self, job: Job | LoraOp, **hooks: Any) -> _Pending:
        """Queue ``job``, or refuse it (429 when the queue is full, 503 while warming up or once the server failed).

        Args:
            job: A job, or a LoRA operation.
            hooks: ``on_start`` (called when it starts running) and ``progress`` (after each step).
        """
        if self.failure is not None:
            raise RequestError(503, "the server is shutting down after a failure", type="server_error")
        if self.warming:
            raise RequestError(
                503,
                f"the server is warming up ({self.warmed} of {len(self.warmup)} warm-up runs done); retry later",
                type="server_error",
                code="warming_up",
                headers={"Retry-After": str(self.retry_after())},
            )
        if self.outstanding >= self.limits.queue_size + 1:  # queue_size may wait while one runs
            raise RequestError(
                429,
                f"the queue is full ({self.limits.queue_size} waiting); retry later",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(self.retry_after())},
            )
        pending = _Pending(job, asyncio.get_running_loop().create_future(), **hooks)
        self.outstanding += 1
        self.queue.put_nowait(pending)
        return pending

    async def consume(self) -> None:
        """Run the warm-up, then queued jobs one at a time until cancelled or a fatal error; ping workers when idle."""
        loop = asyncio.get_running_loop()
        if not await self._warm_up(loop):
            return
        while True:
            try:
                first = await asyncio.wait_for(self.queue.get(), timeout=self.engine.heartbeat_s)
            except asyncio.TimeoutError:
                if not await self._guarded(loop, self.engine.heartbeat):
                    return
                continue
            if isinstance(first.job, LoraOp):
                try:
                    if not first.future.done() and not await self._control(loop, first):
                        return
                finally:
                    self.outstanding -= 1
                continue
            batch = [first, *self._companions(first)]
            try:
                live = [pending for pending in batch if not pending.future.done()]  # timed out while waiting: skip
                if live and not await self._run(loop, live):
                    return
            finally:
                self.outstanding -= len(batch)

    async def _warm_up(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Run the warm-up jobs in order (on every rank, like requests); a failure ends the server."""
        for job in self.warmup[self.warmed :]:
            start = time.perf_counter()
            try:
                await loop.run_in_executor(self.executor, self.engine.run, job)
            except Exception as error:
                logger.error("warm-up %s failed", job.id, exc_info=error)
                self._fail(error)
                return False
            logger.info("warm-up %s: %.2f s", job.id, time.perf_counter() - start)
            self.warmed += 1
        return True

    async def _control(self, loop: asyncio.AbstractEventLoop, pending: _Pending) -> bool:
        """Run a LoRA operation between jobs; ``False`` after a fatal error."""
        pending.started = time.perf_counter()
        try:
            result = await loop.run_in_executor(self.executor, self.engine.lora, pending.job)
        except Exception as error:
            if not pending.future.done():
                pending.future.set_exception(error)
            if isinstance(error, _fatal_errors()):
                self._fail(error)
                return False
            return True
        if not pending.future.done():
            pending.future.set_result(result)
        return True

    def _companions(self, first: _Pending) -> list[_Pending]:
        """Queued jobs that can share ``first``'s pipeline calls, within :attr:`Limits.max_batch` images."""
        room = self.limits.max_batch - len(first.job.cases)
        if room <= 0 or first.job.batch <= 1:
            return []

        def fits(other: _Pending) -> bool:
            nonlocal room
            if not isinstance(other.job, Job) or other.future.done():
                return False
            if len(other.job.cases) > room or not compatible(first.job, other.job):
                return False
            room -= len(other.job.cases)
            return True

        return self.queue.take(fits)

    async def _guarded(self, loop: asyncio.AbstractEventLoop, call: Callable[[], Any]) -> bool:
        try:
            await loop.run_in_executor(self.executor, call)
        except _fatal_errors() as error:
            self._fail(error)
            return False
        return True

    async def _run(self, loop: asyncio.AbstractEventLoop, batch: list[_Pending]) -> bool:
        started = time.perf_counter()
        for pending in batch:
            pending.started = started
        job = merge([pending.job for pending in batch])

        def should_stop() -> bool:  # a shared call stops only once every request in it timed out
            return all(pending.cancelled.is_set() for pending in batch)

        for pending in batch:
            if pending.on_start is not None:
                pending.on_start()
        progress = batch[0].progress if len(batch) == 1 else None
        try:
            result = await loop.run_in_executor(self.executor, self.engine.run, job, should_stop, progress)
        except Exception as error:
            for pending in batch:
                if not pending.future.done():
                    pending.future.set_exception(error)
            if isinstance(error, _fatal_errors()):
                self._fail(error)
                return False
            return True
        self._record(result)
        for pending, part in zip(batch, _split(result, batch), strict=True):
            if not pending.future.done():
                pending.future.set_result(part)
        return True

    def _record(self, result: JobResult) -> None:
        self.run_s_average = (
            result.run_s if self.run_s_average is None else 0.8 * self.run_s_average + 0.2 * result.run_s
        )
        self.metrics.record_run(result)

    def _fail(self, error: BaseException) -> None:
        logger.error("stopping: %s", error)
        self.failure = error
        while not self.queue.empty():
            waiting = self.queue.get_nowait()
            self.outstanding -= 1
            if not waiting.future.done():
                waiting.future.set_exception(RequestError(503, "the server stopped", type="server_error"))
        if self.on_fatal is not None:
            self.on_fatal(error)

    def close(self) -> None:
        """Stop the workers (after the running job) and the worker thread; remove the video files."""
        if self.failure is None or not isinstance(self.failure, _fatal_errors()):  # e.g. a failed warm-up run
            with contextlib.suppress(Exception):  # a worker that is already gone: nothing left to stop
                self.executor.submit(self.engine.stop).result(timeout=60)
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self.videos is not None:
            self.videos.close()


def error_response(error: RequestError) -> Any:
    from fastapi.responses import JSONResponse

    body = ErrorResponse.of(error.message, error.type, error.param, error.code)
    return JSONResponse(body, status_code=error.status, headers=error.headers)


def _job_error(error: BaseException) -> RequestError:
    """What a failed job answers: the field for bad values, a generic 500 for everything else (logged)."""
    from fastdit.errors import FieldError, NonFiniteOutputError

    if isinstance(error, RequestError):
        return error
    if isinstance(error, LoraError):
        return RequestError(error.status, error.message, param=error.param, code="lora_error")
    if isinstance(error, FieldError):
        param = request_field(error)
        if param is not None:
            return invalid(param, error.requirement)
    if isinstance(error, NonFiniteOutputError):
        suspects = ", ".join(sorted(error.arguments)) or None
        return RequestError(
            422 if suspects else 500,
            "the pipeline produced an image with NaN or infinite values" + (f" (check {suspects})" if suspects else ""),
            param=suspects,
            type="invalid_request_error" if suspects else "server_error",
        )
    logger.error("request failed", exc_info=error)
    return RequestError(500, "internal server error", type="server_error")


def _encode(result: JobResult) -> tuple[list[str], float]:
    from fastdit.io import image_bytes

    start = time.perf_counter()
    images = [base64.b64encode(image_bytes(output)).decode("ascii") for output in result.outputs]
    return images, time.perf_counter() - start


def cache_report(result: JobResult) -> CacheReport:
    counts = result.cache
    steps, cached = counts.get("steps", 0), counts.get("cached_steps", 0)
    total = counts.get("blocks_total", 0)
    return CacheReport(
        preset=result.cache_name,
        steps=steps,
        cached_steps=cached,
        computed_steps=steps - cached,
        hit_ratio=cached / steps if steps else 0.0,
        blocks_computed_fraction=counts.get("blocks_computed", 0) / total if total else 1.0,
    )


def _response(
    state: ServerState, body: ImageRequest, pending: _Pending, result: JobResult, images: list[str], encode_s: float
) -> ImageResponse:
    now = time.perf_counter()
    started = pending.started or pending.enqueued
    kwargs = pending.job.kwargs
    timings = Timings(
        queue_s=started - pending.enqueued, run_s=result.run_s, encode_s=encode_s, total_s=now - pending.enqueued
    )
    report = RunReport(
        model=state.spec.name,
        seeds=[case.seed for case in pending.job.cases],
        width=int(result.outputs[0].shape[-2]) if result.outputs else kwargs.get("width"),
        height=int(result.outputs[0].shape[-3]) if result.outputs else kwargs.get("height"),
        num_inference_steps=kwargs.get("num_inference_steps"),
        batched_with=result.images_per_call,
        timings=timings,
        cache=cache_report(result),
    )
    if body.response_format == "url":  # no file store: the image itself, as a data URL
        data = [ImageData(url=f"data:image/png;base64,{image}") for image in images]
    else:
        data = [ImageData(b64_json=image) for image in images]
    return ImageResponse(created=int(time.time()), data=data, fastdit=report)


async def _drop_on_disconnect(state: ServerState, pending: _Pending, request: Any) -> None:
    """While ``pending`` waits in the queue, drop it if its client disconnects (nobody would read the answer).

    The request's body has been read, so the next ASGI message it receives is the disconnect; asking for it also
    resumes reading the socket, which is how the server notices a closed connection at all. A job that has started
    runs on: every rank is already computing it (a single process stops it only at the timeout).
    """
    message = await request.receive()
    if message.get("type") == "http.disconnect" and pending.started is None and not pending.future.done():
        pending.future.set_exception(RequestError(499, "the client closed the request", code="disconnected"))
        state.metrics.dropped.inc()
        logger.info("dropped a queued request: its client disconnected")


async def wait(state: ServerState, pending: _Pending, request: Any = None) -> Any:
    """The result of a queued job or LoRA operation, or the error to answer (504 past the timeout).

    With the HTTP ``request``, a job still queued when its client disconnects is dropped: the consumer skips it.
    """
    watcher = None if request is None else asyncio.create_task(_drop_on_disconnect(state, pending, request))
    try:
        return await asyncio.wait_for(pending.future, timeout=state.limits.timeout_s)
    except asyncio.TimeoutError:
        pending.cancelled.set()  # a running job stops at its next step (single process)
        raise RequestError(
            504, f"the request took longer than {state.limits.timeout_s:g} s", type="server_error", code="timeout"
        ) from None
    except JobTimeoutError:
        raise RequestError(504, "the request timed out", type="server_error", code="timeout") from None
    except RequestError:
        raise
    except Exception as error:
        raise _job_error(error) from None
    finally:
        if watcher is not None:
            watcher.cancel()


async def answer(state: ServerState, body: ImageRequest, job: Job, request: Any = None) -> ImageResponse:
    """Queue an image job, wait for it (dropped if ``request``'s client disconnects first), encode the response."""
    pending = state.submit(job)
    result = await wait(state, pending, request)
    images, encode_s = await asyncio.to_thread(_encode, result)
    return _response(state, body, pending, result, images, encode_s)
