"""Frozen configuration dataclasses for every technique fastdit applies.

Each config validates itself in ``__post_init__`` and raises ``ValueError`` naming the field and the offending value,
so bad input is rejected before any model is touched.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

__all__ = [
    "Attention",
    "Compile",
    "CudaGraph",
    "DBCache",
    "DBPrune",
    "FBCache",
    "Parallel",
    "StepMask",
    "TaylorSeer",
    "config_fields",
]


def _check(condition: bool, owner: str, name: str, value: Any, requirement: str) -> None:
    if not condition:
        raise ValueError(f"{owner}.{name}={value!r}: {requirement}")


def _check_int(owner: str, name: str, value: Any, minimum: int) -> None:
    _check(
        isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
        owner,
        name,
        value,
        f"must be an integer >= {minimum}",
    )


def _check_optional_int(owner: str, name: str, value: Any, minimum: int) -> None:
    if value is not None:
        _check_int(owner, name, value, minimum)


def config_fields(cls: type) -> list[tuple[str, Any, str]]:
    """Return ``(name, default, doc)`` for each field of a config dataclass (used by the CLI to derive flags)."""
    out = []
    for f in fields(cls):
        default = f.default if f.default is not f.default_factory else f.default_factory()  # type: ignore[misc]
        out.append((f.name, default, f.metadata.get("doc", "")))
    return out


def _doc(text: str, default: Any) -> Any:
    return field(default=default, metadata={"doc": text})


@dataclass(frozen=True, kw_only=True)
class TaylorSeer:
    """Predict skipped residuals from finite differences of past computed ones (instead of reusing them verbatim)."""

    order: int = _doc("Order of the Taylor expansion: 1 (linear) or 2 (quadratic).", 1)
    forecast_decision: bool = _doc(
        "Decide by comparing the front residual with its own Taylor forecast (instead of with the last computed "
        "one): smooth drift that the forecast follows no longer forces a full step.",
        False,
    )

    def __post_init__(self) -> None:
        _check(self.order in (1, 2), "TaylorSeer", "order", self.order, "must be 1 or 2")
        _check(
            isinstance(self.forecast_decision, bool),
            "TaylorSeer",
            "forecast_decision",
            self.forecast_decision,
            "must be a bool",
        )


STEP_MASK_PRESETS = ("slow", "medium", "fast", "ultra")


@dataclass(frozen=True, kw_only=True)
class StepMask:
    """Which denoising steps must run the full transformer.

    With ``policy="static"`` every step in ``compute_steps`` computes and every other step is served from the cache.
    With ``policy="dynamic"`` the listed steps compute and the others fall back to the residual-difference test.
    """

    compute_steps: tuple[int, ...] = _doc("Step indices (0-based) that always compute.", ())
    policy: Literal["static", "dynamic"] = _doc("'static' caches every other step; 'dynamic' tests them.", "dynamic")

    def __post_init__(self) -> None:
        steps = tuple(self.compute_steps)
        object.__setattr__(self, "compute_steps", steps)
        _check(
            all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in steps),
            "StepMask",
            "compute_steps",
            self.compute_steps,
            "must be non-negative integers",
        )
        _check(self.policy in ("static", "dynamic"), "StepMask", "policy", self.policy, "must be 'static' or 'dynamic'")

    @classmethod
    def preset(cls, name: str, num_steps: int, *, policy: Literal["static", "dynamic"] = "static") -> StepMask:
        """Build a mask from a named preset for a run of ``num_steps`` steps.

        Presets keep the first steps (where the image layout forms) and the last step (fine detail), and compute
        every k-th step in between: slow k=2, medium k=3, fast k=4, ultra k=6.

        Args:
            name: One of ``slow``, ``medium``, ``fast``, ``ultra``.
            num_steps: Number of denoising steps of the run.
            policy: ``static`` (the mask alone decides) or ``dynamic``.
        """
        _check(name in STEP_MASK_PRESETS, "StepMask", "preset", name, f"must be one of {STEP_MASK_PRESETS}")
        _check_int("StepMask", "num_steps", num_steps, 1)
        head, every = {"slow": (4, 2), "medium": (4, 3), "fast": (3, 4), "ultra": (2, 6)}[name]
        head = min(head, num_steps)
        steps = set(range(head)) | set(range(head, num_steps, every)) | {num_steps - 1}
        return cls(compute_steps=tuple(sorted(steps)), policy=policy)


@dataclass(frozen=True, kw_only=True)
class DBCache:
    """Dual-block cache: run the first ``fn`` and last ``bn`` blocks every step, skip the middle ones when the
    residual of the first ``fn`` blocks changed less than ``threshold`` since the last computed step.

    ``threshold=0`` never caches (bit-identical to the original model).
    """

    fn: int = _doc("Number of front blocks computed every step (their residual decides).", 8)
    bn: int = _doc("Number of back blocks computed every step (they repair the approximation).", 0)
    threshold: float = _doc("Relative L1 difference of the front residual below which a step is cached.", 0.08)
    warmup_steps: int = _doc("Steps at the start of each run that never use the cache.", 8)
    warmup_interval: int = _doc("Inside the warm-up, compute only every k-th step; the others may cache.", 1)
    max_cached_steps: int | None = _doc("Cap on cached steps per run (None: unlimited).", None)
    max_continuous_cached_steps: int | None = _doc("Cap on consecutive cached steps (None: unlimited).", None)
    taylorseer: TaylorSeer | None = _doc("Predict skipped residuals with TaylorSeer (None: reuse them).", None)
    step_mask: StepMask | None = _doc("Steps that must compute (and, if static, the ones that must cache).", None)
    separate_cfg: bool | None = _doc(
        "Keep separate cache state per CFG branch. None: automatic (per cache context / per call within a step).",
        None,
    )

    def __post_init__(self) -> None:
        _check_int("DBCache", "fn", self.fn, 1)
        _check_int("DBCache", "bn", self.bn, 0)
        _check(
            isinstance(self.threshold, (int, float)) and not isinstance(self.threshold, bool) and self.threshold >= 0,
            "DBCache",
            "threshold",
            self.threshold,
            "must be a number >= 0",
        )
        _check_int("DBCache", "warmup_steps", self.warmup_steps, 0)
        _check_int("DBCache", "warmup_interval", self.warmup_interval, 1)
        _check_optional_int("DBCache", "max_cached_steps", self.max_cached_steps, 0)
        _check_optional_int("DBCache", "max_continuous_cached_steps", self.max_continuous_cached_steps, 1)
        _check(
            self.taylorseer is None or isinstance(self.taylorseer, TaylorSeer),
            "DBCache",
            "taylorseer",
            self.taylorseer,
            "must be a TaylorSeer or None",
        )
        _check(
            self.step_mask is None or isinstance(self.step_mask, StepMask),
            "DBCache",
            "step_mask",
            self.step_mask,
            "must be a StepMask or None",
        )


def FBCache(threshold: float = 0.12, **kwargs: Any) -> DBCache:  # noqa: N802 - reads as a config class
    """First-block cache: :class:`DBCache` with ``fn=1, bn=0``."""
    return DBCache(fn=1, bn=0, threshold=threshold, **kwargs)


@dataclass(frozen=True, kw_only=True)
class DBPrune:
    """Dynamic block pruning: each middle block is skipped on its own when its input changed less than
    ``threshold`` since it last ran; its cached residual is added instead."""

    fn: int = _doc("Front blocks that always compute.", 1)
    bn: int = _doc("Back blocks that always compute.", 0)
    threshold: float = _doc("Relative L1 change of a block's input below which the block is skipped.", 0.08)
    warmup_steps: int = _doc("Steps at the start of each run that never prune.", 4)
    max_pruned_ratio: float = _doc("Largest fraction of middle blocks pruned in one step.", 1.0)
    max_continuous_pruned_steps: int | None = _doc("Cap on consecutive steps one block may be pruned.", None)

    def __post_init__(self) -> None:
        _check_int("DBPrune", "fn", self.fn, 0)
        _check_int("DBPrune", "bn", self.bn, 0)
        _check(
            isinstance(self.threshold, (int, float)) and not isinstance(self.threshold, bool) and self.threshold >= 0,
            "DBPrune",
            "threshold",
            self.threshold,
            "must be a number >= 0",
        )
        _check_int("DBPrune", "warmup_steps", self.warmup_steps, 0)
        _check(
            isinstance(self.max_pruned_ratio, (int, float)) and 0 <= self.max_pruned_ratio <= 1,
            "DBPrune",
            "max_pruned_ratio",
            self.max_pruned_ratio,
            "must be in [0, 1]",
        )
        _check_optional_int("DBPrune", "max_continuous_pruned_steps", self.max_continuous_pruned_steps, 1)


@dataclass(frozen=True, kw_only=True)
class Parallel:
    """Degrees of parallelism. Their product must equal the number of processes (under ``torchrun``)."""

    ulysses: int = _doc("Ulysses (all-to-all) context-parallel degree.", 1)
    ring: int = _doc("Ring-attention context-parallel degree.", 1)
    tp: int = _doc("Tensor-parallel degree of the transformer.", 1)
    cfg: int = _doc("CFG-parallel degree (1 or 2): cond and uncond branches on different ranks.", 1)
    text_encoder: bool = _doc("Shard the text encoders with tensor parallelism over the TP ranks.", False)
    vae: bool = _doc("Decode the latent in parallel over all ranks.", False)
    ulysses_chunks: int = _doc(
        "Pipeline Ulysses attention over this many head chunks, so one chunk's all-to-all overlaps another's "
        "attention (1: one exchange each way; used only when the heads split evenly).",
        1,
    )
    comm_fp8: bool = _doc(
        "Send Ulysses all-to-alls as float8 with per-tensor scales (lossy; half the bf16 bytes).", False
    )

    def __post_init__(self) -> None:
        for name in ("ulysses", "ring", "tp", "ulysses_chunks"):
            _check_int("Parallel", name, getattr(self, name), 1)
        _check(self.cfg in (1, 2), "Parallel", "cfg", self.cfg, "must be 1 or 2")

    @property
    def world_size(self) -> int:
        """Number of processes this layout needs."""
        return self.ulysses * self.ring * self.tp * self.cfg

    @property
    def is_parallel(self) -> bool:
        """Whether any form of parallelism is requested."""
        return self.world_size > 1 or self.text_encoder or self.vae


# torch.compile modes that capture CUDA graphs themselves.
_GRAPHING_MODES = ("reduce-overhead", "max-autotune")


@dataclass(frozen=True, kw_only=True)
class Compile:
    """torch.compile settings for the transformer blocks (cache decisions stay outside compiled code)."""

    backend: str = _doc("torch.compile backend.", "inductor")
    mode: str | None = _doc("torch.compile mode, e.g. 'max-autotune-no-cudagraphs'.", None)
    fullgraph: bool = _doc("Fail on graph breaks inside a block.", False)
    dynamic: bool | None = _doc("Dynamic shapes (None: torch decides).", None)
    cuda_graph: bool = _doc(
        "Capture calls in CUDA graphs per input signature and replay them, collectives included (removes CPU launch "
        "overhead; CUDA only).",
        False,
    )
    graph_scope: str = _doc(
        "'call': one graph per transformer call; 'blocks': one per block call, inside the cache's block hooks so "
        "cache decisions stay on the host; 'auto': 'blocks' with a cache, else 'call'.",
        "auto",
    )
    graph_warmup: int = _doc("Calls per input signature run normally before the CUDA graph is captured.", 2)
    max_graphs: int = _doc("Input signatures captured per transformer; later new signatures run without a graph.", 8)

    def __post_init__(self) -> None:
        _check(isinstance(self.backend, str) and bool(self.backend), "Compile", "backend", self.backend, "non-empty")
        _check(isinstance(self.cuda_graph, bool), "Compile", "cuda_graph", self.cuda_graph, "a bool")
        _check(self.graph_scope in ("auto", "call", "blocks"), "Compile", "graph_scope", self.graph_scope,
               "one of 'auto', 'call', 'blocks'")  # fmt: skip
        _check_int("Compile", "graph_warmup", self.graph_warmup, 1)
        _check_int("Compile", "max_graphs", self.max_graphs, 1)
        _check(
            not (self.cuda_graph and self.mode in _GRAPHING_MODES),
            "Compile",
            "mode",
            self.mode,
            f"not one of {_GRAPHING_MODES} together with cuda_graph=True (both would capture CUDA graphs)",
        )


ATTENTION_BACKENDS = ("sdpa", "flash", "cudnn", "efficient", "math", "flash-attn", "sage")


@dataclass(frozen=True, kw_only=True)
class Attention:
    """Attention backend selection."""

    backend: str = _doc(f"One of {', '.join(ATTENTION_BACKENDS)}.", "sdpa")
    gqa: Literal["auto", "native", "repeat"] = _doc("GQA: 'native' (enable_gqa), 'repeat' K/V, or 'auto'.", "auto")

    def __post_init__(self) -> None:
        _check(self.backend in ATTENTION_BACKENDS, "Attention", "backend", self.backend, f"one of {ATTENTION_BACKENDS}")
        _check(self.gqa in ("auto", "native", "repeat"), "Attention", "gqa", self.gqa, "one of auto, native, repeat")


GRAPH_SCOPES = ("auto", "call", "blocks")


@dataclass(frozen=True, kw_only=True)
class CudaGraph:
    """CUDA graphs: capture calls once per input signature and replay them (CUDA only; no ``torch.compile`` needed).

    Graphs remove CPU launch overhead, which dominates when each GPU's share of the work is small (context
    parallelism, small images, compiled kernels). With :class:`Compile` as well, the compiled blocks are graphed.
    """

    scope: str = _doc(
        "'call': one graph per transformer call (hooks and collectives included); 'blocks': one per block call, "
        "beneath the cache's block hooks so cache decisions stay on the host; 'auto': 'blocks' with a cache, else "
        "'call'.",
        "auto",
    )
    warmup: int = _doc("Calls per input signature run normally before the graph is captured.", 2)
    max_graphs: int = _doc(
        "Input signatures captured per transformer (or block); later new ones run without a graph.", 8
    )

    def __post_init__(self) -> None:
        _check(self.scope in GRAPH_SCOPES, "CudaGraph", "scope", self.scope, f"one of {GRAPH_SCOPES}")
        _check_int("CudaGraph", "warmup", self.warmup, 1)
        _check_int("CudaGraph", "max_graphs", self.max_graphs, 1)

    @classmethod
    def from_compile(cls, compile: Compile) -> CudaGraph | None:
        """The graphs a ``Compile(cuda_graph=True, graph_*=...)`` asks for (``None`` without ``cuda_graph``)."""
        if not compile.cuda_graph:
            return None
        return cls(scope=compile.graph_scope, warmup=compile.graph_warmup, max_graphs=compile.max_graphs)
