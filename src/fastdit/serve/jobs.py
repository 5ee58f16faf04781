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
from fastdit.serve.schemas import ImageRequest
from fastdit.serve.worker import DEFAULT_CACHE, Job
from fastdit.session import MAX_SEED, Case, Session, call_arguments, default_steps, size_multiple

__all__ = ["ModelSpec", "RequestError", "batchable", "build_job", "compatible", "merge", "request_field"]


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
        video: Whether the pipeline makes videos (the image endpoint refuses them).
    """

    name: str
    pipeline_class: type
    defaults: Mapping[str, Any] = field(default_factory=dict)
    unit: int = 1
    default_cache: DBCache | DBPrune | None = None
    video: bool = False

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
        )


# Pipeline parameters and config owners -> the request field that set them.
_CALL_FIELDS = {"height": "size", "width": "size", "generator": "seed"}
_CONFIG_FIELDS = {"DBCache": "cache", "DBPrune": "cache", "TaylorSeer": "cache", "StepMask": "num_inference_steps"}


def request_field(error: FieldError) -> str | None:
    """The request field a :class:`FieldError` from the library is about (``None``: none the client sent)."""
    if error.owner in ("call", "request"):
        return _CALL_FIELDS.get(error.field, error.field)
    return _CONFIG_FIELDS.get(error.owner)


def _check_text(request: ImageRequest, limits: Limits) -> None:
    for name in ("prompt", "negative_prompt"):
        text = getattr(request, name)
        if text is not None and len(text) > limits.max_prompt_chars:
            raise invalid(name, f"must be at most {limits.max_prompt_chars} characters, got {len(text)}")


def _size(request: ImageRequest, spec: ModelSpec, limits: Limits) -> dict[str, int]:
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


def _overrides(request: ImageRequest, spec: ModelSpec, limits: Limits) -> dict[str, Any]:
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


def _cache_key(request: ImageRequest, spec: ModelSpec, steps: int | None) -> str:
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


def _seeds(request: ImageRequest) -> list[int]:
    # Without a seed each request draws its own, reported back so that an image can be made again.
    first = request.seed if request.seed is not None else secrets.randbelow(2**31)
    if first + request.n - 1 > MAX_SEED:
        raise invalid("seed", f"seed + n - 1 must be at most {MAX_SEED}")
    return [first + index for index in range(request.n)]


def build_job(request: ImageRequest, spec: ModelSpec, limits: Limits, job_id: str) -> Job:
    """Check ``request`` against the model and the limits and turn it into a job.

    Raises:
        RequestError: 404 for another model than the one served; 422 naming the field for any bad value.
    """
    if request.model not in (None, "", spec.name):
        raise RequestError(
            404,
            f"model {request.model!r} is not served here; this server runs {spec.name!r}",
            param="model",
            code="model_not_found",
        )
    if spec.video:
        raise RequestError(400, "this server runs a video pipeline; the image endpoint cannot serve it", param="model")
    overrides = _overrides(request, spec, limits)
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
    job = Job(id=job_id, cases=cases, kwargs=kwargs, cache=cache)
    return replace(job, batch=limits.max_batch) if batchable(job, spec) else job


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
