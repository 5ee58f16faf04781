"""Training-free step caching: DBCache/FBCache (+ TaylorSeer, step masks), MagCache, TeaCache and DBPrune, as layer
hooks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fastdit.cache.policy import Reducer
from fastdit.cache.reuse import install_reuse
from fastdit.config import CacheConfig, DBCache, DBPrune, MagCache, MagCalibrations, TeaCache
from fastdit.errors import FieldError
from fastdit.hooks.state import Applied
from fastdit.models.base import CachePlan
from fastdit.models.validate import resolve_block_groups, resolve_interleaved

__all__ = ["apply_cache", "cache_summary"]


def apply_cache(
    transformer: torch.nn.Module,
    plan: CachePlan,
    config: CacheConfig,
    *,
    reducer: Reducer | None = None,
) -> Applied:
    """Install the cache described by ``config`` on ``transformer``.

    Args:
        transformer: The denoiser module (diffusers or third-party).
        plan: Its block lists and timestep argument (:attr:`ModelAdapter.cache_plan`).
        config: A :class:`~fastdit.config.DBCache`, :class:`~fastdit.config.MagCache`,
            :class:`~fastdit.config.TeaCache` or :class:`~fastdit.config.DBPrune`.
        reducer: Sums small tensors across ranks that share a sample (context/tensor parallelism) so every rank
            makes the same decision.

    Returns:
        The undo (call it to remove the cache), carrying the engine as its ``state``.
    """
    installer = _POLICIES.get(type(config))
    if installer is None:  # exact classes: a subclass may change what the engine relies on
        raise TypeError(f"cache={config!r}: expected one of {', '.join(c.__name__ for c in _POLICIES)}")
    if isinstance(config, TeaCache) and config.signal == "spectral" and plan.latent is None:
        # Refused before the module is looked at: no grid is declared whatever the transformer holds.
        raise FieldError(
            "TeaCache",
            "signal",
            config.signal,
            f"the {plan.family!r} adapter declares no latent grid to filter (ModelAdapter.latent): "
            f"{plan.no_latent or 'not declared yet'} Use signal='input'",
        )
    groups = resolve_block_groups(transformer, plan.block_groups, plan.family)
    engine, undo = installer(transformer, groups, plan, config, reducer)
    if not plan.step_invariant:
        return Applied(undo, engine)
    try:
        engine.reuse, undo_reuse = install_reuse(transformer, plan.step_invariant, lambda: engine.tracker.epoch)
    except BaseException:
        undo()
        raise

    def remove() -> None:
        undo_reuse()
        undo()

    return Applied(remove, engine)


def _install_prune(transformer, groups, plan: CachePlan, config: DBPrune, reducer) -> tuple[Any, Any]:
    from fastdit.cache.prune import install

    return install(transformer, groups, config, plan.timestep_arg, reducer, plan.unstepped_calls, plan.timestep_reduce)


def _install_blocks(
    transformer,
    groups,
    plan: CachePlan,
    config: DBCache | MagCache | TeaCache,
    reducer,
    engine_class: type | None = None,
) -> tuple[Any, Any]:
    from fastdit.cache.hooks import install

    interleaved = resolve_interleaved(transformer, plan.block_groups, plan.family)
    return install(
        transformer,
        groups,
        config,
        plan.timestep_arg,
        reducer,
        interleaved,
        plan.unstepped_calls,
        engine_class,
        plan.timestep_reduce,
        plan.latent,
        plan.family,
    )


def _install_magcache(transformer, groups, plan: CachePlan, config: MagCache, reducer) -> tuple[Any, Any]:
    from fastdit.cache.magcache import MagCacheEngine

    if isinstance(config.calibration, MagCalibrations):  # accelerate() picks each denoiser's own one first
        raise TypeError(
            "apply_cache installs on one denoiser: give it that denoiser's calibration "
            "(fastdit.cache.magcache.denoiser_config(config, component))"
        )

    return _install_blocks(transformer, groups, plan, config, reducer, MagCacheEngine)


def _install_teacache(transformer, groups, plan: CachePlan, config: TeaCache, reducer) -> tuple[Any, Any]:
    from fastdit.cache.teacache import TeaCacheEngine

    return _install_blocks(transformer, groups, plan, config, reducer, TeaCacheEngine)


# Each cache policy's installer, by its config class (exact): (transformer, groups, plan, config, reducer) ->
# (engine, undo). Adding a policy is one entry here plus its engine module.
_POLICIES: dict[type, Callable[..., tuple[Any, Any]]] = {
    DBCache: _install_blocks,
    MagCache: _install_magcache,
    TeaCache: _install_teacache,
    DBPrune: _install_prune,
}


def cache_summary(engine: Any) -> dict[str, Any]:
    """Statistics of the last run of ``engine``: per branch, the cached steps, residual diffs and blocks computed."""
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
        "step_invariant": engine.reuse.summary() if engine.reuse is not None else None,
    }
