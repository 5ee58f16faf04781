"""The model-integration ladder: each technique on one pipeline against its own un-accelerated output.

The baseline runs first with no acceleration (every rank computes the same one). Then each rung of :data:`LADDER` is
applied with :func:`fastdit.accelerate`, run on the same cases, removed with :func:`fastdit.disable`, and judged by
PSNR and SSIM against the baseline::

    pipe, tiny = build_tiny("flux")
    report = verify_ladder(pipe, tiny.call_kwargs, ["cache"])
    assert report.passed, report.table()

A rung's layout is built from the number of processes and the model's adapter. A rung whose layout needs more
processes is ``skipped``; one that :func:`fastdit.accelerate` refuses before touching anything (no plan, a degree
that does not divide the heads, a family without CFG) is ``not available`` with the reason; any other error is a
failed row and the next rungs still run, unless a collective lost a rank (the process group is then broken and the
rest are ``not run``). Under several processes every rung runs on all of them (the caller starts them: ``torchrun``,
or a test's worker pool).

Thresholds (:class:`Thresholds`): a cache approximates, so PSNR > 30 dB; parallelism only reorders float sums, so
PSNR > 35 dB; both need SSIM > 0.90. PSNR alone averages the error over the pixels and can look fine on an image
whose structure is wrong (shuffled tokens, swapped patches), so a row with PSNR > 30 dB but SSIM < 0.5 is ``garbled``.
Rows are judged on their worst output (the minimum over cases), because one bad output is what a mean hides.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from fastdit.bench.compare import compare_outputs
from fastdit.bench.plain import plain_options
from fastdit.bench.report import markdown_table
from fastdit.bench.timing import RunResult, run
from fastdit.config import Fuse, Parallel
from fastdit.diagnostics.target import TargetError, call_function
from fastdit.errors import ArgumentError, ShardError, UnavailableError
from fastdit.metrics.audio import AUDIO_RANGE
from fastdit.models.base import ModelAdapter
from fastdit.parallel.cfg_parallel import CfgParallelError
from fastdit.parallel.failures import CollectiveError, collective_failures
from fastdit.session import AUDIO, Case, ModelSource, Session, default_steps

__all__ = [
    "BASELINE",
    "CACHE",
    "LADDER",
    "PARALLEL",
    "TINY_PREFIX",
    "LadderContext",
    "LadderError",
    "PipelineFunction",
    "Rung",
    "Skip",
    "Status",
    "TargetError",
    "Thresholds",
    "VerifyReport",
    "VerifyRow",
    "VerifyRuntime",
    "VerifyTarget",
    "fixed_rung",
    "ladder_names",
    "load_target",
    "resolve_target",
    "save_grid",
    "select_rungs",
    "verify_ladder",
]

BASELINE = "baseline"
CACHE = "cache"
"""Threshold kind of rungs that approximate (step caches)."""
PARALLEL = "parallel"
"""Threshold kind of rungs that should be exact up to the order of float sums."""


class Status:
    """The outcome of one row (plain strings in reports and JSON)."""

    PASS = "pass"
    FAIL = "fail"
    GARBLED = "garbled"
    ERROR = "error"
    NOT_AVAILABLE = "not available"
    SKIPPED = "skipped"
    NOT_RUN = "not run"
    BASELINE = "baseline"

    FAILED: tuple[str, ...] = (FAIL, GARBLED, ERROR)
    """Outcomes that make a ladder fail."""


class LadderError(ValueError):
    """A ladder selection names no rung (the message lists the known names)."""


@dataclass(frozen=True)
class Thresholds:
    """What a row must reach against the baseline (strictly above each minimum).

    Attributes:
        cache_psnr: Minimum PSNR (dB) of cache rows.
        parallel_psnr: Minimum PSNR (dB) of parallel rows.
        ssim: Minimum SSIM of every row.
        garbled_psnr: Above this PSNR ...
        garbled_ssim: ... and below this SSIM a row is ``garbled``: the pixels are close on average, the structure
            is not.
        max_abs: When set, a parallel row also fails when any output value differs from its reference by this
            much or more. Float32 runs on one machine are exact up to the order of float sums, which a PSNR
            minimum hides: the family test matrices use ``1e-4`` on [0, 1] outputs (> 80 dB).
    """

    cache_psnr: float = 30.0
    parallel_psnr: float = 35.0
    ssim: float = 0.90
    garbled_psnr: float = 30.0
    garbled_ssim: float = 0.5
    max_abs: float | None = None

    def __post_init__(self) -> None:
        if self.max_abs is not None and not self.max_abs > 0:
            raise ValueError(f"Thresholds.max_abs must be > 0 or None, got {self.max_abs!r}")

    def min_psnr(self, kind: str) -> float:
        """The PSNR minimum of rows of threshold kind ``kind`` (:data:`CACHE` or :data:`PARALLEL`)."""
        return self.cache_psnr if kind == CACHE else self.parallel_psnr

    def judge(self, kind: str, psnr: float, ssim: float | None, max_abs: float | None = None) -> tuple[str, str]:
        """The status of a row with worst-output ``psnr`` and ``ssim``, and why when it is not a pass.

        ``ssim`` is ``None`` for outputs SSIM cannot compare (latents, images smaller than its window): PSNR alone
        decides then. ``max_abs`` is the row's largest absolute difference, checked against :attr:`max_abs` on
        parallel rows.
        """
        if math.isnan(psnr) or (ssim is not None and math.isnan(ssim)):
            return Status.FAIL, "PSNR or SSIM is not a number"
        if ssim is not None and psnr > self.garbled_psnr and ssim < self.garbled_ssim:
            return Status.GARBLED, f"PSNR {_db(psnr)} dB looks fine but SSIM {ssim:.3f} < {self.garbled_ssim:g}"
        reasons = []
        if not psnr > self.min_psnr(kind):
            reasons.append(f"PSNR {_db(psnr)} dB <= {self.min_psnr(kind):g}")
        if ssim is not None and not ssim > self.ssim:
            reasons.append(f"SSIM {ssim:.4f} <= {self.ssim:g}")
        if kind == PARALLEL and self.max_abs is not None and max_abs is not None and not max_abs < self.max_abs:
            reasons.append(f"max abs error {max_abs:.2e} >= {self.max_abs:g}")
        return (Status.FAIL, "; ".join(reasons)) if reasons else (Status.PASS, "")


@dataclass(frozen=True)
class Skip:
    """A rung's layout does not fit this run; :attr:`reason` says what it needs (``"needs 4 processes"``)."""

    reason: str


