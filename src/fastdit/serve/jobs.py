"""From a validated request body to a :class:`~fastdit.serve.worker.Job`: the checks that need the model.

Every refusal is a :class:`RequestError` naming the request field (``param``), raised before the request is queued,
so a bad request never waits behind good ones and never reaches a worker rank.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from fastdit.cache.policy import check_run_length
from fastdit.cache.presets import CACHE_PRESETS, NO_CACHE
from fastdit.config import DBCache, DBPrune
from fastdit.errors import FieldError
from fastdit.serve.limits import Limits
from fastdit.serve.schemas import EditRequest, ImageRequest, VideoRequest
from fastdit.serve.worker import DEFAULT_CACHE, Job
from fastdit.session import (
    MAX_SEED,
    Case,
    Session,
    call_arguments,
    call_parameters,
    default_steps,
    frame_multiple,
    size_multiple,
)

__all__ = [
    "MULTI_IMAGE_PIPELINES",
    "ModelSpec",
    "RequestError",
    "batchable",
    "build_edit_job",
    "build_job",
    "build_video_job",
    "check_edit_model",
    "compatible",
    "merge",
    "request_field",
    "warmup_jobs",
]

MULTI_IMAGE_PIPELINES = frozenset(
    {"Flux2Pipeline", "Flux2KleinPipeline", "QwenImageEditPlusPipeline", "QwenImageEditPlusPipelineV2"}
)
"""Edit pipelines that take several reference images as a list (others read a list as a batch of one image each)."""


class RequestError(Exception):
    """A request answered with an error status: OpenAI's error object, ``param`` naming the field at fault.

    Attributes:
        status: The HTTP status.
        message: What was wrong (no paths, no tracebacks).
        param: The request field, if one is at fault.
        type: OpenAI's error type (``invalid_request_error``, ...).
        code: A short machine-readable code.
        headers: Extra response headers (``Retry-After``).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.code = code
        self.headers = dict(headers or {})


def invalid(param: str, requirement: str) -> RequestError:
    """A 422 about ``param``."""
    return RequestError(422, f"{param}: {requirement}", param=param, code="invalid_value")


@dataclass(frozen=True)
class ModelSpec:
    """What the server knows about its model without touching the pipeline.

    Attributes:
        name: The model id clients pass (``model``) and ``/v1/models`` lists.
        pipeline_class: The pipeline's class (its ``__call__`` parameters).
        defaults: The preset's call arguments.
        unit: Width and height must be multiples of this (:func:`fastdit.session.size_multiple`).
        default_cache: The server's cache config (its step mask bounds the steps a request may run).
        video: Whether the pipeline makes videos (the image endpoints refuse them, the video endpoint wants them).
        frame_unit: Video pipelines: ``num_frames - 1`` must be a multiple of this (:func:`frame_multiple`).
    """

    name: str
    pipeline_class: type
    defaults: Mapping[str, Any] = field(default_factory=dict)
    unit: int = 1
    default_cache: DBCache | DBPrune | None = None
    video: bool = False
    frame_unit: int = 1

    @property
    def takes(self) -> frozenset[str]:
        """The pipeline's call parameters."""
        return frozenset(call_parameters(self.pipeline_class))

    def describe(self) -> str:
        """``'name' (PipelineClass)``, for messages."""
        return f"{self.name!r} ({self.pipeline_class.__name__})"

    @classmethod
    def of(
        cls, session: Session, default_cache: DBCache | DBPrune | None = None, *, name: str | None = None
    ) -> ModelSpec:
        """The spec of a loaded session, named ``name`` (default: its model name; a directory's own name, since
        clients should not see the server's paths)."""
        from fastdit.session import is_video_pipeline

        source = session.source
        if name is None:
            name = source.path.name if source.path is not None and source.name == str(source.path) else source.name
        return cls(
            name=name,
            pipeline_class=session.pipeline_class,
            defaults=dict(session.source.defaults),
            unit=size_multiple(session.pipe),
            default_cache=default_cache,
            video=is_video_pipeline(session.pipeline_class),
            frame_unit=frame_multiple(session.pipe) or 1,
        )


