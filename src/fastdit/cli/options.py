"""Flags shared by ``generate`` and ``bench``, derived from the config dataclasses rather than written out by hand.

One cache flag per field of :class:`~fastdit.config.DBCache` and :class:`~fastdit.config.DBPrune`
(``--cache-fn``, ``--cache-threshold``, ``--cache-warmup-steps``, ..., plus ``--taylorseer ORDER`` and
``--step-mask PRESET|LIST``); ``--parallel`` takes ``key=value`` pairs named after the fields of
:class:`~fastdit.config.Parallel`. Values are read as text and checked in the command, so a bad value is reported as
one line naming the flag (exit code 2) rather than as an argparse usage dump. A value a config refuses comes back as a
:class:`~fastdit.errors.FieldError`; :func:`field_error_message` names the flags the user passed for its
``(owner, field)``, never by reading the message.
"""

from __future__ import annotations

import argparse
import math
import os
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from functools import cache
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from fastdit.cache.files import default_cache_file, load_cache_file
from fastdit.cache.presets import (
    CACHE_PRESETS,
    DEFAULT_CACHE_PRESET,
    NO_CACHE,
    cache_config,
    get_cache_preset,
    override_config,
)
from fastdit.cli import CLIError
from fastdit.cli.fields import CALL_FLAGS, cli_error, field_message
from fastdit.config import (
    ATTENTION_BACKENDS,
    QUANTIZE_MODES,
    STEP_MASK_PRESETS,
    Attention,
    DBCache,
    DBPrune,
    Fuse,
    Offload,
    Parallel,
    Quantize,
    StepMask,
    TaylorSeer,
    TeaCache,
    config_fields,
)
from fastdit.errors import FieldError, FieldsError
from fastdit.process import choose_device
from fastdit.session import MAX_SEED, ModelSource, call_parameters, import_pipeline_class, resolve_model
from fastdit.session import check_size as check_call_size

__all__ = [
    "DTYPES",
    "LIMITS",
    "CacheFlag",
    "add_call_arguments",
    "add_model_arguments",
    "cache_flags",
    "cache_from_args",
    "cache_from_spec",
    "call_values",
    "check_cache_fits",
    "check_call_numbers",
    "check_positive",
    "check_size",
    "configure_threads",
    "field_error_message",
    "is_file_spec",
    "output_path",
    "parse_attention",
    "parse_parallel",
    "parse_quantize",
    "parse_seeds",
    "parse_value",
    "resolve_device",
    "resolve_dtype",
    "resolve_source",
]