@dataclass(frozen=True)
class LadderContext:
    """What a rung's layout is built from.

    Attributes:
        world_size: Processes of the run; every parallel layout uses all of them.
        adapters: The adapters of the pipeline's denoisers (empty when none is registered).
        num_steps: Denoising steps of a call (``None`` if the pipeline does not say).
    """

    world_size: int
    adapters: tuple[ModelAdapter, ...] = ()
    num_steps: int | None = None


Options = Mapping[str, Any]


@dataclass(frozen=True)
class Rung:
    """One configuration of the ladder, as data.

    Attributes:
        name: What ``--ladder`` selects it by.
        groups: Other names that select it (``"cp"`` selects ``ulysses`` and ``ring``).
        kind: Threshold kind, :data:`CACHE` or :data:`PARALLEL`.
        build: ``fastdit.accelerate`` keyword arguments for a :class:`LadderContext`, or a :class:`Skip`.
        doc: One line for the docs and ``--help``.
        reference: ``fastdit.accelerate`` keyword arguments of the one-process run the rung is judged against
            (``None``: the baseline). A rung that adds parallelism to a technique that approximates (a step cache)
            is exact against that technique alone: same outputs, same cached steps (under CFG parallelism, where
            a rank runs only its branch's calls, the steps each branch it ran served).
        check_disable: After this rung's ``disable``, the output must equal the baseline bit for bit (as
            :attr:`VerifyRuntime.check_disable` asks of every rung).
    """

    name: str
    groups: tuple[str, ...]
    kind: str
    build: Callable[[LadderContext], Options | Skip]
    doc: str = ""
    reference: Options | None = None
    check_disable: bool = False


def fixed_rung(
    name: str, options: Options, *, reference: Options | None = None, doc: str = "", check_disable: bool = False
) -> Rung:
    """A parallel rung that always runs with ``options`` (a test's or a model's own configuration).

    Args:
        name: Its row's name.
        options: ``fastdit.accelerate`` keyword arguments (``parallel``, ``cache``, ``compile`` ...).
        reference: One-process options it is judged against (see :attr:`Rung.reference`); it must not be parallel.
        doc: One line describing it.
        check_disable: See :attr:`Rung.check_disable`.

    Raises:
        ValueError: ``reference`` holds a parallel layout.
    """
    if reference is not None and reference.get("parallel") is not None:
        raise ValueError(f"fixed_rung {name!r}: reference runs on one process, got parallel={reference['parallel']}")
    fixed = dict(options)
    kept = None if reference is None else dict(reference)
    return Rung(name, (), PARALLEL, lambda context: fixed, doc, kept, check_disable)


def _cache(context: LadderContext) -> Options:
    from fastdit.cache.presets import cache_config

    # The default preset: the tested trade-off users get from a bare --cache.
    return {"cache": cache_config(None, num_steps=context.num_steps)}


def _needs(processes: int, context: LadderContext) -> Skip | None:
    return Skip(f"needs {processes} processes") if context.world_size < processes else None


def _all_ranks(degree: str) -> Callable[[LadderContext], Options | Skip]:
    def build(context: LadderContext) -> Options | Skip:
        return _needs(2, context) or {"parallel": Parallel(**{degree: context.world_size})}

    return build


def _carrier(context: LadderContext, preferred: str) -> str:
    """The transformer layout that carries a component rung (text encoder, VAE): ``preferred`` if every adapter
    plans it, else the other one, so the rung tests its component rather than a missing transformer plan."""
    has = {
        "tp": all(a.tp_plan is not None for a in context.adapters),
        "ulysses": all(a.cp_plan is not None for a in context.adapters),
    }
    other = "ulysses" if preferred == "tp" else "tp"
    return preferred if has[preferred] or not has[other] else other


def _text_encoder(context: LadderContext) -> Options | Skip:
    degree = _carrier(context, "tp")
    return _needs(2, context) or {"parallel": Parallel(**{degree: context.world_size}, text_encoder=True)}


def _vae(context: LadderContext) -> Options | Skip:
    degree = _carrier(context, "ulysses")
    return _needs(2, context) or {"parallel": Parallel(**{degree: context.world_size}, vae=True)}


