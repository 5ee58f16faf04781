"""Cache configuration files: a chosen cache configuration, what it was chosen on, and where it applies.

``fastdit calibrate`` writes one; ``--cache from:PATH`` (generate, bench, serve, verify) and
:func:`load_cache_file` read it back. The file is JSON::

    {"format": "fastdit-cache/1", "model": "reference", "num_steps": 28,
     "config": {"kind": "MagCache", "fields": {"threshold": 0.06, ..., "calibration": {"kind": "MagCalibration", ...}}},
     "provenance": {...what the calibration measured...}}

Nested configurations (TaylorSeer, StepMask, MagCalibration, MagCalibrations: one calibration per denoiser,
TeaCalibration) are written the same way as the top one. Only the classes in :data:`CONFIG_KINDS` are read back,
and every value goes through the dataclass's own checks, so a file edited by hand fails with the field that is
wrong.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastdit.config import (
    CACHE_CONFIGS,
    DBCache,
    DBPrune,
    MagCache,
    MagCalibration,
    MagCalibrations,
    StepMask,
    TaylorSeer,
    TeaCache,
    TeaCalibration,
)

__all__ = [
    "CACHE_FILE_FORMAT",
    "CONFIG_KINDS",
    "CacheFile",
    "calibration_dir",
    "config_from_dict",
    "config_to_dict",
    "default_cache_file",
    "load_cache_file",
    "save_cache_file",
]

CACHE_FILE_FORMAT = "fastdit-cache/1"
"""The ``format`` entry of every cache file this version writes and reads."""

CONFIG_KINDS: Mapping[str, type] = {
    cls.__name__: cls
    for cls in (
        DBCache,
        DBPrune,
        MagCache,
        MagCalibration,
        MagCalibrations,
        StepMask,
        TaylorSeer,
        TeaCache,
        TeaCalibration,
    )
}
"""Configuration classes a cache file may hold, by the name written in its ``kind`` entries."""

_TOP_LEVEL = CACHE_CONFIGS


def config_to_dict(config: Any) -> dict[str, Any]:
    """``{"kind": <class name>, "fields": {...}}`` of a cache configuration (nested configurations alike)."""
    if type(config).__name__ not in CONFIG_KINDS:
        raise TypeError(f"config={config!r}: expected one of {', '.join(CONFIG_KINDS)}")
    return {
        "kind": type(config).__name__,
        "fields": {f.name: _encode(getattr(config, f.name)) for f in dataclasses.fields(config)},
    }


def _encode(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return config_to_dict(value)
    if isinstance(value, tuple):
        return [_encode(v) for v in value]
    return value


def config_from_dict(data: Any, where: str = "config") -> Any:
    """The configuration :func:`config_to_dict` wrote.

    Raises:
        ValueError: An entry is missing or of another class than :data:`CONFIG_KINDS` holds, or a field is unknown;
            the message names where in the file (``config.fields.taylorseer``).
        FieldError: A value the configuration's own checks refuse.
    """
    if not isinstance(data, Mapping) or set(data) != {"kind", "fields"}:
        raise ValueError(f"{where}: expected {{'kind': ..., 'fields': {{...}}}}, got {data!r:.120}")
    kind = CONFIG_KINDS.get(data["kind"])
    if kind is None:
        raise ValueError(f"{where}.kind={data['kind']!r}: expected one of {', '.join(CONFIG_KINDS)}")
    values = data["fields"]
    if not isinstance(values, Mapping):
        raise ValueError(f"{where}.fields: expected a mapping, got {values!r:.120}")
    known = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{where}.fields: {kind.__name__} has no field {unknown[0]!r}; fields: {', '.join(known)}")
    return kind(**{name: _decode(value, f"{where}.fields.{name}") for name, value in values.items()})


def _decode(value: Any, where: str) -> Any:
    if isinstance(value, Mapping) and "kind" in value:
        return config_from_dict(value, where)
    if isinstance(value, list):  # the configurations keep tuples (frozen, hashable)
        return tuple(_decode(v, f"{where}[{i}]") for i, v in enumerate(value))
    return value


@dataclass(frozen=True)
class CacheFile:
    """A cache configuration with the model and step count it was chosen for.

    Attributes:
        config: The cache configuration (DBCache, DBPrune, MagCache or TeaCache).
        model: What it was chosen on (the model name given to ``fastdit calibrate``).
        num_steps: Steps of the runs it was chosen on (``None``: any); MagCache calibrations need exactly these.
        provenance: What the calibration measured (target, prompts, seeds, quality on both parts, candidates).
    """

    config: Any
    model: str
    num_steps: int | None = None
    provenance: Mapping[str, Any] = field(default_factory=dict)


def save_cache_file(path: str | os.PathLike[str], cache_file: CacheFile) -> Path:
    """Write ``cache_file`` as JSON (atomically: a reader never sees half a file); return the path.

    Raises:
        TypeError: The config is not a cache configuration, or the provenance is not JSON data.
        ValueError: The provenance holds a non-finite float (write those as strings first, as benchmarks do).
    """
    from fastdit.io import write_json

    if not isinstance(cache_file.config, _TOP_LEVEL):
        raise TypeError(f"CacheFile.config={cache_file.config!r}: expected DBCache, DBPrune, MagCache or TeaCache")
    data = {
        "format": CACHE_FILE_FORMAT,
        "model": cache_file.model,
        "num_steps": cache_file.num_steps,
        "config": config_to_dict(cache_file.config),
        "provenance": dict(cache_file.provenance),
    }
    return write_json(path, data, indent=1)


def load_cache_file(path: str | os.PathLike[str], *, num_steps: int | None = None) -> CacheFile:
    """Read a file :func:`save_cache_file` wrote.

    Args:
        path: The file.
        num_steps: Steps of the runs it will serve; a file chosen on another step count is refused (its thresholds
            and a MagCache calibration follow the schedule).

    Raises:
        FileNotFoundError: No such file.
        ValueError: Not a cache file, an entry missing or wrong (naming it), or chosen on another step count.
    """
    path = Path(path).expanduser()
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"cache file {path}: no such file (write one with fastdit calibrate)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"cache file {path}: not JSON ({error})") from None
    if not isinstance(data, dict) or data.get("format") != CACHE_FILE_FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"cache file {path}: format {found!r}, expected {CACHE_FILE_FORMAT!r}")
    for name in ("model", "num_steps", "config"):
        if name not in data:
            raise ValueError(f"cache file {path}: no {name!r} entry")
    config = config_from_dict(data["config"])
    if not isinstance(config, _TOP_LEVEL):
        raise ValueError(f"cache file {path}: config.kind={type(config).__name__!r} is not a cache configuration")
    steps = data["num_steps"]
    if num_steps is not None and steps is not None and steps != num_steps:
        raise ValueError(
            f"cache file {path}: chosen on runs of num_steps={steps}, asked to serve num_steps={num_steps}; "
            f"calibrate for {num_steps} steps"
        )
    return CacheFile(config, str(data["model"]), steps, data.get("provenance") or {})


def calibration_dir() -> Path:
    """Where ``fastdit calibrate`` keeps files by default: ``$FASTDIT_CALIBRATION_DIR``, else the user cache."""
    env = os.environ.get("FASTDIT_CALIBRATION_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "fastdit" / "calibrations"


def default_cache_file(model: str, num_steps: int | None) -> Path:
    """The file ``--cache calibrated`` reads for ``model`` (as the user names it) at ``num_steps`` steps."""
    # A folder given as the model is named by its resolved path, so two folders called "flux" stay apart.
    name = str(Path(model).expanduser().resolve()) if os.sep in model or Path(model).is_dir() else model
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "model"
    return calibration_dir() / f"{slug}-{num_steps if num_steps is not None else 'any'}steps.json"
