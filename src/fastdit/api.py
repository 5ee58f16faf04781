"""The public entry points: :func:`accelerate`, :func:`disable`, :func:`summary`, :func:`reset`.

``accelerate`` walks the target's components (denoisers, text encoders, VAEs), checks every requested technique
before touching any module, creates the parallel runtime once, then applies :data:`fastdit.techniques.TECHNIQUES`
in their one order:

    tensor parallel → projection fusion → quantization → context parallel → CFG parallel → cache hooks → offload →
    compile → CUDA graphs

(text-encoder and VAE parallelism act on their own modules). What was applied is one :class:`~fastdit.context.Context`
per target; ``disable`` undoes its records in reverse, restoring the exact original behaviour. How the hooks of
different techniques nest on a module is fixed by the layer table of :mod:`fastdit.hooks.layers`, not by this order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch

from fastdit.components import walk
from fastdit.config import (
    CACHE_CONFIGS,
    Attention,
    CacheConfig,
    Compile,
    CudaGraph,
    Fuse,
    Offload,
    Parallel,
    Quantize,
)
from fastdit.context import Context, Request, attach, context_of, detach
from fastdit.errors import ArgumentError
from fastdit.models.base import ModelAdapter
from fastdit.techniques import check_all, check_request

__all__ = ["Summary", "accelerate", "disable", "find_transformers", "reset", "summary"]


def find_transformers(
    target: Any, adapter: ModelAdapter | None = None
) -> dict[str, tuple[torch.nn.Module, ModelAdapter]]:
    """The denoisers fastdit can accelerate in ``target`` (a pipeline or a transformer), by component name.

    Args:
        target: A diffusers pipeline (anything with ``components``) or an ``nn.Module``.
        adapter: Use this adapter instead of the registry (third-party models).

    Raises:
        ValueError: if no component has an adapter.
    """
    return {c.name: (c.module, c.adapter) for c in walk(target, adapter).denoisers}


def _request(
    cache: Any,
    parallel: Any,
    compile: Any,
    cuda_graph: Any,
    attention: Any,
    offload: Any = None,
    quantize: Any = None,
    fuse: Any = None,
) -> Request:
    """Type-check the arguments and normalise them into one :class:`Request`."""
    if fuse is not None and fuse is not False and not isinstance(fuse, (Fuse, bool)):
        raise TypeError(f"fuse={fuse!r}: expected Fuse, True or None")
    if quantize is not None and not isinstance(quantize, Quantize):
        raise TypeError(f"quantize={quantize!r}: expected Quantize or None")
    if cache is not None and not isinstance(cache, CACHE_CONFIGS):
        raise TypeError(f"cache={cache!r}: expected DBCache, FBCache(...), MagCache, TeaCache, DBPrune or None")
    if parallel is not None and not isinstance(parallel, Parallel):
        raise TypeError(f"parallel={parallel!r}: expected Parallel or None")
    if compile is not None and compile is not False and not isinstance(compile, (Compile, bool)):
        raise TypeError(f"compile={compile!r}: expected Compile, True or None")
    if cuda_graph is not None and not isinstance(cuda_graph, CudaGraph):
        raise TypeError(f"cuda_graph={cuda_graph!r}: expected CudaGraph or None")
    if attention is not None and not isinstance(attention, Attention):
        raise TypeError(f"attention={attention!r}: expected Attention or None")
    if offload is not None and not isinstance(offload, Offload):
        raise TypeError(f"offload={offload!r}: expected Offload or None")
    compile_config = Compile() if compile is True else (compile or None)
    from_compile = CudaGraph.from_compile(compile_config) if compile_config is not None else None
    if cuda_graph is not None and from_compile is not None:
        raise ArgumentError(
            "accelerate",
            "cuda_graph",
            cuda_graph,
            f"and compile={compile_config} both ask for CUDA graphs; ask once (cuda_graph=CudaGraph(...))",
        )
    request = Request(
        cache=cache,
        parallel=parallel,
        compile=compile_config,
        cuda_graph=cuda_graph or from_compile,
        attention=attention,
        offload=offload,
        quantize=quantize,
        fuse=Fuse() if fuse is True else (fuse or None),
    )
    return request


def _runtime(request: Request, context: Context) -> Any:
    """The process groups and mesh, created once before any technique (``None`` on one process)."""
    if not request.distributed:
        return None
    from fastdit.parallel.runtime import ParallelRuntime

    first = context.components.denoisers[0].module
    param = next(first.parameters(), None)
    device = None if param is None else param.device
    if request.parallel.tp > 1 and device is not None and device.type == "cpu":
        # Tensor parallelism places each rank's slices on its device itself: a pipeline loaded on the CPU (so that
        # no device ever holds the whole transformer) runs on the accelerator when there is one.
        device = None
    return ParallelRuntime.from_config(request.parallel, device=device)


def accelerate(
    target: Any,
    *,
    cache: CacheConfig | None = None,
    parallel: Parallel | None = None,
    compile: Compile | bool | None = None,
    cuda_graph: CudaGraph | None = None,
    attention: Attention | None = None,
    offload: Offload | None = None,
    quantize: Quantize | None = None,
    fuse: Fuse | bool | None = None,
    adapter: ModelAdapter | None = None,
) -> Any:
    """Make a pipeline (or a bare transformer) fast, in place, and return it.

    Args:
        target: A diffusers pipeline or a transformer ``nn.Module``.
        cache: Step caching (``DBCache``, ``FBCache(...)``, ``MagCache``, ``TeaCache``, ``DBPrune``), or ``None``.
        parallel: Parallel layout, or ``None`` for one device.
        compile: ``True`` or a :class:`Compile` to ``torch.compile`` the transformer blocks.
        cuda_graph: A :class:`CudaGraph` to replay transformer (or block) calls from CUDA graphs; works with or
            without ``compile``.
        attention: Attention backend selection.
        offload: An :class:`Offload` to keep transformer blocks in host memory and stream them in for their call
            (for a transformer larger than the device); the rest of the pipeline moves to the device.
        quantize: A :class:`Quantize` to quantize the transformer's linear layers with torchao (FP8 or int8).
        fuse: ``True`` or a :class:`Fuse` to compute the projections that share an input (as the family declares
            them) as one matmul per group.
        adapter: Adapter for a transformer class that is not registered (third-party models).

    Returns:
        ``target`` itself.

    Raises:
        TypeError, ValueError, NotImplementedError: before any module is touched, naming the argument.
    """
    request = _request(cache, parallel, compile, cuda_graph, attention, offload, quantize, fuse)
    check_request(request)
    if context_of(target) is not None:
        raise ValueError(f"{type(target).__name__} is already accelerated; call fastdit.disable first")
    components = walk(target, adapter)
    techniques = check_all(request, components)
    context = Context(request, components)
    try:
        context.runtime = _runtime(request, context)
        for technique in techniques:
            technique.apply(context)
    except BaseException:
        context.undo_all()
        raise
    attach(target, context)
    return target


def disable(target: Any) -> Any:
    """Undo :func:`accelerate`: every hook and patch is removed; the model behaves exactly as before."""
    context = detach(target)
    if context is None:
        raise ValueError(f"{type(target).__name__} is not accelerated by fastdit")
    context.undo_all()
    return target


def reset(target: Any) -> None:
    """Forget all cached state now (the next call starts a fresh run). Runs also reset by themselves."""
    context = context_of(target)
    if context is None:
        return
    for record in context.applied():
        if record.technique == "cache":
            record.state.tracker.reset()


@dataclass
class Summary:
    """What fastdit did in the last run, per transformer component (and per text encoder it split)."""

    transformers: dict[str, dict[str, Any]]
    text_encoders: dict[str, dict[str, Any]] = field(default_factory=dict)
    vaes: dict[str, dict[str, Any]] = field(default_factory=dict)  # VAE parallelism's statistics, per VAE

    @property
    def num_cached_steps(self) -> int:
        """Cached steps over every transformer and branch."""
        return sum(t.get("cache", {}).get("num_cached_steps", 0) for t in self.transformers.values())

    @property
    def blocks_computed_fraction(self) -> float:
        """Blocks computed / blocks a run without cache would compute."""
        computed = sum(t.get("cache", {}).get("blocks_computed", 0) for t in self.transformers.values())
        total = sum(t.get("cache", {}).get("blocks_total", 0) for t in self.transformers.values())
        return computed / total if total else 1.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "transformers": self.transformers,
            "text_encoders": self.text_encoders,
            "vaes": self.vaes,
            "num_cached_steps": self.num_cached_steps,
            "blocks_computed_fraction": self.blocks_computed_fraction,
        }

    def __str__(self) -> str:
        lines = []
        for name, info in self.transformers.items():
            fused = info.get("fuse")
            if fused:
                lines.append(
                    f"{name}: {fused['num_layers']} projections fused into {fused['num_groups']} matmuls "
                    f"({fused['hits']} shared, {fused['misses']} recomputed on eager calls)"
                )
            quantized = info.get("quantize")
            if quantized:
                lines.append(
                    f"{name}: {quantized['num_quantized']} linear layers quantized ({quantized['mode']}), "
                    f"{quantized['num_skipped']} skipped; their weights {quantized['bytes_before'] / 2**20:.1f} MiB "
                    f"-> {quantized['bytes_after'] / 2**20:.1f} MiB"
                )
            stats = info.get("cache")
            if not stats:
                lines.append(f"{name}: no cache")
                continue
            lines.append(
                f"{name}: {stats['config']} computed {stats['blocks_computed']}/{stats['blocks_total']} blocks "
                f"({stats['blocks_computed_fraction']:.1%})"
            )
            for branch, b in stats["branches"].items():
                diffs = ", ".join("-" if d is None else f"{d:.3f}" for d in b["residual_diffs"])
                if "pruned_blocks_per_step" in b:
                    lines.append(
                        f"  {branch}: {b['steps']} steps, blocks pruned per step {b['pruned_blocks_per_step']}"
                    )
                    continue
                lines.append(f"  {branch}: {b['num_cached_steps']}/{b['steps']} steps cached {b['cached_steps']}")
                lines.append(f"    residual diffs: [{diffs}]")
            invariant = stats.get("step_invariant")
            if invariant and invariant["modules"]:
                served = ", ".join(f"{m} {c['served']}/{c['calls']}" for m, c in invariant["modules"].items())
                lines.append(f"  step-invariant modules served: {served}")
        for name, info in self.text_encoders.items():
            split = info["text_encoder_parallel"]
            whole = split["split_bytes"] + split["replicated_bytes"]
            lines.append(
                f"{name}: {split['plan']} plan over {split['degree']} ranks, "
                f"{split['parameter_bytes_per_rank'] / 2**20:.1f} MiB of {whole / 2**20:.1f} per rank"
            )
        return "\n".join(lines)

    def to_json(self) -> str:
        """One-line JSON."""
        return json.dumps(self.to_dict())


def summary(target: Any) -> Summary:
    """Statistics of the last run of an accelerated pipeline or transformer."""
    from fastdit.cache import cache_summary

    context = context_of(target)
    if context is None:
        raise ValueError(f"{type(target).__name__} is not accelerated by fastdit")
    out: dict[str, dict[str, Any]] = {}
    for item in context.components.denoisers:
        info: dict[str, Any] = {"class": type(item.module).__name__}
        runtime = context.runtime
        if runtime is not None:
            info["parallel"] = {
                "rank": runtime.rank,
                "world_size": runtime.world_size,
                "layout": repr(runtime),
                "topology": runtime.topology.to_dict(),
            }
        info["techniques"] = [r.technique for r in context.applied(item.name)]
        engine = context.state("cache", item.name)
        if engine is not None:
            info["cache"] = cache_summary(engine)
        branches = context.state("cfg_parallel", item.name)
        if branches is not None:
            info["cfg_parallel"] = branches.stats.stats()
        for technique in ("tensor_parallel", "fuse", "attention", "quantize", "cuda_graph"):
            state = context.state(technique, item.name)
            if state is not None:
                info[technique] = state.stats()
        streamer = context.state("offload", item.name)
        if streamer is not None:
            info["offload"] = streamer.summary()
        out[item.name] = info
    vaes = {r.component: r.state.stats() for r in context.applied() if r.technique == "vae_parallel"}
    return Summary(out, _text_encoders(context), vaes)


def _text_encoders(context: Context) -> dict[str, dict[str, Any]]:
    """Per text encoder that a technique split: its class and that technique's statistics."""
    from fastdit.components.registry import TEXT_ENCODER

    out: dict[str, dict[str, Any]] = {}
    for item in context.components.of(TEXT_ENCODER):
        split = context.state("text_encoder_parallel", item.name)
        if split is not None:
            out[item.name] = {"class": type(item.module).__name__, "text_encoder_parallel": split.stats()}
    return out