def _cfg(context: LadderContext) -> Options | Skip:
    size = context.world_size
    if size < 2 or size % 2:
        return Skip("needs 2 processes" if size < 2 else "needs an even number of processes")
    # Each branch on the remaining ranks as a Ulysses group (none beyond 2 processes).
    return {"parallel": Parallel(cfg=2, ulysses=size // 2)}


def _pair(inner: str, outer: str) -> Callable[[LadderContext], Options | Skip]:
    def build(context: LadderContext) -> Options | Skip:
        size = context.world_size
        if size < 4 or size % 2:
            return Skip("needs 4 processes" if size < 4 else "needs an even number of processes")
        return {"parallel": Parallel(**{inner: 2, outer: size // 2})}

    return build


def _fuse(context: LadderContext) -> Options | Skip:
    if not all(a.fused_projections for a in context.adapters):
        return Skip("the model family declares no projections that share an input")
    return {"fuse": Fuse()}


LADDER: tuple[Rung, ...] = (
    Rung(CACHE, (), CACHE, _cache, "the default cache preset (balanced)"),
    Rung("fuse", (), PARALLEL, _fuse, "the projections that share an input fused, one matmul per group"),
    Rung("ulysses", ("cp",), PARALLEL, _all_ranks("ulysses"), "context parallelism, Ulysses over all ranks"),
    Rung("ring", ("cp",), PARALLEL, _all_ranks("ring"), "context parallelism, ring attention over all ranks"),
    Rung("tp", (), PARALLEL, _all_ranks("tp"), "tensor parallelism of the transformer over all ranks"),
    Rung("tep", (), PARALLEL, _text_encoder, "TP (or Ulysses) plus the text encoders split over all ranks"),
    Rung("vaep", (), PARALLEL, _vae, "Ulysses (or TP) plus the VAE decode split over all ranks"),
    Rung("ulysses_tp", ("hybrid",), PARALLEL, _pair("ulysses", "tp"), "Ulysses 2 × TP over the other ranks"),
    Rung("usp", ("hybrid", "cp"), PARALLEL, _pair("ulysses", "ring"), "Ulysses 2 × ring over the other ranks"),
    Rung("cfg", ("hybrid",), PARALLEL, _cfg, "CFG branches on 2 rank groups (× Ulysses beyond 2 ranks)"),
)
"""Every rung, in the order they run."""


def ladder_names() -> list[str]:
    """Every name ``select_rungs`` accepts: rung names, then group names, then ``all``."""
    groups = sorted({g for rung in LADDER for g in rung.groups})
    return [rung.name for rung in LADDER] + groups + ["all"]


def select_rungs(names: Sequence[str | Rung] | str | None) -> list[Rung]:
    """The rungs ``names`` select, in ladder order (``None``, empty or ``"all"``: every rung).

    Args:
        names: Rung or group names, or one comma-separated string of them. :class:`Rung` objects may be given
            instead of names (a model's own configurations, or a test's): they run after the named ones, in order.

    Raises:
        LadderError: A name selects no rung.
    """
    if isinstance(names, str):
        names = [part.strip() for part in names.split(",") if part.strip()]
    extra = [name for name in names or () if isinstance(name, Rung)]
    names = [name for name in names or () if not isinstance(name, Rung)]
    if extra and not names:
        return extra
    if not names or "all" in names:
        return list(LADDER) + extra
    unknown = [name for name in names if name not in ladder_names()]
    if unknown:
        raise LadderError(f"unknown ladder entry {unknown[0]!r}; known: {', '.join(ladder_names())}")
    wanted = set(names)
    return [rung for rung in LADDER if rung.name in wanted or wanted & set(rung.groups)] + extra


@dataclass(frozen=True)
class VerifyRuntime:
    """How the ladder runs.

    Attributes:
        world_size: Processes of the run (``None``: the process group's size, else ``WORLD_SIZE``, else 1).
        cases: Prompt and seed of each output (default: one case of seed 0, the prompt in the call arguments).
        warmup: Untimed calls per row.
        repeat: Timed passes per row (latency is their median).
        thresholds: Pass/fail minima.
        timeout_s: :attr:`Parallel.timeout_s` of every parallel rung (``None``: its default).
        adapter: Adapter of an unregistered transformer, passed to ``fastdit.accelerate``.
        name: The model's name in reports.
        check_disable: After each rung's :func:`fastdit.disable`, run the cases once more: the output must equal
            the baseline bit for bit, or the row fails (disable left something behind).
    """

    world_size: int | None = None
    cases: tuple[Case, ...] = (Case(None, 0),)
    warmup: int = 0
    repeat: int = 1
    thresholds: Thresholds = field(default_factory=Thresholds)
    timeout_s: float | None = None
    adapter: ModelAdapter | None = None
    name: str = ""
    check_disable: bool = False

    def processes(self) -> int:
        """:attr:`world_size`, or what the running job has."""
        if self.world_size is not None:
            return self.world_size
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size()
        from fastdit.process import process_count

        return process_count()


@dataclass
class VerifyRow:
    """One line of the ladder's table.

    Attributes:
        name: The rung's name (:data:`BASELINE` for the baseline).
        configuration: The rung and its layout, in words (``"ulysses (ulysses=2)"``).
        kind: Threshold kind (``""`` for the baseline and rows that did not run).
        status: One of :class:`Status`.
        reason: Why the status is not a pass (empty for a pass).
        options: The ``fastdit.accelerate`` arguments as plain data (empty when none were built).
        seconds: Median seconds per output (``None``: not run).
        speedup: Baseline seconds / these seconds.
        psnr, psnr_min, ssim, ssim_min: Quality against the baseline (mean and worst output). For audio outputs
            PSNR is the waveform's over full scale and SSIM that of the log spectrogram
            (:func:`fastdit.metrics.compare_audio`).
        snr, snr_min: Waveform SNR in dB against the baseline (audio outputs only, else ``None``).
        peak_memory: Peak bytes of this rank (``None``: not run or not measurable).
        memory_kind: What :attr:`peak_memory` measures.
        max_abs: Largest absolute difference from the reference over every output value.
        cached_steps: Steps served from a step cache in the last pass (``None``: no cache).
        blocks_computed: Fraction of block evaluations a step cache computed (``None``: no cache).
        summary: :func:`fastdit.summary` of the last call, per transformer, as plain data (``None``: not run).
        outputs: The outputs of the last pass (not in :meth:`to_dict`).
    """

    name: str
    configuration: str
    kind: str = ""
    status: str = Status.NOT_RUN
    reason: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    seconds: float | None = None
    speedup: float | None = None
    psnr: float | None = None
    psnr_min: float | None = None
    ssim: float | None = None
    ssim_min: float | None = None
    snr: float | None = None
    snr_min: float | None = None
    peak_memory: int | None = None
    memory_kind: str = ""
    max_abs: float | None = None
    cached_steps: int | None = None
    blocks_computed: float | None = None
    summary: dict[str, Any] | None = None
    outputs: list[np.ndarray] = field(default_factory=list, repr=False)

    @property
    def failed(self) -> bool:
        """Whether this row fails the ladder."""
        return self.status in Status.FAILED

    @property
    def result(self) -> str:
        """The table's Result cell: the status, and the reason after a colon."""
        return f"{self.status}: {self.reason}" if self.reason else self.status

    def to_dict(self) -> dict[str, Any]:
        """Strict-JSON data (infinite PSNR as ``"inf"``), without the outputs."""
        from fastdit.bench.plain import json_ready

        keys = ("name", "configuration", "kind", "status", "reason", "options", "seconds", "speedup")
        more = ("psnr", "psnr_min", "ssim", "ssim_min", "snr", "snr_min", "peak_memory", "memory_kind", "max_abs")
        more += ("cached_steps",)
        more += ("blocks_computed", "summary")
        return json_ready({key: getattr(self, key) for key in keys + more})


def _db(value: float | None) -> str:
    if value is None:
        return "-"
    return "∞" if value == math.inf else f"{value:.2f}"


def _cells(row: VerifyRow) -> tuple[str, ...]:
    latency = "-" if row.seconds is None else f"{row.seconds:.3f} s"
    if row.speedup is not None and row.name != BASELINE:
        latency += f" ({row.speedup:.2f}x)"
    psnr = "-" if row.psnr is None else f"{_db(row.psnr)} / {_db(row.psnr_min)}"
    ssim = "-" if row.ssim is None else f"{row.ssim:.4f} / {row.ssim_min:.4f}"
    memory = "-" if row.peak_memory is None else f"{row.peak_memory / 2**30:.2f} GiB"
    return (row.configuration, latency, psnr, ssim, memory, row.result)


@dataclass
class VerifyReport:
    """The ladder's rows and what they ran on.

    Attributes:
        model: The model's name.
        pipeline: Its pipeline class name.
        world_size: Processes of the run.
        device: Where rank 0 ran.
        call: The call's scalar arguments (steps, size, ...).
        thresholds: The minima rows were judged by.
        rows: The baseline, then one row per selected rung, in ladder order.
        output_kind: What the pipeline produces: ``"image"``, ``"video"`` or ``"audio"`` (how rows were compared).
    """

    model: str
    pipeline: str
    world_size: int
    device: str
    call: dict[str, Any]
    thresholds: Thresholds
    rows: list[VerifyRow]
    output_kind: str = "image"

    @property
    def passed(self) -> bool:
        """Whether no row failed (rows that are skipped or not available do not fail)."""
        return not any(row.failed for row in self.rows)

    @property
    def failures(self) -> list[VerifyRow]:
        """The rows that failed."""
        return [row for row in self.rows if row.failed]

    def table(self) -> str:
        """The markdown table: Configuration | Latency | PSNR | SSIM | Peak memory | Result."""
        header = ("Configuration", "Latency", "PSNR (dB)", "SSIM", "Peak memory", "Result")
        return markdown_table(
            header, [_cells(row) for row in self.rows], numeric=(False, True, True, True, True, False)
        )

    def title(self) -> str:
        """One line naming the model, the call and the run."""
        steps = self.call.get("num_inference_steps")
        noun = "process" if self.world_size == 1 else "processes"
        return f"{self.model} ({self.pipeline}): {steps} steps, {self.world_size} {noun}, {self.device}"

    def to_dict(self) -> dict[str, Any]:
        """Strict-JSON data of the whole report."""
        from dataclasses import asdict

        return {
            "model": self.model,
            "pipeline": self.pipeline,
            "world_size": self.world_size,
            "device": self.device,
            "call": self.call,
            "thresholds": asdict(self.thresholds),
            "output_kind": self.output_kind,
            "passed": self.passed,
            "rows": [row.to_dict() for row in self.rows],
        }


def _describe(name: str, options: Options) -> str:
    parallel, cache = options.get("parallel"), options.get("cache")
    if parallel is None:
        if cache is None:
            return name
        return f"{name} ({type(cache).__name__} F{cache.fn}B{cache.bn}, threshold {cache.threshold:g})"
    degrees = [
        f"{key}={getattr(parallel, key)}" for key in ("cfg", "ring", "ulysses", "tp") if getattr(parallel, key) > 1
    ]
    degrees += [key for key in ("text_encoder", "vae") if getattr(parallel, key)]
    return f"{name} ({', '.join(degrees)})"


class _SeededSession(Session):
    """A session that also seeds torch's global generator before each call.

    A few pipelines draw noise from the global generator besides the one they are given; without this the baseline
    and a row would start from different noise.
    """

    def call(self, case: Case, kwargs: Mapping[str, Any]) -> np.ndarray:
        torch.manual_seed(case.seed)
        return super().call(case, kwargs)


def _session(pipe: Any, runtime: VerifyRuntime) -> Session:
    cls = type(pipe)
    source = ModelSource(runtime.name or cls.__name__, f"{cls.__module__}.{cls.__qualname__}")
    return _SeededSession(pipe, source, _device_of(pipe))


def _device_of(pipe: Any) -> torch.device:
    device = getattr(pipe, "device", None)
    return device if isinstance(device, torch.device) else torch.device("cpu")


def _adapters(pipe: Any, adapter: ModelAdapter | None) -> tuple[ModelAdapter, ...]:
    from fastdit.components import walk

    try:
        return tuple(item.adapter for item in walk(pipe, adapter).denoisers)
    except ValueError:  # no registered denoiser: every rung will say so through accelerate
        return ()


@dataclass
class _Ladder:
    """What every row of one ladder shares."""

    session: Session
    kwargs: dict[str, Any]
    runtime: VerifyRuntime
    context: LadderContext
    baseline: RunResult | None = None
    references: dict[str, RunResult] = field(default_factory=dict)

    def measure(self) -> RunResult:
        runtime = self.runtime
        cases = list(runtime.cases)
        return run(self.session, cases, self.kwargs, warmup=runtime.warmup, repeat=runtime.repeat, track_memory=True)

    def options(self, options: Options) -> dict[str, Any]:
        """``options`` with the runtime's adapter of an unregistered transformer."""
        adapter = self.runtime.adapter
        return {**options, "adapter": adapter} if adapter is not None else dict(options)

    def accelerate_reference(self, rung: Rung) -> str | None:
        """Apply the one-process options of ``rung``'s reference if it is not measured yet; its key, or ``None``
        when the rung is judged against the baseline. Raises what ``fastdit.accelerate`` refuses them with."""
        if rung.reference is None:
            return None
        key = repr(plain_options(rung.reference))
        if key not in self.references:
            self.session.accelerate(**self.options(rung.reference))
        return key

    def reference(self, key: str | None) -> RunResult:
        """The run a row is judged against: the baseline, or the reference ``key`` (measured and removed on first
        use, after :meth:`accelerate_reference` applied it)."""
        if key is None:
            assert self.baseline is not None
            return self.baseline
        if key not in self.references:
            try:
                self.references[key] = self.measure()
            finally:
                self.session.disable()
        return self.references[key]


def _max_abs(reference: Sequence[np.ndarray], test: Sequence[np.ndarray]) -> float:
    return max(
        float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))) for a, b in zip(reference, test, strict=True)
    )


def _measured(row: VerifyRow, result: RunResult, ladder: _Ladder, reference: RunResult | None = None) -> VerifyRow:
    count = len(ladder.runtime.cases)
    row.seconds, row.outputs = result.median_seconds / count, result.outputs
    row.peak_memory, row.memory_kind = result.peak_memory, result.memory_kind
    if result.cache is not None and result.cache.blocks_total:
        row.cached_steps, row.blocks_computed = result.cache.cached_steps, result.cache.blocks_computed_fraction
    if result.summary is not None:
        row.summary = result.summary.transformers
    if ladder.baseline is None:
        return row
    row.speedup = ladder.baseline.median_seconds / result.median_seconds
    reference = reference or ladder.baseline
    if [o.shape for o in reference.outputs] != [o.shape for o in result.outputs]:
        shapes = f"{[o.shape for o in result.outputs]} vs {[o.shape for o in reference.outputs]}"
        row.status, row.reason = Status.FAIL, f"output shapes differ from the reference: {shapes}"
        return row
    audio = result.output_kind == AUDIO
    try:
        quality = compare_outputs(reference.outputs, result.outputs, audio=audio)
        row.psnr, row.psnr_min = quality.psnr, quality.psnr_min
        row.ssim, row.ssim_min = quality.ssim, quality.ssim_min
        row.snr, row.snr_min = quality.snr, quality.snr_min
    except ValueError:  # not images SSIM can read (latents, tiles below its 11-pixel window, very short audio)
        data_range = AUDIO_RANGE if audio else 1.0
        row.psnr, row.psnr_min = _psnr_only(reference.outputs, result.outputs, data_range)
    row.max_abs = _max_abs(reference.outputs, result.outputs)
    row.status, row.reason = ladder.runtime.thresholds.judge(row.kind, row.psnr_min, row.ssim_min, row.max_abs)
    parallel = row.options.get("parallel") or {}
    # A reference without a cache (e.g. another attention backend) has nothing served to compare.
    if reference is not ladder.baseline and reference.cache is not None and reference.cache.blocks_total:
        if parallel.get("cfg", 1) == 1:
            expected = reference.cache.cached_steps
            reason = (
                f"served {row.cached_steps} steps from the cache, its one-process reference {expected}"
                if row.cached_steps != expected
                else ""
            )
        else:
            # With CFG parallelism a rank of a two-call pipeline runs (and caches) only its branch's calls: its count
            # is a share of the reference's, so each branch it ran is compared with that branch on one process.
            reason = _branch_mismatch(result, reference)
        if reason:
            row.status, row.reason = Status.FAIL, "; ".join(filter(None, (row.reason, reason)))
    return row


def _branches(result: RunResult) -> dict[tuple[str, str], dict[str, Any]]:
    """Each cache branch of the last call, by (denoiser, branch name)."""
    if result.summary is None:
        return {}
    return {
        (name, branch): stats
        for name, info in result.summary.transformers.items()
        for branch, stats in info.get("cache", {}).get("branches", {}).items()
    }


def _branch_mismatch(result: RunResult, reference: RunResult) -> str:
    """Why a CFG-parallel rank's cache branches differ from those of the one-process run (``""``: they agree).

    Each branch the rank ran must have served the steps the same branch served on one process, up to the steps the
    rank ran it (a CFG rank runs the other rank's branch only in the warm-up pair). A pipeline that announces no
    branch names the calls by their order on one process and by the CFG rank under cfg (``branch_alias``).
    """
    from fastdit.cache.state import branch_alias

    expected = _branches(reference)
    for (name, branch), stats in _branches(result).items():
        one = expected.get((name, branch)) or expected.get((name, branch_alias(branch) or branch))
        if one is None:
            return f"{name}: ran a cache branch {branch!r} the one-process reference does not have"
        served = [step for step in one["cached_steps"] if step < stats["steps"]]
        if stats["cached_steps"] != served:
            return (
                f"{name}: branch {branch!r} served steps {stats['cached_steps']} from the cache, the same branch on "
                f"one process {served}"
            )
    return ""


def _psnr_only(
    reference: Sequence[np.ndarray], test: Sequence[np.ndarray], data_range: float = 1.0
) -> tuple[float, float]:
    """Mean and minimum PSNR over outputs of any shape, values spanning ``data_range`` (what the session returns:
    [0, 1]; waveforms full scale [-1, 1])."""
    values = []
    for a, b in zip(reference, test, strict=True):
        mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
        values.append(math.inf if mse == 0 else 10 * math.log10(data_range**2 / mse))
    return float(np.mean(values)), min(values)


def _with_timeout(options: Options, timeout_s: float | None) -> dict[str, Any]:
    options = dict(options)
    if timeout_s is not None and options.get("parallel") is not None:
        options["parallel"] = replace(options["parallel"], timeout_s=timeout_s)
    return options


def _one_line(error: BaseException) -> str:
    # The type too: an error of a run the configuration accepted is a bug to look for, and its type says where.
    return " ".join(f"{type(error).__name__}: {error}".split())


def _no_cfg_split(result: RunResult) -> bool:
    """Whether CFG parallelism split nothing in the last call: the call ran no classifier-free guidance."""
    if result.summary is None:
        return False
    stats = [info["cfg_parallel"] for info in result.summary.transformers.values() if "cfg_parallel" in info]
    return bool(stats) and not any(s.get("skipped_calls") or s.get("batched_calls") for s in stats)


REFUSALS = (ArgumentError, UnavailableError, ValueError, NotImplementedError)
"""What ``fastdit.accelerate`` raises when it refuses a configuration before touching anything."""


def _refused(row: VerifyRow, error: BaseException) -> None:
    # The row already shows the layout, so an ArgumentError's requirement is enough.
    reason = error.requirement if isinstance(error, ArgumentError) else str(error)
    row.status, row.reason = Status.NOT_AVAILABLE, " ".join(reason.split())


def _run_rung(rung: Rung, options: dict[str, Any], row: VerifyRow, ladder: _Ladder) -> bool:
    """Apply, run and remove one rung (and measure its reference first); fill ``row``. Returns whether the
    process group broke."""
    options = ladder.options(options)
    timeout = options["parallel"].timeout_s if options.get("parallel") is not None else None
    try:
        key = ladder.accelerate_reference(rung)
    except REFUSALS as error:
        _refused(row, error)
        return False
    try:
        reference = ladder.reference(key)
    except Exception as error:  # the one-process run this row is judged against failed: nothing to judge
        row.status, row.reason = Status.ERROR, f"its one-process reference failed: {_one_line(error)}"
        return False
    try:
        with collective_failures(timeout):
            ladder.session.accelerate(**options)
    except CollectiveError as error:
        row.status, row.reason = Status.ERROR, error.describe()
        return True
    except REFUSALS as error:  # refused before anything was touched: fastdit.accelerate checks every technique first
        _refused(row, error)
        return False
    try:
        with collective_failures(timeout):
            result = ladder.measure()
        _measured(row, result, ladder, reference)
        if rung.name == "cfg" and _no_cfg_split(result):
            row.status = Status.NOT_AVAILABLE
            row.reason = "the call runs no classifier-free guidance to split (give a guidance or true-CFG scale)"
    except CollectiveError as error:
        row.status, row.reason = Status.ERROR, error.describe()
        return True
    except (CfgParallelError, ShardError) as error:
        # Raised on every rank alike when the call runs no guidance branch pair (nothing for cfg=2 to split) or has
        # fewer tokens than the layout has ranks: the layout does not fit this call.
        row.status, row.reason = Status.NOT_AVAILABLE, " ".join(str(error).split())
    except Exception as error:  # a failed row, reported; the next rungs still run
        row.status, row.reason = Status.ERROR, _one_line(error)
    finally:
        ladder.session.disable()
    if (ladder.runtime.check_disable or rung.check_disable) and row.seconds is not None:
        _check_restored(row, ladder)
    return False


def _check_restored(row: VerifyRow, ladder: _Ladder) -> None:
    """Fail ``row`` when the disabled pipeline no longer gives the baseline bit for bit."""
    assert ladder.baseline is not None
    after = ladder.measure().outputs
    if not all(np.array_equal(a, b) for a, b in zip(after, ladder.baseline.outputs, strict=True)):
        error = _max_abs(ladder.baseline.outputs, after)
        reason = f"after disable the output differs from the baseline (max abs {error:.2e})"
        row.status, row.reason = Status.FAIL, "; ".join(filter(None, (row.reason, reason)))


def _verify_rung(rung: Rung, ladder: _Ladder) -> tuple[VerifyRow, bool]:
    built = rung.build(ladder.context)
    if isinstance(built, Skip):
        return VerifyRow(rung.name, rung.name, status=Status.SKIPPED, reason=built.reason), False
    options = _with_timeout(built, ladder.runtime.timeout_s)
    row = VerifyRow(rung.name, _describe(rung.name, options), kind=rung.kind, options=plain_options(options))
    broken = _run_rung(rung, options, row, ladder)
    return row, broken


def _call_summary(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if isinstance(v, (int, float, str, bool)) and k != "output_type"}


def verify_ladder(
    pipe: Any,
    call_kwargs: Mapping[str, Any],
    ladder: Sequence[str | Rung] | str | None = None,
    runtime: VerifyRuntime | None = None,
) -> VerifyReport:
    """Run the baseline and the selected rungs on ``pipe``, each judged against the baseline.

    Under several processes every process must call this with the same arguments (rows run collectives).

    Args:
        pipe: A diffusers pipeline, not accelerated (left not accelerated).
        call_kwargs: Its call arguments (prompt included or given by the cases; no generator).
        ladder: Rung or group names (:func:`ladder_names`), a comma-separated string of them, or :class:`Rung`
            objects; ``None``: every rung.
        runtime: How to run (default :class:`VerifyRuntime`).

    Returns:
        The report; :attr:`VerifyReport.passed` tells whether every row that ran passed.

    Raises:
        LadderError: ``ladder`` names no rung.
        ValueError: ``pipe`` is accelerated (its baseline would not be the plain pipeline).
    """
    from fastdit.context import context_of

    rungs = select_rungs(ladder)
    if context_of(pipe) is not None:
        raise ValueError(f"{type(pipe).__name__} is accelerated: verify_ladder needs the plain pipeline")
    runtime = runtime or VerifyRuntime()
    session = _session(pipe, runtime)
    kwargs = dict(call_kwargs)
    if "output_type" in _call_params(pipe):
        # Arrays in [0, 1], what PSNR and SSIM compare; a caller's choice (latents of a variant whose tiny VAE
        # cannot decode) is kept: the session clips those to [0, 1] alike for the baseline and every row.
        kwargs.setdefault("output_type", "np")
    context = LadderContext(runtime.processes(), _adapters(pipe, runtime.adapter), default_steps(type(pipe), kwargs))
    state = _Ladder(session, kwargs, runtime, context)
    base_row = VerifyRow(BASELINE, BASELINE, status=Status.BASELINE)
    baseline = state.measure()
    rows = [_measured(base_row, baseline, state)]  # measured before it becomes the baseline: nothing to compare
    rows[0].speedup, state.baseline = 1.0, baseline
    broken = False
    for rung in rungs:
        if broken:
            rows.append(VerifyRow(rung.name, rung.name, status=Status.NOT_RUN, reason="the process group broke"))
            continue
        row, broken = _verify_rung(rung, state)
        rows.append(row)
    return VerifyReport(
        model=session.source.name,
        pipeline=type(pipe).__name__,
        world_size=context.world_size,
        device=str(session.device),
        call=_call_summary(kwargs),
        thresholds=runtime.thresholds,
        rows=rows,
        output_kind=baseline.output_kind,
    )


def _call_params(pipe: Any) -> Mapping[str, Any]:
    from fastdit.session import call_parameters

    return call_parameters(type(pipe))


TINY_PREFIX = "tiny:"
"""Targets ``tiny:FAMILY`` and ``tiny:FAMILY:VARIANT`` name a family's random-weight tiny pipeline."""


@dataclass
class VerifyTarget:
    """A pipeline to verify, loaded, and the call arguments it runs with by default.

    Attributes:
        session: The loaded pipeline (its source names the model in reports).
        defaults: Call arguments of the preset or tiny pipeline (the prompt of a tiny pipeline included).
    """

    session: Session
    defaults: dict[str, Any]
    adapter: ModelAdapter | None = None


@dataclass(frozen=True)
class PipelineFunction:
    """A target given as ``module.path:function``: the function returns ``(pipeline, call_kwargs)`` or
    ``(pipeline, call_kwargs, adapter)`` — a third-party model's sampler as a pipeline-like object (callable with
    ``prompt``/``generator``/``num_inference_steps``, returning ``.images``; its modules in ``components``) and the
    adapter of its transformer."""

    spec: str


def _tiny(text: str) -> tuple[str, str | None]:
    family, _, variant = text.removeprefix(TINY_PREFIX).partition(":")
    return family, variant or None


def resolve_target(target: str | None, model_path: str | None = None) -> ModelSource | tuple[str, str | None]:
    """What ``target`` names, without loading anything.

    Args:
        target: ``None`` (the reference pipeline), ``tiny:FAMILY[:VARIANT]``, a registered model name (weights from
            ``model_path`` or its environment variable), or a local pipeline directory.
        model_path: The weights directory of a registered model.

    Returns:
        A :class:`~fastdit.session.ModelSource`, or ``(family, variant)`` for a tiny pipeline.

    Raises:
        TargetError: A tiny family or variant that does not exist, or a name that is neither a model nor a
            directory.
        FieldError: From :func:`fastdit.session.resolve_model` (a directory that is not a pipeline, missing weights).
    """
    from pathlib import Path

    from fastdit.errors import FieldError
    from fastdit.session import resolve_model

    if target is not None and _is_function_spec(target) and not target.startswith(TINY_PREFIX):
        return PipelineFunction(target)
    if target is not None and target.startswith(TINY_PREFIX):
        family, variant = _tiny(target)
        from fastdit.models.registry import get_family

        try:
            get_family(family).tiny(variant)
        except LookupError as error:
            raise TargetError(f"unknown target {target!r}: {str(error).strip(chr(39))}") from None
        return family, variant
    if target is not None and Path(target).expanduser().is_dir():
        return resolve_model(None, target)
    try:
        return resolve_model(target, model_path)
    except FieldError as error:
        if error.field != "name" or target is None:
            raise
        raise TargetError(
            f"unknown target {target!r}: not a registered model name, {TINY_PREFIX}FAMILY[:VARIANT], or a pipeline "
            "directory"
        ) from None


def _is_function_spec(target: str) -> bool:
    import re
    from pathlib import Path

    return re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", target) is not None and not Path(target).exists()


def _load_function(spec: str, device: Any) -> VerifyTarget:
    result = call_function(spec, f"target {spec!r}")
    if not isinstance(result, tuple) or len(result) not in (2, 3) or not isinstance(result[1], Mapping):
        raise TargetError(
            f"target {spec!r}: expected (pipeline, call_kwargs) or (pipeline, call_kwargs, adapter), got "
            f"{type(result).__name__}"
        )
    pipe, kwargs, adapter = (*result, None) if len(result) == 2 else result
    if not callable(pipe) or not isinstance(getattr(pipe, "components", None), dict):
        raise TargetError(
            f"target {spec!r}: {type(pipe).__name__} is not a pipeline (a callable with a components dict of its "
            "modules)"
        )
    if adapter is not None and not isinstance(adapter, ModelAdapter):
        raise TargetError(f"target {spec!r}: its third value is a {type(adapter).__name__}, not a ModelAdapter")
    cls = type(pipe)
    source = ModelSource(spec, f"{cls.__module__}.{cls.__qualname__}")
    return VerifyTarget(_SeededSession(pipe, source, torch.device(device)), dict(kwargs), adapter)


def load_target(
    resolved: ModelSource | tuple[str, str | None] | PipelineFunction, *, device: Any, dtype: torch.dtype
) -> VerifyTarget:
    """Load what :func:`resolve_target` found onto ``device`` (tiny pipelines are built in float32, then moved; a
    :class:`PipelineFunction` builds its own pipeline where it chooses)."""
    if isinstance(resolved, PipelineFunction):
        return _load_function(resolved.spec, device)
    if isinstance(resolved, ModelSource):
        session = _SeededSession.load(resolved, device=device, dtype=dtype)
        return VerifyTarget(session, dict(resolved.defaults))
    from fastdit.testing.pipelines import build_tiny

    family, variant = resolved
    pipe, tiny = build_tiny(family, variant)
    pipe.to(device)
    if dtype != torch.float32:  # built in float32; a cast warns about modules some models keep in float32
        pipe.to(dtype=dtype)
    cls = type(pipe)
    name = f"{TINY_PREFIX}{family}:{tiny.name}"
    source = ModelSource(name, f"{cls.__module__}.{cls.__qualname__}")
    return VerifyTarget(_SeededSession(pipe, source, device), dict(tiny.call_kwargs))


def _tile(output: np.ndarray, kind: str = "image") -> np.ndarray | None:
    """An image of one output: itself, the middle frame of a video, the first channel of latents, the log spectrogram
    of a waveform's first channel (low frequencies at the bottom); ``None``: none."""
    if kind == AUDIO:
        from fastdit.metrics.audio import DYNAMIC_RANGE_DB, log_spectrogram, spectral_n_fft

        waveform = output.reshape(-1, output.shape[-1])[:1].astype(np.float64)
        try:
            spectrum = log_spectrogram(waveform, spectral_n_fft(waveform.shape[-1]))[0]
        except ValueError:  # too short for a spectrogram: nothing to show
            return None
        return np.clip((spectrum[::-1] - spectrum.max()) / DYNAMIC_RANGE_DB + 1.0, 0.0, 1.0)
    tile = np.squeeze(output)
    if tile.ndim == 4:
        tile = tile[len(tile) // 2]
    if tile.ndim == 3 and tile.shape[-1] not in (3, 4):
        tile = tile[0]  # channels first (latents): show one channel in grey
    return np.clip(tile, 0.0, 1.0) if tile.ndim in (2, 3) else None


def save_grid(report: VerifyReport, path: Any) -> Any:
    """Save, atomically, one image per row that produced outputs (its first output), titled with its result.

    Returns:
        ``path``.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: never open a window or need a display
    import matplotlib.pyplot as plt

    from fastdit.io import atomic_output

    rows = [row for row in report.rows if row.outputs]
    columns = min(len(rows), 5)
    lines = math.ceil(len(rows) / columns)
    figure, axes = plt.subplots(lines, columns, figsize=(2.4 * columns, 3.0 * lines), squeeze=False)
    for axis in axes.flat:
        axis.axis("off")
    for axis, row in zip(axes.flat, rows, strict=False):
        tile = _tile(row.outputs[0], report.output_kind)
        if tile is not None:
            aspect = "auto" if report.output_kind == AUDIO else "equal"  # a spectrogram fills its tile
            axis.imshow(tile, interpolation="nearest", cmap="gray", vmin=0.0, vmax=1.0, aspect=aspect)
        title = (
            row.configuration if row.name == BASELINE else f"{row.configuration}\n{row.status}, {_db(row.psnr_min)} dB"
        )
        axis.set_title(title, fontsize=7, color="tab:red" if row.failed else "black")
    figure.suptitle(report.title(), fontsize=8)
    figure.tight_layout(rect=(0, 0, 1, 0.96), h_pad=2.0)
    with atomic_output(path) as temp:
        figure.savefig(temp, format="png", dpi=100)
    plt.close(figure)
    return path