# Pipeline parameters and config owners -> the request field that set them.
_CALL_FIELDS = {"height": "size", "width": "size", "generator": "seed"}
_CONFIG_FIELDS = {"DBCache": "cache", "DBPrune": "cache", "TaylorSeer": "cache", "StepMask": "num_inference_steps"}


def request_field(error: FieldError) -> str | None:
    """The request field a :class:`FieldError` from the library is about (``None``: none the client sent)."""
    if error.owner in ("call", "request"):
        return _CALL_FIELDS.get(error.field, error.field)
    return _CONFIG_FIELDS.get(error.owner)


def _check_text(request: Any, limits: Limits) -> None:
    for name in ("prompt", "negative_prompt"):
        text = getattr(request, name)
        if text is not None and len(text) > limits.max_prompt_chars:
            raise invalid(name, f"must be at most {limits.max_prompt_chars} characters, got {len(text)}")


def _size(request: Any, spec: ModelSpec, limits: Limits) -> dict[str, int]:
    dimensions = request.dimensions()
    if dimensions is None:
        return {}
    width, height = dimensions
    for value in dimensions:
        if value > limits.max_side:
            raise invalid("size", f"{request.size}: width and height must be at most {limits.max_side}")
        if value % spec.unit:
            raise invalid("size", f"{request.size}: width and height must be multiples of {spec.unit} for this model")
    return {"width": width, "height": height}


def _overrides(request: Any, spec: ModelSpec, limits: Limits) -> dict[str, Any]:
    if request.n > limits.max_n:
        raise invalid("n", f"must be at most {limits.max_n}, got {request.n}")
    steps = request.num_inference_steps
    if steps is not None and steps > limits.max_steps:
        raise invalid("num_inference_steps", f"must be at most {limits.max_steps}, got {steps}")
    _check_text(request, limits)
    overrides: dict[str, Any] = _size(request, spec, limits)
    for name in ("num_inference_steps", "guidance_scale", "negative_prompt"):
        value = getattr(request, name)
        if value is not None:
            overrides[name] = value
    return overrides


def _cache_key(request: Any, spec: ModelSpec, steps: int | None) -> str:
    key = DEFAULT_CACHE if request.cache is None else request.cache.strip().lower()
    if key != DEFAULT_CACHE and key not in CACHE_PRESETS:
        raise invalid("cache", f"{request.cache!r} is not a cache preset; known: {', '.join(CACHE_PRESETS)}")
    cache = spec.default_cache if key == DEFAULT_CACHE else None
    if isinstance(cache, DBCache) and steps is not None:
        try:
            check_run_length(cache.step_mask, steps)
        except FieldError as error:
            raise invalid("num_inference_steps", error.requirement) from None
    return NO_CACHE if key == NO_CACHE else key


def _seeds(request: Any) -> list[int]:
    # Without a seed each request draws its own, reported back so that an image can be made again.
    first = request.seed if request.seed is not None else secrets.randbelow(2**31)
    if first + request.n - 1 > MAX_SEED:
        raise invalid("seed", f"seed + n - 1 must be at most {MAX_SEED}")
    return [first + index for index in range(request.n)]


def _check_model(request: Any, spec: ModelSpec, *, video: bool) -> None:
    if request.model not in (None, "", spec.name):
        raise RequestError(
            404,
            f"model {request.model!r} is not served here; this server runs {spec.name!r}",
            param="model",
            code="model_not_found",
        )
    if spec.video and not video:
        raise RequestError(
            400,
            f"model {spec.describe()} makes videos; the image endpoints cannot serve it: use POST /v1/videos",
            param="model",
            code="unsupported_model",
        )
    if video and not spec.video:
        raise RequestError(
            400,
            f"model {spec.describe()} makes images; POST /v1/videos needs a video pipeline",
            param="model",
            code="unsupported_model",
        )


