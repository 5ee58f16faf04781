"""``fastdit inspect``: text by default, ``--json PATH`` as well, one-line errors with exit code 2."""

from __future__ import annotations

import json

import pytest

import fastdit.cli as cli


def test_inspect_prints_and_writes_json(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "out" / "flux.json"
    assert cli.main(["inspect", "flux", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("fastdit inspect flux") and "P1" in out
    data = json.loads(path.read_text())
    assert data["family"] == "flux" and [g["path"] for g in data["groups"]][:2] == [
        "transformer_blocks",
        "single_transformer_blocks",
    ]


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("no-such-model", "unknown target 'no-such-model'"),
        ("no_such_module_xyz:Model", "cannot import 'Model' from 'no_such_module_xyz'"),
    ],
)
def test_bad_target_is_one_line(target: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["inspect", target]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"fastdit: error: {message}") and err.count("\n") == 1


def test_folder_without_config_is_one_line(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["inspect", str(tmp_path)]) == cli.EXIT_USAGE
    assert "has no transformer/config.json or config.json" in capsys.readouterr().err