DTYPES: Mapping[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""``--dtype`` choices besides ``auto`` (bfloat16 on CUDA, float32 on CPU)."""

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_NONE = frozenset({"none", "auto", "off"})


def _scalar(hint: Any, text: str) -> Any:
    if hint is TaylorSeer:
        return int(text)  # an order; 0 means off (see fastdit.cache.presets.taylorseer_from)
    if hint is StepMask:
        if text in STEP_MASK_PRESETS:
            return text
        return tuple(int(part) for part in text.replace("+", ",").split(",") if part.strip())
    if hint is bool:
        lowered = text.lower()
        if lowered not in _TRUE | _FALSE:
            raise ValueError("expected true or false")
        return lowered in _TRUE
    if hint is int:
        return int(text)
    if hint is float:
        return float(text)
    return text


def parse_value(hint: Any, text: str) -> Any:
    """Read a config field's value from text, following its type hint.

    ``int``, ``float``, ``bool`` (true/false/yes/no/on/off/1/0) and ``X | None`` (``none``/``auto``/``off`` for
    ``None``, but ``off`` is false for ``bool | None``); :class:`TaylorSeer` fields take an order,
    :class:`StepMask` fields a preset name or step indices.

    Raises:
        ValueError: If ``text`` does not fit ``hint``.
    """
    text = text.strip()
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        members = [m for m in typing.get_args(hint) if m is not type(None)]
        # For ``bool | None``, "off" is False: reading it as None (automatic) could mean the opposite.
        if text.lower() in _NONE and not (members == [bool] and text.lower() in _FALSE):
            return None
        hint = members[0]
    try:
        return _scalar(hint, text)
    except ValueError:
        expected = {
            TaylorSeer: "an order (1 or 2, 0 for off)",
            StepMask: f"one of {', '.join(STEP_MASK_PRESETS)} or step indices like 0,1,2",
            int: "an integer",
            float: "a number",
            bool: "true or false",
        }.get(hint, "a value")
        raise ValueError(f"expected {expected}") from None


@dataclass(frozen=True)
class CacheFlag:
    """A command-line flag for one cache config field (or one field of a nested config such as TaylorSeer).

    Attributes:
        field: The key, e.g. ``"warmup_steps"``; for a nested field ``"<parent>_<subfield>"``.
        flag: The flag, e.g. ``"--cache-warmup-steps"``.
        hint: The field's type hint (used to read the value).
        owners: Names of the config classes that have the (parent) field.
        doc: The field's one-line documentation.
        parent: For a nested field, the cache field holding the nested config (``"taylorseer"``).
        subfield: For a nested field, its name inside the nested config (``"forecast_decision"``).
    """

    field: str
    flag: str
    hint: Any
    owners: tuple[str, ...]
    doc: str
    parent: str | None = None
    subfield: str | None = None

    @property
    def dest(self) -> str:
        """The argparse destination."""
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def metavar(self) -> str:
        """What ``--help`` shows as the value."""
        if self.field == "taylorseer":
            return "ORDER"
        if self.field == "step_mask":
            return "PRESET|LIST"
        members = [m for m in typing.get_args(self.hint) if m is not type(None)]
        if typing.get_origin(self.hint) is typing.Literal:
            return "|".join(members)
        if self.hint is bool or members == [bool]:
            return "true|false" if self.hint is bool else "true|false|auto"
        return (self.subfield or self.field).upper()


# Nested configs read better as their own word: ``--taylorseer ORDER`` sets the whole config from its main field,
# ``--taylorseer-<field>`` sets each of its other fields.
_NESTED: Mapping[str, tuple[str, type, str]] = {
    "taylorseer": ("--taylorseer", TaylorSeer, "order"),
    "step_mask": ("--step-mask", StepMask, "compute_steps"),
}


def _nested_flags(name: str, owners: tuple[str, ...]) -> list[CacheFlag]:
    flag, cls, main_field = _NESTED[name]
    hints = typing.get_type_hints(cls)
    return [
        CacheFlag(
            field=f"{name}_{sub}",
            flag=f"{flag}-{sub.replace('_', '-')}",
            hint=hints[sub],
            owners=owners,
            doc=doc,
            parent=name,
            subfield=sub,
        )
        for sub, _default, doc in config_fields(cls)
        if sub != main_field
    ]


@cache
def cache_flags() -> tuple[CacheFlag, ...]:
    """One flag per field of DBCache and DBPrune (shared fields get one flag) and per field of their nested configs.

    A flag also sets the TeaCache field of its name (``--cache video --cache-decide-ahead true``), so TeaCache is
    among its owners: its help does not call it another class's only, and a value TeaCache refuses blames the flag.
    """
    hints = {cls: typing.get_type_hints(cls) for cls in (DBCache, DBPrune)}
    docs: dict[str, str] = {}
    owners: dict[str, list[str]] = {}
    for cls in (DBCache, DBPrune):
        for name, _default, doc in config_fields(cls):
            docs.setdefault(name, doc)
            owners.setdefault(name, []).append(cls.__name__)
    for name, _default, _doc in config_fields(TeaCache):
        if name in owners:
            owners[name].append(TeaCache.__name__)
    flags: list[CacheFlag] = []
    for name, doc in docs.items():
        flag = _NESTED[name][0] if name in _NESTED else f"--cache-{name.replace('_', '-')}"
        hint = hints[DBCache].get(name, hints[DBPrune].get(name))
        flags.append(CacheFlag(field=name, flag=flag, hint=hint, owners=tuple(owners[name]), doc=doc))
        if name in _NESTED:
            flags.extend(_nested_flags(name, tuple(owners[name])))
    return tuple(flags)


def _field_flag(name: str) -> CacheFlag | None:
    return next((f for f in cache_flags() if f.field == name), None)


@cache
def _cache_field_flags() -> Mapping[tuple[str, str], CacheFlag]:
    """``(config class name, field)`` → the cache flag that sets it, for DBCache, DBPrune and their nested configs."""
    table: dict[tuple[str, str], CacheFlag] = {}
    for flag in cache_flags():
        if flag.parent is not None:
            table[(_NESTED[flag.parent][1].__name__, flag.subfield or "")] = flag
            continue
        table.update({(owner, flag.field): flag for owner in flag.owners})
        if flag.field in _NESTED:  # ``--taylorseer ORDER`` and ``--step-mask LIST`` set the nested main field
            _, cls, main_field = _NESTED[flag.field]
            table[(cls.__name__, main_field)] = flag
    return MappingProxyType(table)


def _defaults(cls: type) -> dict[str, Any]:
    return {f.name: f.default for f in fields(cls)}


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--cache[=PRESET]`` and one flag per cache config field (values are checked by :func:`cache_from_args`)."""
    group = parser.add_argument_group("step cache (any field flag implies --cache)")
    presets = "; ".join(f"{p.name}: {p.doc}" for p in CACHE_PRESETS.values())
    group.add_argument(
        "--cache",
        nargs="?",
        const=DEFAULT_CACHE_PRESET,
        metavar="PRESET",
        help=f"cache the transformer's steps; PRESET defaults to {DEFAULT_CACHE_PRESET!r} ({presets}); "
        f"{FROM_FILE}PATH reads a cache file, {CALIBRATED!r} the file fastdit calibrate wrote for this model".replace(
            "%", "%%"
        ),
    )
    db, prune = _defaults(DBCache), _defaults(DBPrune)
    for flag in cache_flags():
        where = "" if len(flag.owners) > 1 else f" [{flag.owners[0]} only]"
        if flag.parent is not None:
            default = _defaults(_NESTED[flag.parent][1])[flag.subfield]
        else:
            default = db.get(flag.field, prune.get(flag.field))
        group.add_argument(
            flag.flag,
            dest=flag.dest,
            metavar=flag.metavar,
            help=f"{flag.doc}{where} [default: the preset's; class default {default!r}]".replace("%", "%%"),
        )


def _check_preset(name: str, option: str) -> None:
    try:
        get_cache_preset(name)
    except LookupError as error:
        hint = ""
        if _is_model_name(name):
            # ``--cache`` takes an optional value, so ``--cache flux`` reads the model name as a preset.
            hint = f"; to cache model {name!r}, put it first: fastdit generate {name} --cache"
        raise CLIError(f"argument {option}: {error}{hint}") from None


def _is_model_name(name: str) -> bool:
    from fastdit.models.registry import get_preset

    try:
        get_preset(name)
    except LookupError:
        return False
    return True


FROM_FILE = "from:"
"""``--cache from:PATH``: the configuration a cache file holds (``fastdit calibrate`` writes them)."""
CALIBRATED = "calibrated"
"""``--cache calibrated``: the file ``fastdit calibrate MODEL`` wrote by default for this model and step count."""


def is_file_spec(preset: str) -> bool:
    """Whether a ``--cache`` value names a cache file (``from:PATH`` or ``calibrated``) rather than a preset."""
    return preset == CALIBRATED or preset.startswith(FROM_FILE)


def _from_file(preset: str, num_steps: int | None, option: str, model: str | None) -> tuple[Any, str]:
    """The configuration of a cache file, and where it came from (for messages)."""
    if preset == CALIBRATED:
        if model is None:
            raise CLIError(f"argument {option}: {CALIBRATED!r} needs the model the calibration was made for")
        path = default_cache_file(model, num_steps)
        if not path.exists():
            raise CLIError(
                f"argument {option}: no calibration of {model!r} for {num_steps} steps at {path}; write one with "
                f"fastdit calibrate {model} --target-psnr 32 (or give --cache from:PATH)"
            )
    else:
        path = preset.removeprefix(FROM_FILE)
        if not path:
            raise CLIError(f"argument {option}: {FROM_FILE}PATH needs a path")
    try:
        return load_cache_file(path, num_steps=num_steps).config, f"file {path}"
    except (OSError, ValueError) as error:  # FieldError is a ValueError: a value the config refuses
        raise CLIError(f"argument {option}: {error}") from None


def _build(
    preset: str, overrides: dict[str, tuple[str, Any]], num_steps: int | None, option: str, model: str | None = None
) -> Any:
    """Apply overrides one by one so an invalid value is blamed on the flag that gave it."""
    if is_file_spec(preset):
        return _build_from_file(preset, overrides, num_steps, option, model)
    _check_preset(preset, option)
    applied: dict[str, Any] = {}
    config = cache_config(preset, num_steps=num_steps)
    nested = {name: item for name, item in overrides.items() if _field_flag(name).parent is not None}
    for name, (label, value) in overrides.items():
        if name in nested:
            continue
        applied[name] = value
        try:
            config = cache_config(preset, num_steps=num_steps, **applied)
        except FieldError as error:
            raise CLIError(f"argument {_blame(error, overrides, option)}: {error}") from None
        except ValueError as error:  # a short form cache_config cannot read: the override just applied
            raise CLIError(f"argument {label}: {error}") from None
    for name, (label, value) in nested.items():
        config = _set_nested(config, _field_flag(name), label, value)
    return config


def _build_from_file(
    preset: str, overrides: dict[str, tuple[str, Any]], num_steps: int | None, option: str, model: str | None
) -> Any:
    config, origin = _from_file(preset, num_steps, option, model)
    nested = {name: item for name, item in overrides.items() if _field_flag(name).parent is not None}
    for name, (label, value) in overrides.items():
        if name in nested:
            continue
        try:
            config = override_config(config, num_steps=num_steps, origin=origin, **{name: value})
        except ValueError as error:
            raise CLIError(f"argument {label}: {error}") from None
    for name, (label, value) in nested.items():
        config = _set_nested(config, _field_flag(name), label, value)
    return config


def _blame(error: FieldError, overrides: Mapping[str, tuple[str, Any]], option: str) -> str:
    """The override that set the refused field, by ``(owner, field)``; the preset (``option``) when none did."""
    flag = _cache_field_flags().get((error.owner, error.field))
    return overrides[flag.field][0] if flag is not None and flag.field in overrides else option


def _set_nested(config: Any, flag: CacheFlag, label: str, value: Any) -> Any:
    parent, sub = flag.parent, flag.subfield
    assert parent is not None and sub is not None
    if parent not in {f.name for f in fields(config)}:
        raise CLIError(f"argument {label}: {type(config).__name__} has no {parent}")
    current = getattr(config, parent)
    if current is None:
        raise CLIError(f"argument {label}: {parent} is off in this configuration; turn it on with {_NESTED[parent][0]}")
    try:
        return replace(config, **{parent: replace(current, **{sub: value})})
    except FieldError as error:
        raise CLIError(f"argument {label}: {error}") from None


def cache_from_args(args: argparse.Namespace, num_steps: int | None, model: str | None = None) -> Any:
    """The cache configuration asked for by ``--cache`` and the field flags (``None``: no cache).

    ``--cache from:PATH`` reads a cache file, ``--cache calibrated`` the default file of ``model`` (the name
    ``fastdit calibrate`` was given); field flags override what the file holds.

    Raises:
        CLIError: On an unknown preset, a value that does not parse, a field the preset's config lacks, or a value
            the config rejects; the message names the flag.
    """
    overrides: dict[str, tuple[str, Any]] = {}
    for flag in cache_flags():
        text = getattr(args, flag.dest, None)
        if text is None:
            continue
        try:
            overrides[flag.field] = (f"{flag.flag} {text}", parse_value(flag.hint, text))
        except ValueError as error:
            raise CLIError(f"argument {flag.flag}: invalid value {text!r}: {error}") from None
    preset = args.cache
    if preset is None:
        if not overrides:
            return None
        preset = DEFAULT_CACHE_PRESET
    if preset == NO_CACHE and overrides:
        raise CLIError(f"argument --cache {NO_CACHE}: cannot be combined with {', '.join(sorted(overrides))} flags")
    return _build(preset, overrides, num_steps, f"--cache {preset}", model)


def _assignments(text: str) -> list[str]:
    """Split ``a=1,b=2,3`` on commas; a piece without ``=`` continues the previous value (``step_mask=0,1,2``)."""
    pieces: list[str] = []
    for piece in text.split(","):
        if "=" not in piece and pieces and "=" in pieces[-1]:
            pieces[-1] += "," + piece
        else:
            pieces.append(piece)
    return [p.strip() for p in pieces if p.strip()]


def cache_from_spec(spec: str, num_steps: int | None, option: str = "--configs", model: str | None = None) -> Any:
    """Read one benchmark configuration: ``PRESET``, ``PRESET,field=value,...`` or ``field=value,...``.

    ``PRESET`` may also be ``from:PATH`` (a cache file) or ``calibrated`` (``model``'s default cache file).

    Field names are those of the config dataclasses (``fn``, ``bn``, ``threshold``, ``warmup_steps``,
    ``taylorseer``, ``step_mask``, ...); without a preset the fields override :data:`DEFAULT_CACHE_PRESET`.

    Raises:
        CLIError: On an unknown preset, an unknown or repeated field, or an invalid value.
    """
    pieces = _assignments(spec)
    if not pieces:
        raise CLIError(f"argument {option}: empty configuration in {spec!r}")
    preset = DEFAULT_CACHE_PRESET
    if "=" not in pieces[0]:
        preset = pieces.pop(0)
    overrides: dict[str, tuple[str, Any]] = {}
    for piece in pieces:
        key, sep, text = piece.partition("=")
        name = key.strip().replace("-", "_")
        flag = _field_flag(name)
        if not sep or flag is None:
            known = ", ".join(f.field for f in cache_flags())
            raise CLIError(f"argument {option}: {piece!r} in {spec!r} is not field=value with a field in: {known}")
        if name in overrides:  # the later one would silently win
            raise CLIError(f"argument {option}: {piece!r} in {spec!r}: {name} is given twice")
        try:
            overrides[name] = (f"{option} {spec!r}", parse_value(flag.hint, text))
        except ValueError as error:
            raise CLIError(f"argument {option}: {piece!r} in {spec!r}: {error}") from None
    if preset == NO_CACHE and overrides:
        raise CLIError(f"argument {option}: {spec!r}: preset {NO_CACHE!r} takes no fields")
    return _build(preset, overrides, num_steps, f"{option} {spec!r}", model)


def parse_seeds(option: str, text: str) -> list[int]:
    """Read a comma-separated list of non-negative seeds (``--seeds 0,1``).

    Raises:
        CLIError: On a piece that is not an integer, a negative seed or an empty list, naming ``option``.
    """
    try:
        seeds = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise CLIError(f"argument {option} {text}: expected comma-separated integers") from None
    if not seeds or min(seeds) < 0:
        raise CLIError(f"argument {option} {text}: expected one or more non-negative integers")
    for seed in seeds:
        check_positive("--seeds", seed, allow_zero=True)  # the seed limit, whichever option gave it
    return seeds


def parse_parallel(text: str, num_processes: int) -> Parallel:
    """Read ``--parallel ulysses=2,ring=1`` (keys are :class:`Parallel` fields; ``vae`` alone means ``vae=true``).

    Raises:
        CLIError: On bad syntax, an unknown or repeated key, an invalid degree, or degrees whose product differs from
            the number of processes.
    """
    hints = typing.get_type_hints(Parallel)
    values: dict[str, Any] = {}
    pieces: dict[str, str] = {}
    for piece in (p.strip() for p in text.split(",")):
        key, sep, value = piece.partition("=")
        key = key.strip().replace("-", "_")
        if key not in hints or (not sep and hints[key] is not bool):
            raise CLIError(
                f"argument --parallel: {piece!r} in {text!r} is not key=value with a key in: {', '.join(hints)}"
            )
        if key in values:  # ``ulysses=2,ulysses=1``: the later one would silently win
            raise CLIError(f"argument --parallel: {piece!r} in {text!r}: {key} is given twice ({pieces[key]!r})")
        try:
            values[key] = parse_value(hints[key], value) if sep else True
        except ValueError as error:
            raise CLIError(f"argument --parallel: {piece!r} in {text!r}: {error}") from None
        pieces[key] = piece
    try:
        parallel = Parallel(**values)
    except FieldError as error:
        raise CLIError(f"argument --parallel {pieces.get(error.field, text)}: {error}") from None
    if parallel.world_size != num_processes:
        raise CLIError(
            f"argument --parallel {text}: needs {parallel.world_size} processes (cfg × ring × ulysses × tp), "
            f"this run has {num_processes}; launch with torchrun --nproc-per-node {parallel.world_size}"
        )
    return parallel


def parse_config_fields(cls: type, text: str, option: str) -> Any:
    """Read ``field=value,...`` (fields of the config dataclass ``cls``; empty: its defaults) into ``cls``.

    Raises:
        CLIError: On bad syntax, an unknown or repeated field, or an invalid value, naming ``option``.
    """
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for piece in _assignments(text):
        key, sep, value = piece.partition("=")
        name = key.strip().replace("-", "_")
        if not sep or name not in hints:
            raise CLIError(
                f"argument {option}: {piece!r} in {text!r} is not field=value with a field in: {', '.join(hints)}"
            )
        if name in values:
            raise CLIError(f"argument {option}: {piece!r} in {text!r}: {name} is given twice")
        try:
            values[name] = parse_value(hints[name], value.strip())
        except ValueError as error:
            raise CLIError(f"argument {option}: {piece!r} in {text!r}: {error}") from None
    try:
        return cls(**values)
    except FieldError as error:
        raise CLIError(f"argument {option} {text}: {error}") from None


def _scales_file(text: str) -> Any:
    """The scales in a file ``fastdit calibrate --scales`` wrote."""
    from fastdit.quantize import load_scales

    try:
        return load_scales(output_path(text))
    except OSError as error:
        raise ValueError(f"cannot read {text}: {error.strerror}") from None


def _quantize_value(key: str, text: str) -> Any:
    if key in ("include", "exclude"):  # patterns, comma-separated (a piece without '=' continues the value)
        return tuple(part.strip() for part in text.split(",") if part.strip())
    if key == "scales":  # a file fastdit calibrate --scales wrote
        return _scales_file(text)
    if key == "calibrate":
        raise ValueError("recording scales is `fastdit calibrate MODEL --scales PATH`")
    return parse_value(typing.get_type_hints(Quantize)[key], text)


def _attention_value(key: str, text: str) -> Any:
    if key == "scales":
        return _scales_file(text)
    if key == "calibrate":
        raise ValueError("recording attention scales is `fastdit calibrate MODEL --scales PATH`")
    return parse_value(typing.get_type_hints(Attention)[key], text)


def _parse_spec(
    cls: type, text: str, option: str, first: str, choices: tuple[str, ...], value: Callable[[str, str], Any]
) -> Any:
    """Read ``FIRST[,key=value...]`` or ``key=value,...`` into ``cls`` (``first``: the field a bare first piece
    sets; ``value(key, text)`` reads one value)."""
    names = [name for name, _default, _doc in config_fields(cls)]
    pieces = _assignments(text)
    if pieces and "=" not in pieces[0]:
        pieces[0] = f"{first}={pieces[0]}"
    values: dict[str, Any] = {}
    given: dict[str, str] = {}
    for piece in pieces:
        key, sep, text_value = piece.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in names:
            raise CLIError(
                f"argument {option}: {piece!r} in {text!r} is not {first.upper()} ({', '.join(choices)}) first or "
                f"key=value with a key in: {', '.join(names)}"
            )
        if key in values:
            raise CLIError(f"argument {option}: {piece!r} in {text!r}: {key} is given twice ({given[key]!r})")
        try:
            values[key] = value(key, text_value)
        except ValueError as error:
            raise CLIError(f"argument {option}: {piece!r} in {text!r}: {error}") from None
        given[key] = piece
    if not values:
        raise CLIError(f"argument {option}: empty specification {text!r}; give a {first}: {', '.join(choices)}")
    try:
        return cls(**values)
    except FieldError as error:
        raise CLIError(f"argument {option} {given.get(error.field, text)}: {error}") from None


def parse_quantize(text: str) -> Quantize:
    """Read ``--quantize MODE[,key=value...]`` or ``--quantize key=value,...`` (keys: :class:`Quantize` fields).

    ``include`` and ``exclude`` take comma-separated patterns (``exclude=*.norm1.linear,*.ff.*``); ``scales``
    takes the path of a file ``fastdit calibrate --scales`` wrote (``fp8_static,scales=flux.json``).

    Raises:
        CLIError: On bad syntax, an unknown or repeated key, or a value :class:`Quantize` refuses.
    """
    return _parse_spec(Quantize, text, "--quantize", "mode", QUANTIZE_MODES, _quantize_value)


def parse_attention(text: str) -> Attention:
    """Read ``--attention BACKEND[,key=value...]`` (keys: :class:`Attention` fields).

    ``scales`` takes the path of a file ``fastdit calibrate --scales`` wrote (``cudnn-fp8,scales=flux.json``: the
    attention inputs' static FP8 scales recorded there).

    Raises:
        CLIError: On bad syntax, an unknown or repeated key, or a value :class:`Attention` refuses.
    """
    return _parse_spec(Attention, text, "--attention", "backend", ATTENTION_BACKENDS, _attention_value)


# Fields set by the acceleration flags of ``generate`` (cli/generate.py builds Compile, CudaGraph and Attention
# from them).
_ACCELERATION_FIELD_FLAGS: Mapping[tuple[str, str], str] = MappingProxyType(
    {
        **{("Parallel", name): "--parallel" for name, _default, _doc in config_fields(Parallel)},
        ("Compile", "backend"): "--compile",
        ("Compile", "cuda_graph"): "--cuda-graph",
        ("Compile", "vae"): "--compile-vae",
        ("Compile", "outer"): "--compile-outer",
        **{("CudaGraph", name): "--cuda-graph" for name in ("device", "scope", "warmup", "max_graphs")},
        ("Attention", "backend"): "--attention",
        **{("Offload", name): "--offload" for name, _default, _doc in config_fields(Offload)},
        **{("Fuse", name): "--fuse" for name, _default, _doc in config_fields(Fuse)},
        **{("Quantize", name): "--quantize" for name, _default, _doc in config_fields(Quantize)},
        # fastdit.accelerate's own refusals of a whole argument (errors.ArgumentError)
        ("accelerate", "cache"): "--cache",
        ("accelerate", "parallel"): "--parallel",
        ("accelerate", "compile"): "--compile",
        ("accelerate", "cuda_graph"): "--cuda-graph",
        ("accelerate", "attention"): "--attention",
        ("accelerate", "offload"): "--offload",
        ("accelerate", "fuse"): "--fuse",
        ("accelerate", "quantize"): "--quantize",
    }
)

# Flags that choose a whole config: blamed when the user passed no flag of the refused field itself (the value then
# came from a preset or a default that those flags selected).
_CONFIG_FLAGS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        **{cls.__name__: ("--cache", "--configs") for cls in (DBCache, DBPrune, TaylorSeer, StepMask)},
        "Parallel": ("--parallel",),
        "Compile": ("--compile", "--compile-vae", "--compile-outer", "--cuda-graph"),
        "CudaGraph": ("--cuda-graph",),
        "Attention": ("--attention",),
        "Offload": ("--offload",),
        "Fuse": ("--fuse",),
        "Quantize": ("--quantize",),
    }
)


