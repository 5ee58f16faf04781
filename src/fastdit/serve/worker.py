"""Running requests on the pipeline: one :class:`Job` at a time, on every rank of the job alike.

Under ``torchrun`` every rank holds a part of the accelerated pipeline and all of them must call it together. Rank 0
serves HTTP; its :class:`Driver` broadcasts each job (``torch.distributed.broadcast_object_list`` over the default
group) before running it, and every other rank waits in :func:`worker_loop` for the next message. Three messages:

- ``run``: a :class:`Job`; every rank runs it in lockstep, only rank 0 keeps the outputs;
- ``ping``: sent by an idle server at a fraction of the group timeout, answered by an all-reduce: it keeps idle
  workers from timing out in their wait, and finds a rank that died or hangs within one timeout;
- ``lora``: a :class:`~fastdit.serve.lora.LoraOp`; every rank loads or deletes the adapter, then all of them agree
  (an all-reduce of a failure flag) so that an adapter is in effect on every rank or on none;
- ``stop``: the server is shutting down; the workers return.

A collective that lost a rank raises :class:`~fastdit.parallel.failures.CollectiveError` on the ranks still
running (the group's timeout bounds every wait), and the server exits with an error instead of hanging.

Each job starts from a clean cache (:func:`fastdit.reset`), and its step count is its own: the cache's run tracking
starts a new run when the scheduler sets the job's timesteps, so a job never reuses another's schedule.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import fastdit
from fastdit.cache.presets import NO_CACHE, cache_config
from fastdit.config import DBCache, DBPrune
from fastdit.errors import FieldError, NonFiniteOutputError
from fastdit.serve.lora import LoraError, LoraOp, LoraSet
from fastdit.session import Case, Session, call_parameters

__all__ = [
    "DEFAULT_CACHE",
    "Driver",
    "Job",
    "JobResult",
    "JobTimeoutError",
    "Progress",
    "Runner",
    "cache_counts",
    "worker_loop",
]

logger = logging.getLogger("fastdit.serve")

DEFAULT_CACHE = "default"
"""The :attr:`Job.cache` key of the cache the server was started with (``--cache`` and its field flags)."""

_RUN, _PING, _STOP, _LORA = "run", "ping", "stop", "lora"


class JobTimeoutError(Exception):
    """A job stopped between two steps because its request timed out (single process only)."""


Progress = Callable[[int, int], None]
"""Called on rank 0 after each denoising step with ``(steps done, steps in all)`` over the job's calls."""


@dataclass(frozen=True)
class Job:
    """One request, ready to run: plain values only, so that it pickles to every rank.

    Attributes:
        id: The request's id (for logs).
        cases: Prompt and seed of each image, in order.
        kwargs: Call arguments (:func:`fastdit.session.call_arguments`), without prompt and generator.
        cache: :data:`DEFAULT_CACHE`, :data:`~fastdit.cache.presets.NO_CACHE` or a preset name.
        batch: Most cases per pipeline call (1: one call per image, each deciding its own cache steps).
    """

    id: str
    cases: tuple[Case, ...]
    kwargs: Mapping[str, Any]
    cache: str = DEFAULT_CACHE
    batch: int = 1


@dataclass
class JobResult:
    """What running a :class:`Job` gave (on rank 0; the other ranks discard theirs).

    Attributes:
        outputs: One float32 ``(H, W, C)`` array in [0, 1] per case.
        run_s: Seconds in the pipeline (cache switches included).
        cache: :func:`cache_counts` summed over the job's calls.
        cache_name: The cache the job ran with: :data:`~fastdit.cache.presets.NO_CACHE`, a preset, or ``custom``.
        images_per_call: The most images one pipeline call of the job made.
    """

    outputs: list[np.ndarray]
    run_s: float
    cache: dict[str, int] = field(default_factory=dict)
    cache_name: str = NO_CACHE
    images_per_call: int = 1


def cache_counts(summary: fastdit.Summary | None) -> dict[str, int]:
    """Steps, cached steps and blocks of one call's :func:`fastdit.summary`, over transformers and CFG branches."""
    counts = {"steps": 0, "cached_steps": 0, "blocks_computed": 0, "blocks_total": 0}
    if summary is None:
        return counts
    for info in summary.transformers.values():
        stats = info.get("cache")
        if not stats:
            continue
        counts["steps"] += sum(branch.get("steps", 0) for branch in stats["branches"].values())
        counts["cached_steps"] += stats["num_cached_steps"]
        counts["blocks_computed"] += stats["blocks_computed"]
        counts["blocks_total"] += stats["blocks_total"]
    return counts


