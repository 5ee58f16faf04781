"""Training-free step caching: DBCache/FBCache (+ TaylorSeer, step masks) and DBPrune, applied as hooks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fastdit.cache.hooks import CacheEngine, install, uninstall
from fastdit.cache.policy import Reducer
from fastdit.config import DBCache, DBPrune
from fastdit.models.base import ModelAdapter
from fastdit.models.validate import block_lists, check_adapter

__all__ = ["apply_cache", "cache_engine", "cache_summary"]

_ENGINE_ATTR = "_fastdit_cache_engine"


def apply_cache(
    transformer: torch.nn.Module,
    adapter: ModelAdapter,
    config: DBCache | DBPrune,
    *,
    reducer: Reducer | None = None,
) -> Callable[[], None]:
    """Install the cache described by ``config`` on ``transformer``.

    Args:
        transformer: The denoiser module (diffusers or third-party).
        adapter: Its adapter (block lists and patterns).
        config: A :class:`~fastdit.config.DBCache` or :class:`~fastdit.config.DBPrune`.
        reducer: Sums small tensors across ranks that share a sample (context/tensor parallelism) so every rank
            makes the same decision.

    Returns:
        A function that removes the cache again.
    """
    if getattr(transformer, _ENGINE_ATTR, None) is not None:
        raise ValueError(f"{type(transformer).__name__} already has a cache; call fastdit.disable first")
    check_adapter(transformer, adapter)
    groups = block_lists(transformer, adapter)
    if isinstance(config, DBPrune):
        from fastdit.cache.prune import install as install_prune
        from fastdit.cache.prune import uninstall as uninstall_prune

        engine: Any = install_prune(transformer, groups, config, adapter.timestep_arg, reducer)
        remove: Callable[..., None] = uninstall_prune
    else:
        engine = install(transformer, groups, config, adapter.timestep_arg, reducer)
        remove = uninstall
    undo_patch = adapter.patch(transformer) if adapter.patch is not None else None
    setattr(transformer, _ENGINE_ATTR, engine)

    def undo() -> None:
        remove(transformer, groups)
        if undo_patch is not None:
            undo_patch()
        delattr(transformer, _ENGINE_ATTR)

    return undo


def cache_engine(transformer: torch.nn.Module) -> CacheEngine | None:
    """The cache engine installed on ``transformer``, if any."""
    return getattr(transformer, _ENGINE_ATTR, None)


def cache_summary(transformer: torch.nn.Module) -> dict[str, Any] | None:
    """Statistics of the last run: per branch, the cached steps, residual diffs and blocks computed."""
    engine = cache_engine(transformer)
    if engine is None:
        return None
    branches = {name: state.summary() for name, state in engine.tracker.report().items()}
    computed = sum(b["blocks_computed"] for b in branches.values())
    total = sum(b["blocks_total"] for b in branches.values())
    return {
        "config": type(engine.config).__name__,
        "runs": engine.tracker.runs,
        "branches": branches,
        "num_cached_steps": sum(b["num_cached_steps"] for b in branches.values()),
        "blocks_computed": computed,
        "blocks_total": total,
        "blocks_computed_fraction": computed / total if total else 1.0,
    }