def _field_flag_name(owner: str, name: str) -> str | None:
    cache_flag = _cache_field_flags().get((owner, name))
    return cache_flag.flag if cache_flag is not None else _ACCELERATION_FIELD_FLAGS.get((owner, name))


def _given(args: argparse.Namespace, flag: str) -> str | None:
    """How the user gave ``flag`` (``"--cache-fn 5"``, ``"--cuda-graph"``), or ``None`` if they did not."""
    value = getattr(args, flag.lstrip("-").replace("-", "_"), None)
    if value is None or value is False:
        return None
    return flag if value is True else f"{flag} {value}"


def field_error_message(error: FieldError, args: argparse.Namespace) -> str:
    """The one-line message for a config value refused after the command built its configs.

    The flags are found from ``(error.owner, error.field)`` (every field of a :class:`~fastdit.errors.FieldsError`):
    those of the refused fields that the user passed, else the ones that chose the whole config (``--cache PRESET``).

    Args:
        error: The refused value.
        args: The command's parsed arguments (which flags were passed, and how).

    Returns:
        ``argument FLAG VALUE: <error>``, ``arguments FLAG VALUE, FLAG VALUE: <error>``, or, when no flag the user
        passed set the field, :func:`fastdit.cli.fields.field_message` (the library's own message for a field the
        CLI does not know).
    """
    names = list(error.fields) if isinstance(error, FieldsError) else [error.field]
    flags = [flag for name in names if (flag := _field_flag_name(error.owner, name)) is not None]
    given = [text for flag in dict.fromkeys(flags) if (text := _given(args, flag)) is not None]
    if not given:
        given = [text for flag in _CONFIG_FLAGS.get(error.owner, ()) if (text := _given(args, flag)) is not None]
    if not given:
        # Not a config field (a model directory that failed to load, a call argument): the library's field names.
        return field_message(error, model=getattr(args, "model", None))
    return f"argument{'s' * (len(given) > 1)} {', '.join(given)}: {error}"


