"""Config dataclasses reject bad values with the field and value named."""

from __future__ import annotations

import dataclasses
import math
import pickle
import types
import typing
from typing import Any

import pytest

import fastdit
from fastdit.config import (
    ActivationScales,
    Attention,
    Compile,
    DBCache,
    DBPrune,
    Loading,
    Offload,
    Parallel,
    Quantize,
    StepMask,
    TaylorSeer,
    config_fields,
)
from fastdit.errors import FieldError, FieldsError

CONFIG_CLASSES: tuple[type, ...] = (
    TaylorSeer,
    StepMask,
    DBCache,
    DBPrune,
    Parallel,
    Compile,
    Attention,
    Loading,
    Quantize,
    ActivationScales,
    Offload,
)
FIELDS = [(cls, f.name) for cls in CONFIG_CLASSES for f in dataclasses.fields(cls)]


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
        (lambda: fastdit.Loading(mode="rank-0"), r"Loading.mode='rank-0': must be one of 'every-rank', 'rank0'"),
        (lambda: fastdit.Loading(timeout_s=0), r"Loading.timeout_s=0"),
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
                fastdit.Compile, fastdit.Attention, fastdit.Loading, fastdit.Quantize,
                fastdit.ActivationScales, fastdit.Offload):  # fmt: skip
        for name, _, doc in config_fields(cls):
            assert doc, f"{cls.__name__}.{name} has no doc"


@pytest.mark.parametrize(("cls", "name"), FIELDS, ids=[f"{cls.__name__}.{name}" for cls, name in FIELDS])
def test_every_field_is_type_checked(cls: type, name: str) -> None:
    # Derived from the dataclass fields: a field added without a check fails here.
    with pytest.raises(FieldError) as info:
        cls(**{name: object()})
    assert (info.value.owner, info.value.field) == (cls.__name__, name)


def _wrong_values(hint: Any) -> list[Any]:
    """Values of a plausible but wrong type for a field of type ``hint`` (what a config file or a flag might give)."""
    args = typing.get_args(hint)
    union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    members = [a for a in args if a is not type(None)] if union else [hint]
    base = members[0]
    wrong: list[Any] = [] if union and type(None) in args else [None]
    if typing.get_origin(base) is typing.Literal:
        base = str
    if base is bool:
        return [*wrong, "false", "no", 0, 1]
    if base is int:
        return [*wrong, 1.0, True, "1"]
    if base is float:
        return [*wrong, True, "0.1", math.nan, math.inf, -math.inf]
    if base is str:
        return [*wrong, 1, b"sdpa"]
    if typing.get_origin(base) is tuple and typing.get_args(base)[0] is str:  # patterns; one string is one pattern
        return [*wrong, (1.0,), (True,), ("",), ("a", None), 3, b"a"]
    if typing.get_origin(base) is tuple and typing.get_args(base)[0] is float:  # maxima: finite, not negative
        return [*wrong, ("1",), (True,), (math.nan,), (-1.0,), 3]
    if typing.get_origin(base) is tuple:
        return [*wrong, (1.0,), (True,), ("0",), "01", 3]
    if base is ActivationScales:
        return [*wrong, 1, "scales.json", {"transformer.proj": 1.0}]
    if base in (TaylorSeer, StepMask):
        other = StepMask() if base is TaylorSeer else TaylorSeer()
        return [*wrong, 1, "1", {"order": 1}, other]
    raise AssertionError(f"no wrong values for hint {hint!r}: add them here")


WRONG = [
    (cls, name, value)
    for cls in CONFIG_CLASSES
    for name, hint in typing.get_type_hints(cls).items()
    if name in {f.name for f in dataclasses.fields(cls)}
    for value in _wrong_values(hint)
]


@pytest.mark.parametrize(
    ("cls", "name", "value"), WRONG, ids=[f"{cls.__name__}.{name}={value!r}" for cls, name, value in WRONG]
)
def test_wrong_types_are_refused_naming_the_field(cls: type, name: str, value: Any) -> None:
    with pytest.raises(FieldError) as info:
        cls(**{name: value})
    assert (info.value.owner, info.value.field) == (cls.__name__, name)
    assert value != value or info.value.value == value  # (NaN is not equal to itself)
    assert str(info.value).startswith(f"{cls.__name__}.{name}=")


@pytest.mark.parametrize(
    "factory",
    [
        lambda: DBCache(separate_cfg="no"),
        lambda: Parallel(comm_fp8="false"),
        lambda: Parallel(text_encoder="yes"),
        lambda: TaylorSeer(order=1.0),
        lambda: DBCache(threshold=math.nan),
        lambda: DBPrune(threshold=math.inf),
        lambda: StepMask(compute_steps=(0, 1.0)),
        lambda: Compile(mode=3),
        lambda: Compile(dynamic="auto"),
        lambda: Attention(gqa=None),
    ],
)
def test_reported_cases_are_refused(factory: Any) -> None:
    with pytest.raises(FieldError):
        factory()


def test_good_values_of_every_kind_are_accepted() -> None:
    assert DBCache(threshold=0, separate_cfg=True, max_cached_steps=0).threshold == 0  # an int is a number
    assert StepMask(compute_steps=[0, 2]).compute_steps == (0, 2)  # a list becomes a tuple (hashable)
    assert StepMask(compute_steps=range(2)).compute_steps == (0, 1)
    assert Compile(mode="max-autotune-no-cudagraphs", dynamic=False).dynamic is False
    assert Parallel(comm_fp8=True, ulysses=2).comm_fp8 is True
    assert DBPrune(max_pruned_ratio=1).max_pruned_ratio == 1


def test_field_errors_are_value_errors_with_the_usual_message() -> None:
    with pytest.raises(ValueError, match=r"^Parallel\.cfg=3: must be 1 or 2$") as info:
        Parallel(cfg=3)
    assert isinstance(info.value, FieldError) and info.value.value == 3


def test_a_field_without_a_check_is_a_programming_error() -> None:
    from fastdit.config import _check_fields, _integer

    @dataclasses.dataclass(frozen=True)
    class Partial:
        checked: int = 1
        forgotten: int = 2

    with pytest.raises(TypeError, match="forgotten"):
        _check_fields(Partial(), checked=_integer(0))


def test_a_refused_combination_names_every_field() -> None:
    with pytest.raises(FieldsError, match=r"^Compile\(mode='max-autotune', cuda_graph=True\): ") as info:
        Compile(mode="max-autotune", cuda_graph=True)
    assert info.value.fields == {"mode": "max-autotune", "cuda_graph": True}
    assert (info.value.owner, info.value.field) == ("Compile", "mode")  # still a FieldError: its first field
    copy = pickle.loads(pickle.dumps(info.value))  # errors cross worker processes
    assert (type(copy), str(copy), copy.fields) == (FieldsError, str(info.value), info.value.fields)
