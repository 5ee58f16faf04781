"""Request and response bodies of the image endpoints, as the ``openai`` client sends and reads them.

:class:`ImageRequest` takes OpenAI's fields (``model``, ``prompt``, ``n``, ``size``, ``response_format``) plus
fastdit's extensions, which the client passes through ``extra_body``: ``seed``, ``num_inference_steps``,
``guidance_scale``, ``negative_prompt`` and ``cache``. Fields the server cannot use are ignored (``quality``,
``style``, ``user``) so that an unchanged OpenAI client call works. The checks that need no model live here; the
ones that do (a size multiple of the model's unit, parameters the pipeline takes) live in :mod:`fastdit.serve.app`.
Responses add a ``fastdit`` object (timings, seeds and cache statistics) that OpenAI clients ignore.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from fastdit.serve import require

require("fastapi")  # pydantic comes with it; fail with the package's name rather than pydantic's

from pydantic import BaseModel, ConfigDict, Field, field_validator  # noqa: E402

from fastdit.session import MAX_SEED  # noqa: E402

__all__ = [
    "CacheReport",
    "EditRequest",
    "ErrorBody",
    "ErrorResponse",
    "ImageData",
    "ImageRequest",
    "ImageResponse",
    "LoraCard",
    "LoraList",
    "LoraRequest",
    "ModelCard",
    "ModelList",
    "RunReport",
    "Timings",
    "VideoError",
    "VideoList",
    "VideoObject",
    "VideoRequest",
    "parse_size",
]

_SIZE = re.compile(r"^\s*(\d{1,6})\s*[xX×]\s*(\d{1,6})\s*$")


def parse_size(text: str) -> tuple[int, int]:
    """``"WxH"`` as ``(width, height)``.

    Raises:
        ValueError: If ``text`` is not two positive integers joined by ``x``.
    """
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"must be WIDTHxHEIGHT in pixels (e.g. 1024x1024) or auto, got {text!r}")
    width, height = int(match.group(1)), int(match.group(2))
    if not width or not height:
        raise ValueError(f"width and height must be positive, got {text!r}")
    return width, height


class ImageRequest(BaseModel):
    """``POST /v1/images/generations``: OpenAI's body plus fastdit's extension fields."""

    model_config = ConfigDict(extra="ignore")

    prompt: str = Field(min_length=1)
    model: str | None = None
    n: int = Field(default=1, ge=1)
    size: str | None = Field(default=None, description="WIDTHxHEIGHT, or auto for the model's default")
    response_format: Literal["b64_json", "url"] = "b64_json"
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED, description="seed of the first image; n images: +1 each")
    num_inference_steps: int | None = Field(default=None, ge=1)
    guidance_scale: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    negative_prompt: str | None = None
    cache: str | None = Field(default=None, description="a cache preset name or none; default: the server's")

    @field_validator("size")
    @classmethod
    def _size(cls, value: str | None) -> str | None:
        if value is not None and value.strip().lower() != "auto":
            parse_size(value)
        return value

    def dimensions(self) -> tuple[int, int] | None:
        """``(width, height)`` asked for, or ``None`` for the model's default."""
        if self.size is None or self.size.strip().lower() == "auto":
            return None
        return parse_size(self.size)


class EditRequest(ImageRequest):
    """``POST /v1/images/edits`` (multipart form): the generation fields plus ``strength`` for image-to-image
    pipelines; the image files travel as form files (``image``, or ``image[]`` for several, and ``mask``)."""

    strength: float | None = Field(default=None, gt=0, le=1, description="how far from the input image (img2img)")


class VideoRequest(BaseModel):
    """``POST /v1/videos`` (multipart form, as the ``openai`` client sends it, or JSON): OpenAI's fields plus
    fastdit's extensions; ``input_reference`` (an image file) goes to image-to-video pipelines."""

    model_config = ConfigDict(extra="ignore")

    prompt: str = Field(min_length=1)
    model: str | None = None
    size: str | None = Field(default=None, description="WIDTHxHEIGHT; default: the model's")
    seconds: float | None = Field(default=None, gt=0, allow_inf_nan=False, description="length; frames = seconds*fps")
    num_frames: int | None = Field(default=None, ge=1, description="frames (wins over seconds)")
    fps: float = Field(default=16.0, gt=0, le=120, allow_inf_nan=False, description="frame rate of the mp4")
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    num_inference_steps: int | None = Field(default=None, ge=1)
    guidance_scale: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    negative_prompt: str | None = None
    cache: str | None = None

    n: Literal[1] = 1  # one video per job; a field so that the image checks apply unchanged

    @field_validator("size")
    @classmethod
    def _size(cls, value: str | None) -> str | None:
        if value is not None and value.strip().lower() != "auto":
            parse_size(value)
        return value

    def dimensions(self) -> tuple[int, int] | None:
        """``(width, height)`` asked for, or ``None`` for the model's default."""
        if self.size is None or self.size.strip().lower() == "auto":
            return None
        return parse_size(self.size)