def check_cache_fits(pipe: Any, cache: DBCache | DBPrune | None) -> None:
    """Refuse a :class:`DBCache` whose front and back blocks leave no middle block in a transformer of ``pipe``.

    This is the cache technique's own up-front check (``fastdit.techniques``), run on its own: its
    :class:`~fastdit.errors.FieldsError` names both fields, so the command line blames ``--cache-fn`` and
    ``--cache-bn`` rather than a flag the user never passed. Problems of the adapter itself are left to
    accelerating, which reports them. The block count is known only once the model is built.

    Args:
        pipe: The loaded pipeline.
        cache: The cache configuration to install (anything but a DBCache is not checked).

    Raises:
        FieldsError: Owner ``DBCache``, fields ``fn`` and ``bn``.
    """
    if not isinstance(cache, DBCache):
        return
    from fastdit.components import walk
    from fastdit.context import Request
    from fastdit.techniques import TECHNIQUES

    try:
        components = walk(pipe)
    except ValueError:  # no adapter: accelerating reports it
        return
    cache_check = next(t for t in TECHNIQUES if t.name == "cache")
    try:
        cache_check.check(Request(cache=cache), components)  # the cache's own up-front check, run early
    except FieldsError:
        raise
    except ValueError:  # an adapter that does not fit: accelerating reports it
        return


