"""Cache files: every cache configuration round-trips, and a wrong file fails naming what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fastdit.cache.files import (
    CACHE_FILE_FORMAT,
    CacheFile,
    config_from_dict,
    config_to_dict,
    default_cache_file,
    load_cache_file,
    save_cache_file,
)
from fastdit.cache.magcache import reference_calibration
from fastdit.config import DBCache, DBPrune, MagCache, StepMask, TaylorSeer
from fastdit.errors import FieldError

CONFIGS = [
    DBCache(fn=1, bn=0, threshold=0.3, taylorseer=TaylorSeer(order=2, variable="timestep")),
    DBCache(step_mask=StepMask(compute_steps=(0, 1, 5), policy="static")),
    DBPrune(fn=1, bn=0, threshold=0.08, max_pruned_ratio=0.6),
    MagCache(threshold=0.3, max_skip_steps=3, calibration=reference_calibration()),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: type(c).__name__)
def test_round_trip(config, tmp_path: Path) -> None:
    assert config_from_dict(json.loads(json.dumps(config_to_dict(config)))) == config
    path = save_cache_file(tmp_path / "c.json", CacheFile(config, "reference", 28, {"psnr_min": 31.5}))
    loaded = load_cache_file(path, num_steps=28)
    assert loaded == CacheFile(config, "reference", 28, {"psnr_min": 31.5})
    assert json.loads(path.read_text())["format"] == CACHE_FILE_FORMAT


def _write(path: Path, data: object) -> Path:
    path.write_text(json.dumps(data))
    return path


def _file(config: dict) -> dict:
    return {"format": CACHE_FILE_FORMAT, "model": "m", "num_steps": 28, "config": config}


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"format": "other"}, "format 'other'"),
        ([1, 2], "format 'list'"),
        ({"format": CACHE_FILE_FORMAT, "model": "m", "num_steps": 28}, "no 'config' entry"),
        (_file({"kind": "Cache", "fields": {}}), "config.kind='Cache'"),
        (_file({"kind": "DBCache", "fields": {"fm": 1}}), "DBCache has no field 'fm'"),
        (_file({"kind": "DBCache", "fields": {"taylorseer": {"kind": "TaylorSeer", "fields": {"ordr": 2}}}}),
         "config.fields.taylorseer.fields: TaylorSeer has no field 'ordr'"),
        (_file({"kind": "TaylorSeer", "fields": {}}), "is not a cache configuration"),
        (_file({"kind": "DBCache"}), "expected {'kind'"),
    ],
)  # fmt: skip
def test_bad_files_name_what_is_wrong(tmp_path: Path, data: object, needle: str) -> None:
    with pytest.raises(ValueError, match=None) as info:
        load_cache_file(_write(tmp_path / "bad.json", data))
    assert needle in str(info.value), str(info.value)


def test_a_refused_value_names_its_field(tmp_path: Path) -> None:
    path = _write(tmp_path / "bad.json", _file({"kind": "DBCache", "fields": {"threshold": -1}}))
    with pytest.raises(FieldError) as info:
        load_cache_file(path)
    assert (info.value.owner, info.value.field) == ("DBCache", "threshold")


def test_steps_missing_file_and_not_json(tmp_path: Path) -> None:
    path = save_cache_file(tmp_path / "c.json", CacheFile(DBCache(), "m", 28))
    with pytest.raises(ValueError, match="chosen on runs of num_steps=28, asked to serve num_steps=20"):
        load_cache_file(path, num_steps=20)
    assert load_cache_file(save_cache_file(tmp_path / "any.json", CacheFile(DBCache(), "m")), num_steps=7)
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_cache_file(tmp_path / "missing.json")
    (tmp_path / "text.json").write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        load_cache_file(tmp_path / "text.json")


def test_nothing_half_written(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    with pytest.raises(ValueError):  # a non-finite float is not JSON: refused before the file exists
        save_cache_file(path, CacheFile(DBCache(), "m", 28, {"psnr": float("inf")}))
    assert not path.exists() and list(tmp_path.iterdir()) == []
    with pytest.raises(TypeError, match="expected DBCache, DBPrune, MagCache or TeaCache"):
        save_cache_file(path, CacheFile(TaylorSeer(), "m", 28))


def test_default_file_per_model_and_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTDIT_CALIBRATION_DIR", str(tmp_path))
    assert default_cache_file("flux", 28) == tmp_path / "flux-28steps.json"
    assert default_cache_file("flux", 20) != default_cache_file("flux", 28)
    folder = tmp_path / "models" / "flux"
    folder.mkdir(parents=True)
    other = tmp_path / "other" / "flux"
    other.mkdir(parents=True)
    assert default_cache_file(str(folder), 28) != default_cache_file(str(other), 28)  # same basename, other file
    assert default_cache_file(str(folder), 28).parent == tmp_path
    monkeypatch.delenv("FASTDIT_CALIBRATION_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_file("flux", 28) == tmp_path / "xdg" / "fastdit" / "calibrations" / "flux-28steps.json"