def _add(total: dict[str, int], counts: Mapping[str, int]) -> None:
    for key, value in counts.items():
        total[key] = total.get(key, 0) + value


class Runner:
    """Runs jobs on a loaded session, switching its cache when a job asks for another one.

    The session is accelerated with ``options`` at construction. A job whose cache differs from the installed one
    re-applies the acceleration with that cache (a pipeline holds one acceleration at a time): cheap for hooks,
    a recompilation under ``--compile``, so clients that stay on the server's cache pay nothing.

    Args:
        session: The loaded pipeline.
        options: ``fastdit.accelerate`` keyword arguments; ``options["cache"]`` is :data:`DEFAULT_CACHE`'s config.
        cache_name: What reports call the default cache (its preset name, or ``custom`` for field flags).
    """

    def __init__(self, session: Session, options: Mapping[str, Any], cache_name: str = NO_CACHE) -> None:
        self.session = session
        self.base = {k: v for k, v in options.items() if k != "cache"}
        self.default_cache: DBCache | DBPrune | None = options.get("cache")
        self.default_name = cache_name if self.default_cache is not None else NO_CACHE
        self._installed: str | None = None
        self.loras = LoraSet(session.pipe)
        self._install(DEFAULT_CACHE)

    @property
    def installed(self) -> str | None:
        """The cache key in effect (``None`` before the first install)."""
        return self._installed

    def cache_name(self, key: str) -> str:
        """The report name of a job's cache key."""
        return self.default_name if key == DEFAULT_CACHE else key

    def cache_of(self, key: str) -> DBCache | DBPrune | None:
        """The cache config of a key (:data:`DEFAULT_CACHE`, ``none`` or a preset name).

        Raises:
            FieldError: Owner ``"request"``, field ``"cache"``: not a preset name.
        """
        if key == DEFAULT_CACHE:
            return self.default_cache
        try:
            return cache_config(key)
        except LookupError as error:
            raise FieldError("request", "cache", key, str(error).strip("'\"")) from None

    def _install(self, key: str) -> None:
        if key == self._installed:
            return
        cache = self.cache_of(key)
        if self._installed is not None and cache == self.cache_of(self._installed):
            self._installed = key  # the same config under another name (the server's own preset asked by name)
            return
        options = {**self.base, **({"cache": cache} if cache is not None else {})}
        self.session.disable()
        self._installed = None
        try:
            if options:
                self.session.accelerate(**options)
        except (ValueError, NotImplementedError) as error:
            if key == DEFAULT_CACHE:
                raise
            self._install(DEFAULT_CACHE)  # leave the server as it was for the next request
            raise FieldError("request", "cache", key, f"cannot be applied to this model: {error}") from error
        self._installed = key

    def run(
        self, job: Job, should_stop: Callable[[], bool] | None = None, progress: Progress | None = None
    ) -> JobResult:
        """Run the cases of ``job``, :attr:`Job.batch` per pipeline call, each call from a clean cache.

        Args:
            job: What to run.
            should_stop: Checked after each denoising step (pipelines that take ``callback_on_step_end``); ``True``
                stops the job with :class:`JobTimeoutError`. Only for a single process: ranks that stop at different
                steps would leave the others waiting.
            progress: Told after each denoising step (pipelines that take ``callback_on_step_end``); it only
                observes, so every rank may run with or without one.

        Raises:
            FieldError: A cache the model cannot take, or call arguments it refuses.
            NonFiniteOutputError: An output holds NaN or infinite values.
            JobTimeoutError: ``should_stop`` said so.
        """
        start = time.perf_counter()
        self._install(job.cache)
        kwargs = dict(job.kwargs)
        chunks = [job.cases[i : i + job.batch] for i in range(0, len(job.cases), max(job.batch, 1))]
        if (should_stop or progress) and "callback_on_step_end" in call_parameters(self.session.pipeline_class):
            total = len(chunks) * int(kwargs.get("num_inference_steps") or 0)
            kwargs["callback_on_step_end"] = _StepCallback(should_stop, progress, total)
        outputs: list[np.ndarray] = []
        counts: dict[str, int] = {}
        for chunk in chunks:
            fastdit.reset(self.session.pipe)  # nothing of the last request carries over, even after a failed call
            outputs.extend(self.session.call_batch(chunk, kwargs))
            _add(counts, cache_counts(self.session.summary()))
        largest = max(len(chunk) for chunk in chunks)
        return JobResult(outputs, time.perf_counter() - start, counts, self.cache_name(job.cache), largest)

    def apply_lora(self, op: LoraOp) -> None:
        """Load or delete a LoRA adapter on the plain pipeline, then accelerate it again as it was.

        The acceleration is undone first: compiled blocks were traced through the old layers (a LoRA swaps linear
        layers for adapter layers, fusing changes weights that CUDA graphs captured), and hooks hold state of
        the old model. Re-applying it gives a fresh cache and recompiles.

        Raises:
            LoraError: The operation was refused or failed; the adapters are as they were before it.
        """
        key = self._installed or DEFAULT_CACHE
        self.session.disable()
        self._installed = None
        try:
            self.loras.apply(op)
        finally:
            self._install(key)

    def restore_loras(self, adapters: Any) -> None:
        """Put the adapters back to ``adapters`` (:meth:`LoraSet.snapshot`): another rank failed an operation."""
        key = self._installed or DEFAULT_CACHE
        self.session.disable()
        self._installed = None
        try:
            self.loras.restore(adapters)
        finally:
            self._install(key)