LIMITS: Mapping[str, int | float] = MappingProxyType(
    {
        "--seed": MAX_SEED,
        "--seeds": MAX_SEED,
        "--steps": 10_000,
        "--height": 16_384,
        "--width": 16_384,
        "--frames": 10_000,
        "--warmup": 10_000,
        "--repeat": 10_000,
        "--prompts": 10_000,
        "--threads": 4_096,
        "--fps": 1_000.0,
    }
)
"""The largest value each numeric flag takes.

Far above what any model runs (diffusion samplers use tens of steps, models are trained below 4096 pixels a side),
so a limit only stops a typo: ``--steps 100000`` would run for days and ``--steps 1000000000000`` would first try to
allocate terabytes of timesteps. Seeds are signed 64-bit integers (:data:`fastdit.session.MAX_SEED`).
"""


def check_positive(option: str, value: int | float | None, *, allow_zero: bool = False) -> None:
    """Reject a negative (or zero), non-finite or too large number given for ``option`` (see :data:`LIMITS`)."""
    if value is None:
        return
    if isinstance(value, float) and not math.isfinite(value):  # NaN passes every comparison below
        raise CLIError(f"argument {option} {value}: must be a finite number")
    if value < 0 or (value == 0 and not allow_zero):
        bound = "non-negative" if allow_zero else "positive"
        raise CLIError(f"argument {option} {value}: must be {bound}")
    limit = LIMITS.get(option)
    if limit is not None and value > limit:
        raise CLIError(f"argument {option} {value}: must be at most {limit}")