class VideoError(BaseModel):
    """Why a video job failed: OpenAI's ``code`` and ``message`` (never a traceback or a path)."""

    code: str
    message: str
    param: str | None = None


class VideoObject(BaseModel):
    """A video job as ``GET /v1/videos/{id}`` shows it (OpenAI's ``Video``), plus fastdit's report when done."""

    id: str
    object: Literal["video"] = "video"
    model: str
    status: Literal["queued", "in_progress", "completed", "failed"]
    progress: int = 0
    created_at: int
    completed_at: int | None = None
    expires_at: int | None = None
    prompt: str | None = None
    seconds: str
    size: str
    error: VideoError | None = None
    fastdit: dict[str, Any] | None = None


class VideoList(BaseModel):
    """``GET /v1/videos``: a cursor page (``after`` = the last id of the previous page)."""

    object: Literal["list"] = "list"
    data: list[VideoObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class LoraRequest(BaseModel):
    """``POST /v1/loras``: load the LoRA at ``path`` (under the server's ``--lora-dir``) as adapter ``name``."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$", description="letters, digits, _ and -")

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        import torch

        # peft keeps adapters in ModuleDicts under their names: a name of a Module attribute cannot be one.
        if hasattr(torch.nn.Module, value):
            raise ValueError(f"{value!r} is reserved (a torch.nn.Module attribute); choose another name")
        return value

    path: str = Field(min_length=1, max_length=1000, description="a file or directory, relative to --lora-dir")
    scale: float = Field(default=1.0, ge=-10, le=10, allow_inf_nan=False)
    fuse: bool = False


class LoraCard(BaseModel):
    """One loaded adapter."""

    name: str
    path: str
    scale: float
    fused: bool
    components: list[str]


class LoraList(BaseModel):
    """``GET /v1/loras``."""

    object: Literal["list"] = "list"
    data: list[LoraCard]


class Timings(BaseModel):
    """Seconds spent on a request: waiting in the queue, in the pipeline, encoding, and in all."""

    queue_s: float
    run_s: float
    encode_s: float
    total_s: float


class CacheReport(BaseModel):
    """What the step cache did for a request's images (summed over them).

    Attributes:
        preset: The cache preset the images ran with (``none``: no cache; ``custom``: the server's flags).
        steps: Transformer steps over the images and their CFG branches.
        cached_steps: Steps the cache skipped.
        computed_steps: Steps computed.
        hit_ratio: ``cached_steps / steps`` (0 without a cache).
        blocks_computed_fraction: Transformer blocks computed over those a run without cache computes.
    """

    preset: str
    steps: int = 0
    cached_steps: int = 0
    computed_steps: int = 0
    hit_ratio: float = 0.0
    blocks_computed_fraction: float = 1.0


class RunReport(BaseModel):
    """fastdit's extension of an image response."""

    model: str
    seeds: list[int]
    width: int | None
    height: int | None
    num_inference_steps: int | None
    batched_with: int = Field(default=1, description="images in the pipeline call that made these")
    timings: Timings
    cache: CacheReport


class ImageData(BaseModel):
    """One image: base64 PNG, or the same as a ``data:`` URL for ``response_format="url"``."""

    b64_json: str | None = None
    url: str | None = None
    revised_prompt: str | None = None


class ImageResponse(BaseModel):
    """OpenAI's image response plus :class:`RunReport` under ``fastdit``."""

    created: int
    data: list[ImageData]
    fastdit: RunReport


class ModelCard(BaseModel):
    """One entry of ``GET /v1/models``."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "fastdit"


class ModelList(BaseModel):
    """``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    """OpenAI's error object: ``param`` names the request field at fault."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error body: ``{"error": {...}}``."""

    error: ErrorBody

    @classmethod
    def of(cls, message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
        """The JSON-ready body."""
        return cls(error=ErrorBody(message=message, type=type_, param=param, code=code)).model_dump()
