"""Video jobs of ``POST /v1/videos``: their records, and the mp4 files of finished ones, kept bounded.

A job is ``queued``, then ``in_progress`` (with a percentage of its denoising steps), then ``completed`` (its mp4
written atomically into the store's directory, so a download never sees half a file) or ``failed`` (an error code
and message, never a traceback or a path). Finished jobs are dropped, files included, :attr:`VideoStore.ttl_s`
seconds after they finished, and the oldest finished ones earlier when more than :attr:`VideoStore.max_videos`
are kept. Ids are 128 random bits: a client cannot find another client's videos by guessing.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from fastdit.serve.jobs import RequestError

__all__ = ["VideoRecord", "VideoStore"]

Status = Literal["queued", "in_progress", "completed", "failed"]


@dataclass
class VideoRecord:
    """One video job.

    Attributes:
        id: ``video_`` and 32 hex digits.
        model: The served model's name.
        prompt: The prompt.
        size: ``WIDTHxHEIGHT`` asked for, or the model's.
        seconds: The clip's length (frames over fps), as OpenAI reports it: a string.
        status: Where the job is.
        progress: Percent of the denoising steps done.
        created_at: Unix time of the request.
        completed_at: Unix time it finished (completed or failed).
        error: ``{"code", "message", "param"}`` of a failed job.
        report: fastdit's report (seeds, timings, cache) of a completed job.
        path: The mp4 of a completed job.
        thumbnail: The first frame as PNG bytes.
    """

    id: str
    model: str
    prompt: str
    size: str
    seconds: str
    status: Status = "queued"
    progress: int = 0
    created_at: int = field(default_factory=lambda: int(time.time()))
    completed_at: int | None = None
    error: dict[str, Any] | None = None
    report: dict[str, Any] | None = None
    path: Path | None = None
    thumbnail: bytes | None = None
    finished: float | None = None  # time.monotonic() when it finished: what the TTL counts from

    @property
    def done(self) -> bool:
        """Completed or failed."""
        return self.status in ("completed", "failed")


class VideoStore:
    """The video jobs of one server and their files.

    Args:
        directory: Where mp4 files go; ``None``: a private temporary directory, removed by :meth:`close`.
        ttl_s: Seconds a finished job (and its file) is kept.
        max_videos: Most jobs kept; beyond it the oldest finished ones go first, and a new job is refused (429)
            when every kept job is still queued or running.
    """

    def __init__(self, directory: Path | None = None, *, ttl_s: float = 3600.0, max_videos: int = 100) -> None:
        self._own = directory is None
        self.directory = Path(tempfile.mkdtemp(prefix="fastdit-videos-")) if directory is None else Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.ttl_s, self.max_videos = ttl_s, max_videos
        self._records: dict[str, VideoRecord] = {}  # insertion order = creation order
        self._lock = threading.Lock()  # records are finished from worker threads (encoding runs off the loop)

    def create(self, model: str, prompt: str, size: str, seconds: str) -> VideoRecord:
        """A new queued job.

        Raises:
            RequestError: 429 when :attr:`max_videos` jobs are kept and none of them is finished.
        """
        with self._lock:
            self._evict()
            finished = [r for r in self._records.values() if r.done]
            while len(self._records) >= self.max_videos and finished:
                self._drop(finished.pop(0))  # the oldest finished job makes room
            if len(self._records) >= self.max_videos:
                raise RequestError(
                    429,
                    f"{self.max_videos} video jobs are queued or running; retry later",
                    type="rate_limit_error",
                    code="too_many_videos",
                    headers={"Retry-After": "10"},
                )
            record = VideoRecord(f"video_{secrets.token_hex(16)}", model, prompt, size, seconds)
            self._records[record.id] = record
            return record

    def get(self, video_id: str) -> VideoRecord:
        """The job ``video_id``.

        Raises:
            RequestError: 404 if there is none (never was, deleted, or expired).
        """
        with self._lock:
            self._evict()
            record = self._records.get(video_id)
        if record is None:
            raise RequestError(404, f"no video {video_id!r} (unknown, deleted or expired)", param="video_id")
        return record

    def page(self, after: str | None, limit: int, order: str) -> tuple[list[VideoRecord], bool]:
        """Up to ``limit`` jobs after the one ``after``, oldest first (``asc``) or newest first; and whether more."""
        with self._lock:
            self._evict()
            records = list(self._records.values())
        if order == "desc":
            records.reverse()
        if after is not None:
            ids = [r.id for r in records]
            if after not in ids:
                raise RequestError(404, f"after: no video {after!r}", param="after")
            records = records[ids.index(after) + 1 :]
        return records[:limit], len(records) > limit

    def start(self, record: VideoRecord) -> None:
        """Mark ``record`` running."""
        record.status = "in_progress"

    def complete(self, record: VideoRecord, frames: np.ndarray, fps: float, report: dict[str, Any]) -> None:
        """Write ``frames`` as ``record``'s mp4 (atomically), then mark it completed.

        Raises:
            ImportError: imageio or imageio-ffmpeg is missing (named).
        """
        from fastdit.io import image_bytes, save_video

        path = save_video(self.directory / f"{record.id}.mp4", frames, fps=fps)
        thumbnail = image_bytes(frames[0])
        with self._lock:
            if record.id not in self._records:  # deleted meanwhile: drop the file
                path.unlink(missing_ok=True)
                return
            record.path, record.thumbnail, record.report = path, thumbnail, report
            self._finish(record, "completed")

    def fail(self, record: VideoRecord, error: RequestError) -> None:
        """Mark ``record`` failed with ``error``'s code and message."""
        with self._lock:
            record.error = {"code": error.code or error.type, "message": error.message, "param": error.param}
            self._finish(record, "failed")

    def _finish(self, record: VideoRecord, status: Status) -> None:
        record.status, record.completed_at, record.finished = status, int(time.time()), time.monotonic()
        if status == "completed":
            record.progress = 100

    def expires_at(self, record: VideoRecord) -> int | None:
        """Unix time a finished job will be dropped."""
        return None if record.completed_at is None else int(record.completed_at + self.ttl_s)

    def delete(self, video_id: str) -> None:
        """Drop a finished job and its file.

        Raises:
            RequestError: 404 unknown; 409 still queued or running (a running job cannot be stopped on every rank).
        """
        record = self.get(video_id)
        if not record.done:
            raise RequestError(
                409, f"video {video_id!r} is {record.status}; only a finished video can be deleted", param="video_id"
            )
        with self._lock:
            self._drop(record)

    def _drop(self, record: VideoRecord) -> None:
        self._records.pop(record.id, None)
        if record.path is not None:
            record.path.unlink(missing_ok=True)

    def _evict(self) -> None:
        now = time.monotonic()
        for record in [r for r in self._records.values() if r.finished is not None and now - r.finished > self.ttl_s]:
            self._drop(record)

    def __len__(self) -> int:
        return len(self._records)

    def close(self) -> None:
        """Remove the files (and the directory, when the store made it)."""
        with self._lock:
            for record in list(self._records.values()):
                self._drop(record)
        if self._own:
            with contextlib.suppress(OSError):
                shutil.rmtree(self.directory)