def resolve_device(text: str | None, environ: Mapping[str, str] | None = None) -> torch.device:
    """``--device``: the given device, or ``cuda`` when available, else ``cpu``.

    Under ``torchrun`` a CUDA device without an index becomes ``cuda:<LOCAL_RANK>``, one GPU per process (see
    :func:`fastdit.process.choose_device`).
    """
    try:
        return choose_device(text, environ)
    except FieldError as error:
        raise cli_error(error) from None


def configure_threads(threads: int | None, *, reference: bool, device: torch.device) -> None:
    """``--threads``: set torch's intra-op threads (see the flag's help for the default)."""
    if threads is not None:
        check_positive("--threads", threads)
        torch.set_num_threads(threads)
    elif reference and device.type == "cpu":
        # The reference model's kernels are tiny: extra threads only add synchronisation, and on a busy machine
        # two threads measured 5-10x slower than one.
        torch.set_num_threads(1)


def resolve_dtype(text: str, device: torch.device) -> torch.dtype:
    """``--dtype``: ``auto`` is bfloat16 on CUDA and float32 elsewhere."""
    if text == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[text]


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """MODEL, ``--model-path``, ``--device``, ``--dtype``."""
    parser.add_argument(
        "model",
        nargs="?",
        metavar="MODEL",
        help="registered model name (see `fastdit list`); omit for the built-in reference pipeline",
    )
    parser.add_argument(
        "--model-path",
        metavar="DIR",
        help="local pipeline directory (save_pretrained layout); default: the model's environment variable, "
        "e.g. FLUX_DIR for flux",
    )
    parser.add_argument("--device", help="device to run on (default: cuda if available, else cpu)")
    parser.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="CPU threads for torch (default: 1 for the reference pipeline on CPU, whose small kernels run fastest "
        "on one thread; otherwise torch's default)",
    )
    parser.add_argument(
        "--dtype",
        choices=("auto", *DTYPES),
        default="auto",
        help="parameter dtype (auto: bfloat16 on CUDA, else float32)",
    )


