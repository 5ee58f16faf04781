"""What one request may ask for and how much work may wait: :class:`Limits`, whose fields are also the server's flags.

A limit protects the server from a request that would run for hours or allocate more than the device holds, and
from a backlog that would answer every client late instead of some clients at once with 429.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["Limits", "limit_fields"]


def _doc(text: str, default: Any) -> Any:
    return field(default=default, metadata={"doc": text})


@dataclass(frozen=True, kw_only=True)
class Limits:
    """Request and queue limits of a server (each field is a ``fastdit serve`` flag: ``max_n`` is ``--max-n``)."""

    max_n: int = _doc("Most images one request may ask for (n).", 4)
    max_steps: int = _doc("Most denoising steps one request may ask for (num_inference_steps).", 100)
    max_side: int = _doc("Largest width or height in pixels a request may ask for.", 2048)
    max_prompt_chars: int = _doc("Longest prompt (and negative prompt) in characters.", 4000)
    queue_size: int = _doc("Requests that may wait for the pipeline; one more is answered 429.", 16)
    timeout_s: float = _doc("Seconds a request may wait and run before it is answered 504.", 300.0)
    max_frames: int = _doc("Most video frames one request may ask for (num_frames, or seconds times fps).", 257)
    max_images: int = _doc("Most input images one edit request may upload.", 4)
    max_upload_mb: float = _doc("Largest uploaded image file in megabytes.", 20.0)
    max_batch: int = _doc(
        "Most images of compatible queued requests (same size, steps, guidance, negative prompt) run as one "
        "pipeline call; only requests without a step cache are batched; 1: none.",
        1,
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            allow_zero = f.name == "queue_size"  # 0: only the request being run, nothing waits
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{f.name}={value!r}: must be a finite number")
            if value < 0 or (value == 0 and not allow_zero):
                raise ValueError(f"{f.name}={value!r}: must be {'non-negative' if allow_zero else 'positive'}")


def limit_fields() -> list[tuple[str, type, Any, str]]:
    """``(name, type, default, doc)`` of each :class:`Limits` field, for deriving flags."""
    hints = {"int": int, "float": float}
    return [(f.name, hints[str(f.type)], f.default, f.metadata["doc"]) for f in fields(Limits)]
