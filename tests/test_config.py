"""Config dataclasses reject bad values with the field and value named."""

from __future__ import annotations

import dataclasses

import pytest

import fastdit
from fastdit.config import config_fields


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (lambda: fastdit.DBCache(fn=0), r"DBCache.fn=0"),
        (lambda: fastdit.DBCache(bn=-1), r"DBCache.bn=-1"),
        (lambda: fastdit.DBCache(threshold=-0.1), r"DBCache.threshold=-0.1"),
        (lambda: fastdit.DBCache(warmup_interval=0), r"DBCache.warmup_interval=0"),
        (lambda: fastdit.DBCache(max_continuous_cached_steps=0), r"DBCache.max_continuous_cached_steps=0"),
        (lambda: fastdit.DBCache(taylorseer=2), r"DBCache.taylorseer=2"),
        (lambda: fastdit.TaylorSeer(order=3), r"TaylorSeer.order=3"),
        (lambda: fastdit.StepMask(compute_steps=(-1,)), r"StepMask.compute_steps=\(-1,\)"),
        (lambda: fastdit.StepMask(policy="sometimes"), r"StepMask.policy='sometimes'"),
        (lambda: fastdit.StepMask.preset("turbo", 28), r"StepMask.preset='turbo'"),
        (lambda: fastdit.DBPrune(max_pruned_ratio=1.5), r"DBPrune.max_pruned_ratio=1.5"),
        (lambda: fastdit.Parallel(ulysses=0), r"Parallel.ulysses=0"),
        (lambda: fastdit.Parallel(cfg=3), r"Parallel.cfg=3"),
        (lambda: fastdit.Attention(backend="magic"), r"Attention.backend='magic'"),
    ],
)
def test_bad_values_name_field_and_value(factory, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        factory()


def test_configs_are_frozen_and_keyword_only() -> None:
    config = fastdit.DBCache()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.fn = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        fastdit.DBCache(1)  # type: ignore[misc]


def test_fbcache_is_f1b0() -> None:
    config = fastdit.FBCache(threshold=0.2)
    assert (config.fn, config.bn, config.threshold) == (1, 0, 0.2)


def test_every_field_is_documented() -> None:
    for cls in (fastdit.DBCache, fastdit.DBPrune, fastdit.TaylorSeer, fastdit.StepMask, fastdit.Parallel,
                fastdit.Compile, fastdit.Attention):  # fmt: skip
        for name, _, doc in config_fields(cls):
            assert doc, f"{cls.__name__}.{name} has no doc"


def test_unavailable_options_raise_not_implemented() -> None:
    pipe = object()
    with pytest.raises(NotImplementedError, match="tp parallelism"):
        fastdit.accelerate(pipe, parallel=fastdit.Parallel(tp=2))
    with pytest.raises(NotImplementedError, match="flash"):
        fastdit.accelerate(pipe, attention=fastdit.Attention(backend="flash"))