def add_call_arguments(parser: argparse.ArgumentParser) -> None:
    """The pipeline call: negative prompt, steps, size, frames, guidance."""
    group = parser.add_argument_group("pipeline call (defaults: the model preset's, else the pipeline's)")
    group.add_argument("--negative-prompt", metavar="TEXT", help="negative prompt (pipelines that take one)")
    group.add_argument("--steps", type=int, metavar="N", help="denoising steps (num_inference_steps)")
    group.add_argument("--height", type=int, metavar="PX", help="output height in pixels")
    group.add_argument("--width", type=int, metavar="PX", help="output width in pixels")
    group.add_argument("--frames", type=int, metavar="N", help="number of frames (video pipelines)")
    group.add_argument("--guidance", type=float, metavar="SCALE", help="guidance_scale")
    group.add_argument("--image", metavar="PATH", help="conditioning image (image-to-image, edit, I2V pipelines)")
    group.add_argument(
        "--true-cfg",
        type=float,
        metavar="SCALE",
        help="true_cfg_scale (pipelines that run a separate unconditional pass); above 1 it needs a negative "
        "prompt, the empty one by default",
    )


def check_call_numbers(args: argparse.Namespace) -> None:
    """Reject non-positive or too large steps, sizes and frames, and negative or non-finite guidance scales."""
    for option in ("--steps", "--height", "--width", "--frames"):
        check_positive(option, getattr(args, option[2:]))
    check_positive("--guidance", args.guidance, allow_zero=True)
    check_positive("--true-cfg", args.true_cfg, allow_zero=True)


