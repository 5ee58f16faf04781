"""``fastdit list``: registered models, families with their tiny pipelines, cache presets; table and JSON."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from fastdit.cache.presets import CACHE_PRESETS
from fastdit.cli import main
from fastdit.cli.list import features
from fastdit.models.registry import all_adapters, all_presets, get_preset


def _list(capsys: Any, *argv: str) -> str:
    assert main(["list", *argv]) == 0
    return capsys.readouterr().out


def test_json_has_one_object_per_registered_model(capsys: Any) -> None:
    rows = json.loads(_list(capsys, "--json"))
    assert [r["name"] for r in rows] == [p.name for p, _ in all_presets()]
    for row in rows:
        assert set(row) == {"name", "family", "features", "hub_id", "pipeline_class", "env_var"}
        preset, adapter = get_preset(row["name"])
        assert row["family"] == adapter.family
        assert row["pipeline_class"] == preset.pipeline_class and row["pipeline_class"].startswith("diffusers.")
        assert row["env_var"] == preset.env_var and row["env_var"].endswith("_DIR")
        assert "cache" in row["features"]
    flux = next(r for r in rows if r["name"] == "flux")
    assert flux == {
        "name": "flux",
        "family": "flux",
        "features": ["cache", "cp", "tp", "cfg"],
        "hub_id": "black-forest-labs/FLUX.1-dev",
        "pipeline_class": "diffusers.FluxPipeline",
        "env_var": "FLUX_DIR",
    }


def test_table_lists_every_model(capsys: Any) -> None:
    lines = _list(capsys).splitlines()
    assert lines[0].split() == ["NAME", "FAMILY", "FEATURES", "PIPELINE_CLASS", "ENV_VAR", "HUB_ID"]
    assert [line.split()[0] for line in lines[1:]] == [p.name for p, _ in all_presets()]


def test_families_with_their_tiny_pipelines(capsys: Any) -> None:
    rows = json.loads(_list(capsys, "--families", "--json"))
    assert [r["family"] for r in rows] == [a.family for a in all_adapters()]
    flux = next(r for r in rows if r["family"] == "flux")
    assert flux["tiny_pipelines"] == ["flux", "kontext"]
    assert "flux-schnell" in flux["models"]
    assert flux["transformer_classes"] == ["diffusers.models.transformers.transformer_flux.FluxTransformer2DModel"]
    table = _list(capsys, "--families")
    assert table.splitlines()[0].split() == ["FAMILY", "FEATURES", "TINY_PIPELINES", "MODELS"]
    assert any(line.startswith("flux ") and "flux,kontext" in line for line in table.splitlines())


def test_features_come_from_the_adapter() -> None:
    assert features(get_preset("flux")[1]) == ["cache", "cp", "tp", "cfg"]
    for adapter in all_adapters():
        assert ("cp" in features(adapter)) == (adapter.cp_plan is not None), adapter.family
        assert ("tp" in features(adapter)) == (adapter.tp_plan is not None), adapter.family
        assert ("cfg" in features(adapter)) == adapter.cfg_parallel, adapter.family
        assert features(replace(adapter, cp_plan=None, tp_plan=None, cfg_parallel=False)) == ["cache"]


def test_cache_presets(capsys: Any) -> None:
    rows = json.loads(_list(capsys, "--cache-presets", "--json"))
    assert [r["name"] for r in rows] == list(CACHE_PRESETS)
    assert next(r for r in rows if r["name"] == "none")["config"] is None
    assert next(r for r in rows if r["name"] == "prune")["config"] == "DBPrune"


def test_families_and_presets_are_exclusive(capsys: Any) -> None:
    assert main(["list", "--families", "--cache-presets"]) == 2
    assert "not allowed with" in capsys.readouterr().err