class _StepCallback:
    """``callback_on_step_end``: stops the job when its request timed out, and reports progress (rank 0)."""

    def __init__(self, should_stop: Callable[[], bool] | None, progress: Progress | None, total: int) -> None:
        self.should_stop, self.progress, self.total, self.done = should_stop, progress, total, 0

    def __call__(self, _pipe: Any, _step: int, _timestep: Any, callback_kwargs: dict[str, Any]) -> dict[str, Any]:
        if self.should_stop is not None and self.should_stop():
            raise JobTimeoutError
        self.done += 1
        if self.progress is not None:
            self.progress(self.done, max(self.total, self.done))
        return callback_kwargs


def _collectives() -> Any:
    import torch.distributed as dist

    return dist


class Driver:
    """Rank 0's side of the job: sends each message to every rank, then acts on it here.

    Args:
        runner: The session's runner on rank 0.
        world_size: Processes of the job (1: nothing is sent).
        timeout_s: The process group's timeout; :attr:`heartbeat_s` is a third of it.
    """

    def __init__(self, runner: Runner, world_size: int = 1, timeout_s: float = 300.0) -> None:
        self.runner = runner
        self.world_size = world_size
        self.timeout_s = timeout_s

    @property
    def heartbeat_s(self) -> float | None:
        """How long the server may stay idle before it pings the workers (``None``: one process, never)."""
        return None if self.world_size == 1 else max(self.timeout_s / 3, 0.1)

    def _send(self, kind: str, job: Job | None = None) -> None:
        if self.world_size == 1:
            return
        from fastdit.parallel.failures import collective_failures

        with collective_failures(self.timeout_s):
            _collectives().broadcast_object_list([(kind, job)], src=0, device=self._device())

    def _device(self) -> Any:
        device = self.runner.session.device
        return device if device.type == "cuda" else None

    def run(
        self, job: Job, should_stop: Callable[[], bool] | None = None, progress: Progress | None = None
    ) -> JobResult:
        """Run ``job`` on every rank; ``should_stop`` applies on a single process only (see :meth:`Runner.run`)."""
        self._send(_RUN, job)
        if self.world_size > 1:
            from fastdit.parallel.failures import collective_failures

            with collective_failures(self.timeout_s):
                return self.runner.run(job, progress=progress)
        return self.runner.run(job, should_stop, progress)

    def lora(self, op: LoraOp) -> list[dict[str, Any]]:
        """Apply ``op`` on every rank, in lockstep; return the adapters now loaded (:meth:`LoraSet.describe`).

        Raises:
            LoraError: It was refused or failed here or on another rank; every rank is as it was before.
        """
        self._send(_LORA, op)
        _apply_lora_everywhere(self.runner, op, self.world_size, self.timeout_s)
        return self.runner.loras.describe()

    def lora_refusal(self, fuse: bool = True) -> str | None:
        """Why this server cannot take a LoRA adapter (``None``: it can), fused into the weights or not (``fuse``).

        Tensor parallelism shards the linear layers a LoRA wraps (and with ``text_encoder`` the text encoders'),
        so a sharded layer would get a whole adapter: refused rather than computed wrong. Quantization would
        quantize an unfused adapter's own small layers too; a fused adapter is merged into the float weights
        before they are quantized — except under static FP8, whose activation scales were recorded without the
        adapter: merged weights change every later layer's inputs, which the scales would clip. Fused projections
        (``--fuse``) take merged adapters only, as quantization does.
        """
        parallel = self.runner.base.get("parallel")
        if parallel is not None and (parallel.tp > 1 or parallel.text_encoder):
            return "tensor parallelism (--parallel tp=N or text_encoder) shards the layers a LoRA adapts"
        quantize = self.runner.base.get("quantize")
        if getattr(quantize, "mode", None) == "fp8_static":
            return (
                "its layers are quantized with static FP8 scales recorded without this adapter (--quantize "
                "fp8_static): record scales with the adapter fused (fastdit calibrate --scales) or serve with "
                "--quantize fp8"
            )
        if quantize is not None and not fuse:
            return "its layers are quantized (--quantize): load the adapter with fuse: true (merged, then quantized)"
        if self.runner.base.get("fuse") is not None and not fuse:
            # An unmerged adapter wraps each projection in a layer of its own, which a fused group cannot take in.
            return "its projections are fused (--fuse): load the adapter with fuse: true (merged, then fused)"
        from fastdit.serve.lora import lora_support

        return lora_support(self.runner.session.pipe)

    def heartbeat(self) -> None:
        """Ping every rank and wait for all of them (raises CollectiveError when one is gone)."""
        if self.world_size == 1:
            return
        self._send(_PING)
        _answer_ping(self.runner, self.timeout_s)

    def stop(self) -> None:
        """Tell the workers to return from :func:`worker_loop`."""
        self._send(_STOP)