def output_path(text: str) -> Path:
    """``--out``: ``~`` expanded, and ``.``/``..`` collapsed as text (``a/sub/../x.png`` is ``a/x.png``).

    Collapsed before anything is created: resolving ``..`` through the file system would first create ``a/sub``
    and leave it behind, empty.
    """
    return Path(os.path.normpath(os.path.expanduser(text)))


def resolve_source(args: argparse.Namespace) -> tuple[ModelSource, type]:
    """The model MODEL/``--model-path`` name and its pipeline class (imported, not loaded)."""
    try:
        source = resolve_model(args.model, args.model_path)
        return source, import_pipeline_class(source.pipeline_class)
    except FieldError as error:
        raise cli_error(error, model=args.model) from None


def call_values(args: argparse.Namespace, pipeline_class: type) -> dict[str, Any]:
    """The call arguments the user gave, as ``__call__`` parameters of ``pipeline_class``.

    Raises:
        CLIError: If the pipeline does not take one of them (naming the flag), or the image cannot be read.
    """
    accepted = call_parameters(pipeline_class)
    values: dict[str, Any] = {}
    for attr, option, parameter in CALL_FLAGS:
        value = getattr(args, attr)
        if value is None:
            continue
        if parameter not in accepted:
            raise CLIError(f"argument {option} {value}: {pipeline_class.__name__} does not take {parameter}")
        values[parameter] = value
    if args.image is not None:
        if "image" not in accepted:
            raise CLIError(f"argument --image {args.image}: {pipeline_class.__name__} does not take an image")
        values["image"] = _load_image(args.image)
    # True CFG runs only with a negative prompt; the empty prompt is the usual unconditional input.
    if (args.true_cfg or 0) > 1 and "negative_prompt" in accepted and "negative_prompt" not in values:
        values["negative_prompt"] = ""
    return values


def _load_image(path: str) -> Any:
    from PIL import Image

    from fastdit.io import load_image

    try:
        return Image.fromarray(load_image(os.path.expanduser(path)))
    except (OSError, ValueError) as error:
        raise CLIError(f"argument --image: cannot read '{path}': {error}") from None


def check_size(pipe: Any, kwargs: Mapping[str, Any]) -> None:
    """Reject a height, width or frame count the loaded pipeline would silently round (naming the flag).

    See :func:`fastdit.session.check_size`.
    """
    try:
        check_call_size(pipe, kwargs)
    except FieldError as error:
        raise cli_error(error) from None