def _job(request: Any, spec: ModelSpec, limits: Limits, job_id: str, extra: dict[str, Any]) -> Job:
    """The checks every endpoint shares, then the job: ``extra`` are call arguments the endpoint adds."""
    overrides = {**_overrides(request, spec, limits), **extra}
    try:
        kwargs = call_arguments(spec.pipeline_class, spec.defaults, overrides)
    except FieldError as error:
        param = request_field(error) or error.field
        raise invalid(param, error.requirement) from None
    steps = default_steps(spec.pipeline_class, kwargs)
    if steps is not None and steps > limits.max_steps:
        raise invalid("num_inference_steps", f"the model's default of {steps} exceeds the server's limit")
    cache = _cache_key(request, spec, steps)
    cases = tuple(Case(request.prompt, seed) for seed in _seeds(request))
    return Job(id=job_id, cases=cases, kwargs=kwargs, cache=cache)


def build_job(request: ImageRequest, spec: ModelSpec, limits: Limits, job_id: str) -> Job:
    """Check ``request`` against the model and the limits and turn it into a job.

    Raises:
        RequestError: 404 for another model than the one served; 400 for a video model; 422 naming the field for
            any bad value.
    """
    _check_model(request, spec, video=False)
    job = _job(request, spec, limits, job_id, {})
    return replace(job, batch=limits.max_batch) if batchable(job, spec) else job


def check_edit_model(request: Any, spec: ModelSpec) -> None:
    """Refuse an edit for a model that cannot make one (before reading its files).

    Raises:
        RequestError: 404 another model; 400 naming the model: a video pipeline, or one that takes no image.
    """
    _check_model(request, spec, video=False)
    if "image" not in spec.takes:
        raise RequestError(
            400,
            f"model {spec.describe()} takes no input image; POST /v1/images/edits needs an edit or image-to-image "
            "pipeline (e.g. flux-kontext)",
            param="image",
            code="unsupported_model",
        )


def build_edit_job(
    request: EditRequest, images: list[Any], mask: Any, spec: ModelSpec, limits: Limits, job_id: str
) -> Job:
    """An edit or image-to-image job: ``images`` (PIL, checked by :mod:`fastdit.serve.inputs`) go to the pipeline's
    ``image``, ``mask`` to its ``mask_image``. Never batched: each job carries its own input images.

    Raises:
        RequestError: 400 naming the model when its pipeline takes no image (or no mask, or several images);
            otherwise as :func:`build_job`.
    """
    check_edit_model(request, spec)
    takes = spec.takes
    if len(images) > 1 and spec.pipeline_class.__name__ not in MULTI_IMAGE_PIPELINES:
        raise invalid("image", f"model {spec.describe()} takes one input image, got {len(images)}")
    extra: dict[str, Any] = {"image": images if len(images) > 1 else images[0]}
    if mask is not None:
        if "mask_image" not in takes:
            raise invalid("mask", f"model {spec.describe()} takes no mask (it is not an inpainting pipeline)")
        extra["mask_image"] = mask
    if request.strength is not None:
        if "strength" not in takes:
            raise invalid("strength", f"model {spec.describe()} takes no strength (not an image-to-image pipeline)")
        extra["strength"] = request.strength
    return _job(request, spec, limits, job_id, extra)