def _apply_lora_everywhere(runner: Runner, op: LoraOp, world_size: int, timeout_s: float) -> None:
    """Apply ``op`` here, then agree with the other ranks: if it failed on any rank, every rank undoes it.

    Every rank calls the all-reduce whatever happened locally, so the collective never depends on a rank's own
    outcome (a file one rank cannot read must not leave the others waiting).
    """
    before = runner.loras.snapshot()
    error: LoraError | None = None
    try:
        runner.apply_lora(op)
    except LoraError as caught:
        error = caught
    if world_size > 1:
        from fastdit.parallel.failures import collective_failures
        from fastdit.process import max_across_processes

        with collective_failures(timeout_s):
            failed = max_across_processes(1.0 if error is not None else 0.0, runner.session.device) > 0
        if failed and error is None:
            runner.restore_loras(before)
            error = LoraError(500, f"LoRA {op.name!r}: the operation failed on another rank; nothing changed")
    if error is not None:
        raise error


def _answer_ping(runner: Runner, timeout_s: float) -> None:
    from fastdit.parallel.failures import collective_failures
    from fastdit.process import max_across_processes

    with collective_failures(timeout_s):
        max_across_processes(0.0, runner.session.device)


# Errors a job raises alike on every rank (they depend on the job's values, not on the rank): a worker logs them
# and waits for the next job, as rank 0 answers the request with them. Anything else (a lost peer, out of memory)
# ends the worker, and with it the job.
_JOB_ERRORS: Sequence[type[BaseException]] = (FieldError, NonFiniteOutputError)


def worker_loop(runner: Runner, timeout_s: float) -> None:
    """Ranks other than 0: run every job rank 0 sends, until it sends ``stop``.

    Raises:
        CollectiveError: Rank 0 (or another rank) stopped answering within ``timeout_s``, or left.
    """
    from fastdit.parallel.failures import collective_failures

    device = runner.session.device if runner.session.device.type == "cuda" else None
    while True:
        message: list[Any] = [None]
        with collective_failures(timeout_s):
            _collectives().broadcast_object_list(message, src=0, device=device)
        kind, job = message[0]
        if kind == _STOP:
            return
        if kind == _PING:
            _answer_ping(runner, timeout_s)
            continue
        if kind == _LORA:
            try:
                _apply_lora_everywhere(runner, job, _collectives().get_world_size(), timeout_s)
            except LoraError as error:
                logger.info("LoRA operation on %s failed on this rank as on rank 0: %s", job.name, error)
            continue
        try:
            with collective_failures(timeout_s):
                runner.run(job)
        except _JOB_ERRORS as error:
            logger.info("job %s failed on this rank as on rank 0: %s", job.id, error)
