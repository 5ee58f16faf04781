"""The CLI frame: command registration, --version, and how errors become exit codes."""

from __future__ import annotations

import argparse
import importlib
import sys
import types
from typing import Any

import pytest

import fastdit
import fastdit.cli as cli


def _fake_command(outcome: Any) -> types.ModuleType:
    module = types.ModuleType("fastdit.cli.fake")

    def add_parser(subparsers: Any) -> argparse.ArgumentParser:
        parser = subparsers.add_parser("fake", help="test command")
        parser.add_argument("value")
        return parser

    def run(args: argparse.Namespace) -> int:
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    module.add_parser, module.run = add_parser, run
    return module


@pytest.fixture
def register_fake(monkeypatch: pytest.MonkeyPatch) -> Any:
    def register(outcome: Any) -> None:
        monkeypatch.setitem(sys.modules, "fastdit.cli.fake", _fake_command(outcome))
        monkeypatch.setattr(cli, "COMMANDS", (*cli.COMMANDS, "fake"))

    return register


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"fastdit {fastdit.__version__}"


def test_every_command_module_has_the_interface() -> None:
    for name in cli.COMMANDS:
        module = importlib.import_module(f"fastdit.cli.{name}")
        assert callable(module.add_parser) and callable(module.run), name
    assert "metrics" in cli.COMMANDS


def test_missing_and_unknown_commands_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "required: COMMAND" in capsys.readouterr().err
    assert cli.main(["frobnicate"]) == 2
    assert "frobnicate" in capsys.readouterr().err


def test_adding_a_command_is_one_name(register_fake: Any, capsys: pytest.CaptureFixture[str]) -> None:
    register_fake(7)
    assert cli.main(["fake", "x"]) == 7
    assert cli.main(["--help"]) == 0
    assert "fake" in capsys.readouterr().out


def test_cli_error_is_one_line_with_exit_2(register_fake: Any, capsys: pytest.CaptureFixture[str]) -> None:
    register_fake(cli.CLIError("argument X: bad value\n'y'"))
    assert cli.main(["fake", "x"]) == 2
    captured = capsys.readouterr()
    assert captured.err == "fastdit: error: argument X: bad value 'y'\n"
    assert captured.out == ""


def test_other_exceptions_are_not_swallowed(register_fake: Any) -> None:
    register_fake(RuntimeError("a bug"))
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["fake", "x"])