def _frames(request: VideoRequest, spec: ModelSpec, limits: Limits) -> dict[str, int]:
    """``num_frames`` from the request (``num_frames``, else ``seconds`` at ``fps``), checked; empty: the model's."""
    if request.num_frames is not None:
        frames, param = request.num_frames, "num_frames"
    elif request.seconds is not None:
        # One frame more than seconds * fps, rounded down to what the VAE keeps (a causal VAE: 1 + k * unit).
        raw = round(request.seconds * request.fps)
        frames, param = max(raw // spec.frame_unit, 1) * spec.frame_unit + 1, "seconds"
    else:
        return {}
    if frames > limits.max_frames:
        raise invalid(param, f"{frames} frames; at most {limits.max_frames}")
    if (frames - 1) % spec.frame_unit:
        raise invalid(param, f"{frames} frames: must be one more than a multiple of {spec.frame_unit} for this model")
    return {"num_frames": frames}


def build_video_job(request: VideoRequest, image: Any, spec: ModelSpec, limits: Limits, job_id: str) -> Job:
    """A video job: one video; ``image`` (``input_reference``) goes to image-to-video pipelines.

    Raises:
        RequestError: 400 for an image model; 422 naming the field (``input_reference`` for a text-to-video
            pipeline, ``num_frames``/``seconds``, ``size``: even for mp4) otherwise as :func:`build_job`.
    """
    _check_model(request, spec, video=True)
    dimensions = request.dimensions()
    if dimensions is not None and any(value % 2 for value in dimensions):
        raise invalid("size", f"{request.size}: mp4 needs an even width and height")
    extra: dict[str, Any] = _frames(request, spec, limits)
    if image is not None:
        if "image" not in spec.takes:
            raise invalid("input_reference", f"model {spec.describe()} is text-to-video; it takes no input image")
        extra["image"] = image
    elif "image" in spec.takes and not _optional(spec.pipeline_class, "image"):
        raise invalid("input_reference", f"model {spec.describe()} is image-to-video: upload input_reference")
    return _job(request, spec, limits, job_id, extra)


def _optional(pipeline_class: type, name: str) -> bool:
    parameter = call_parameters(pipeline_class)[name]
    return parameter.default is not parameter.empty


def warmup_jobs(spec: ModelSpec, limits: Limits, sizes: list[tuple[int, int]], repeats: int) -> list[Job]:
    """The jobs a server runs before it reports healthy: ``repeats`` at the default size, then one per size.

    With batching (:attr:`Limits.max_batch` above 1) and no server cache, each size also runs once per batch size
    a batched call can have (2 to ``max_batch`` images), since compiled code and CUDA graphs are per shape.
    """
    video = {"num_frames": spec.defaults["num_frames"]} if spec.video and "num_frames" in spec.defaults else {}
    base = call_arguments(spec.pipeline_class, spec.defaults, video)
    jobs = [Job(f"warmup-{i}", (Case("warm-up", 0),), base, DEFAULT_CACHE) for i in range(repeats)]
    batch_sizes = [1]
    if limits.max_batch > 1 and spec.default_cache is None and not spec.video:
        batch_sizes = list(range(1, limits.max_batch + 1))
    for width, height in sizes:
        kwargs = call_arguments(spec.pipeline_class, spec.defaults, {**video, "width": width, "height": height})
        for size in batch_sizes:
            cases = tuple(Case("warm-up", seed) for seed in range(size))
            jobs.append(Job(f"warmup-{width}x{height}-b{size}", cases, kwargs, DEFAULT_CACHE, batch=size))
    return jobs


def batchable(job: Job, spec: ModelSpec) -> bool:
    """Whether ``job``'s images may share pipeline calls with each other and with other jobs.

    Only without a step cache: a cache decides to compute or skip a step for every image of a call at once, so an
    image made in a batch could differ from the same image made alone. Without one, each image depends on its own
    prompt and seed only (up to the order of float sums).
    """
    return job.cache == NO_CACHE or (job.cache == DEFAULT_CACHE and spec.default_cache is None)


def compatible(first: Job, other: Job) -> bool:
    """Whether ``other`` can join ``first``'s pipeline call: the same call arguments (size, steps, guidance,
    negative prompt) and cache, both batchable (:attr:`Job.batch` above 1)."""
    return first.batch > 1 and other.batch > 1 and first.cache == other.cache and first.kwargs == other.kwargs


def merge(jobs: list[Job]) -> Job:
    """One job running the cases of ``jobs`` in order (results are split back by each job's case count)."""
    if len(jobs) == 1:
        return jobs[0]
    cases = tuple(case for job in jobs for case in job.cases)
    return replace(jobs[0], id="+".join(job.id for job in jobs), cases=cases)
