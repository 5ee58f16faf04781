"""The public entry points: :func:`accelerate`, :func:`disable`, :func:`summary`, :func:`reset`.

``accelerate`` resolves the adapter of every transformer in a pipeline (or of a bare transformer), validates the
requested combination once, then applies the techniques in one fixed order:

    tensor parallel → context parallel → CFG parallel → cache hooks → compile → CUDA graphs

(text-encoder and VAE parallelism act on their own modules). Each step returns an undo function; ``disable`` runs
them in reverse order, restoring the exact original behaviour.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fastdit.cache import apply_cache, cache_engine, cache_summary
from fastdit.cache.policy import Reducer
from fastdit.config import Attention, Compile, DBCache, DBPrune, Parallel
from fastdit.cuda_graph import graph_stats
from fastdit.models.base import ModelAdapter
from fastdit.models.registry import adapter_for

__all__ = ["Summary", "accelerate", "disable", "find_transformers", "reset", "summary"]

_STATE_ATTR = "_fastdit_state"


@dataclass
class _Applied:
    transformers: dict[str, torch.nn.Module]
    cache: DBCache | DBPrune | None
    parallel: Parallel | None
    compile: Compile | None
    undo: list[Callable[[], None]] = field(default_factory=list)
    runtime: Any = None  # ParallelRuntime when parallelism is active


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
    if isinstance(target, torch.nn.Module):
        found = adapter or adapter_for(target)
        if found is None:
            raise ValueError(
                f"no adapter is registered for {type(target).__module__}.{type(target).__qualname__}; "
                "pass adapter=ModelAdapter(...) or register one (docs/adding_a_model.md)"
            )
        return {"transformer": (target, found)}
    components = getattr(target, "components", None)
    if not isinstance(components, dict):
        raise ValueError(f"target={type(target).__name__}: expected a diffusers pipeline or a torch.nn.Module")
    out = {}
    for name, module in components.items():
        if isinstance(module, torch.nn.Module):
            found = adapter if adapter is not None and _serves(adapter, module) else adapter_for(module)
            if found is not None:
                out[name] = (module, found)
    if not out:
        names = {k: type(v).__name__ for k, v in components.items() if isinstance(v, torch.nn.Module)}
        raise ValueError(f"no component of {type(target).__name__} has a fastdit adapter: {names}")
    return out


def _serves(adapter: ModelAdapter, module: torch.nn.Module) -> bool:
    return f"{type(module).__module__}.{type(module).__qualname__}" in adapter.transformer_classes


def _validate(cache: Any, parallel: Any, compile: Any, attention: Any) -> None:
    if cache is not None and not isinstance(cache, (DBCache, DBPrune)):
        raise TypeError(f"cache={cache!r}: expected DBCache, FBCache(...), DBPrune or None")
    if parallel is not None and not isinstance(parallel, Parallel):
        raise TypeError(f"parallel={parallel!r}: expected Parallel or None")
    if compile is not None and not isinstance(compile, (Compile, bool)):
        raise TypeError(f"compile={compile!r}: expected Compile, True or None")
    if attention is not None and not isinstance(attention, Attention):
        raise TypeError(f"attention={attention!r}: expected Attention or None")
    if parallel is not None:
        missing = [name for name in ("tp", "cfg") if getattr(parallel, name) > 1]
        missing += [name for name in ("text_encoder", "vae") if getattr(parallel, name)]
        if missing:
            raise NotImplementedError(
                f"parallel={parallel}: {', '.join(missing)} parallelism is not available in this version of fastdit"
            )
    if isinstance(compile, Compile) and compile.cuda_graph and compile.graph_scope == "call" and cache is not None:
        raise ValueError(
            f"compile=Compile(cuda_graph=True, graph_scope='call') with cache={cache!r}: a step cache decides on the "
            "host between blocks, which a CUDA graph of the whole call cannot do; use graph_scope='blocks' or 'auto'"
        )
    if attention is not None and attention != Attention() and not _context_parallel(parallel):
        raise NotImplementedError(
            f"attention={attention}: attention backends other than the default are only available with "
            "context parallelism (Parallel(ulysses=...) or Parallel(ring=...))"
        )


def _check_graphs(
    transformers: dict[str, tuple[torch.nn.Module, ModelAdapter]], parallel: Parallel | None, compile: Compile | None
) -> None:
    """CUDA graphs freeze every host value of a call: refuse plans whose attention lengths change with the data."""
    if compile is None or not compile.cuda_graph or not _context_parallel(parallel):
        return
    for name, (_, found) in transformers.items():
        if found.cp_plan is not None and found.cp_plan.attention.exchange_lengths:
            raise ValueError(
                f"compile=Compile(cuda_graph=True) with parallel={parallel}: {name} ({found.family}) exchanges "
                "attention lengths that depend on the data at every call, which a CUDA graph would freeze; use "
                "cuda_graph=False"
            )


def _context_parallel(parallel: Parallel | None) -> bool:
    return parallel is not None and parallel.ulysses * parallel.ring > 1


def _apply_context_parallel(
    transformers: dict[str, tuple[torch.nn.Module, ModelAdapter]],
    parallel: Parallel,
    attention: Attention | None,
    applied: _Applied,
) -> Reducer:
    """Context parallel on every transformer; returns the reducer that keeps cache decisions equal on all ranks."""
    from fastdit.parallel.context_parallel import apply_context_parallel, context_parallel_group, cp_reducer
    from fastdit.parallel.runtime import ParallelRuntime

    for name, (_, found) in transformers.items():
        if found.cp_plan is None:  # before any process group or hook exists
            raise ValueError(f"{name}: model family {found.family!r} has no context-parallel plan")
    first = next(iter(transformers.values()))[0]
    param = next(first.parameters(), None)
    runtime = ParallelRuntime.from_config(parallel, device=None if param is None else param.device)
    applied.runtime = runtime
    for module, found in transformers.values():
        applied.undo.append(apply_context_parallel(module, found, parallel, runtime, attention=attention))
    return cp_reducer(context_parallel_group(runtime))


def accelerate(
    target: Any,
    *,
    cache: DBCache | DBPrune | None = None,
    parallel: Parallel | None = None,
    compile: Compile | bool | None = None,
    attention: Attention | None = None,
    adapter: ModelAdapter | None = None,
) -> Any:
    """Make a pipeline (or a bare transformer) fast, in place, and return it.

    Args:
        target: A diffusers pipeline or a transformer ``nn.Module``.
        cache: Step caching (``DBCache``, ``FBCache(...)``, ``DBPrune``), or ``None``.
        parallel: Parallel layout, or ``None`` for one device.
        compile: ``True`` or a :class:`Compile` to ``torch.compile`` the transformer blocks.
        attention: Attention backend selection.
        adapter: Adapter for a transformer class that is not registered (third-party models).

    Returns:
        ``target`` itself.
    """
    _validate(cache, parallel, compile, attention)
    if getattr(target, _STATE_ATTR, None) is not None:
        raise ValueError(f"{type(target).__name__} is already accelerated; call fastdit.disable first")
    transformers = find_transformers(target, adapter)
    compile_config = Compile() if compile is True else (compile or None)
    _check_graphs(transformers, parallel, compile_config)
    applied = _Applied({k: m for k, (m, _) in transformers.items()}, cache, parallel, compile_config)
    try:
        reducer = None
        if _context_parallel(parallel):
            # Context parallel before the cache hooks, so the cache wraps the split model and sees its shards.
            reducer = _apply_context_parallel(transformers, parallel, attention, applied)
        for module, found in transformers.values():
            if cache is not None:
                applied.undo.append(apply_cache(module, found, cache, reducer=reducer))
            if compile_config is not None:
                from fastdit.compile import apply_compile

                applied.undo.append(apply_compile(module, found, compile_config))
            if compile_config is not None and compile_config.cuda_graph:
                from fastdit.cuda_graph import apply_cuda_graph
                from fastdit.parallel.context_parallel import layout_key

                # Last: a whole-call graph records every hook; block graphs sit inside the cache's block hooks.
                applied.undo.append(
                    apply_cuda_graph(
                        module, compile_config, adapter=found, cached=cache is not None, context_key=layout_key(module)
                    )
                )
    except BaseException:
        for undo in reversed(applied.undo):
            undo()
        raise
    setattr(target, _STATE_ATTR, applied)
    return target


def disable(target: Any) -> Any:
    """Undo :func:`accelerate`: every hook and patch is removed; the model behaves exactly as before."""
    applied: _Applied | None = getattr(target, _STATE_ATTR, None)
    if applied is None:
        raise ValueError(f"{type(target).__name__} is not accelerated by fastdit")
    for undo in reversed(applied.undo):
        undo()
    delattr(target, _STATE_ATTR)
    return target


def reset(target: Any) -> None:
    """Forget all cached state now (the next call starts a fresh run). Runs also reset by themselves."""
    applied: _Applied | None = getattr(target, _STATE_ATTR, None)
    if applied is None:
        return
    for module in applied.transformers.values():
        engine = cache_engine(module)
        if engine is not None:
            engine.tracker.reset()


@dataclass
class Summary:
    """What fastdit did in the last run, per transformer component."""

    transformers: dict[str, dict[str, Any]]

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
            "num_cached_steps": self.num_cached_steps,
            "blocks_computed_fraction": self.blocks_computed_fraction,
        }

    def __str__(self) -> str:
        lines = []
        for name, info in self.transformers.items():
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
        return "\n".join(lines)

    def to_json(self) -> str:
        """One-line JSON."""
        return json.dumps(self.to_dict())


def summary(target: Any) -> Summary:
    """Statistics of the last run of an accelerated pipeline or transformer."""
    applied: _Applied | None = getattr(target, _STATE_ATTR, None)
    if applied is None:
        raise ValueError(f"{type(target).__name__} is not accelerated by fastdit")
    out: dict[str, dict[str, Any]] = {}
    for name, module in applied.transformers.items():
        info: dict[str, Any] = {"class": type(module).__name__}
        runtime = applied.runtime
        if runtime is not None:
            info["parallel"] = {"rank": runtime.rank, "world_size": runtime.world_size, "layout": repr(runtime)}
        stats = cache_summary(module)
        if stats is not None:
            info["cache"] = stats
        graphs = graph_stats(module)
        if graphs is not None:
            info["cuda_graph"] = graphs
        out[name] = info
    return Summary(out)
