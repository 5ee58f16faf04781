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
from fastdit.errors import NonFiniteOutputError


def _fake_command(outcome: Any) -> types.ModuleType:
    module = types.ModuleType("fastdit.cli.fake")

    def add_parser(subparsers: Any) -> argparse.ArgumentParser:
        parser = subparsers.add_parser("fake", help="test command")
        parser.add_argument("value")
        return parser

    def run(args: argparse.Namespace) -> int:
        if isinstance(outcome, BaseException):
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


def test_every_command_is_registered_and_answers_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    overview = capsys.readouterr().out
    for name in cli.COMMANDS:
        module = importlib.import_module(f"fastdit.cli.{name}")
        assert callable(module.add_parser) and callable(module.run), name
        assert cli.main([name, "--help"]) == 0, name
        assert capsys.readouterr().out.startswith(f"usage: fastdit {name} "), name
        # Each command is listed in the overview with the help its parser declares.
        help_text = build_help(name)
        assert help_text and " ".join(help_text.split()) in " ".join(overview.split()), name
    assert build_parser_commands() == set(cli.COMMANDS)


def build_help(name: str) -> str:
    subparsers = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return next(action.help for action in subparsers._choices_actions if action.dest == name)


def build_parser_commands() -> set[str]:
    subparsers = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return set(subparsers.choices)


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


def test_ctrl_c_is_one_line_with_exit_130(register_fake: Any, capsys: pytest.CaptureFixture[str]) -> None:
    register_fake(KeyboardInterrupt())
    assert cli.main(["fake", "x"]) == cli.EXIT_INTERRUPTED == 130
    captured = capsys.readouterr()
    assert captured.err == "fastdit: interrupted\n" and captured.out == ""


NON_FINITE = [
    (
        NonFiniteOutputError(12, 48, arguments={"guidance_scale": float("nan")}, components=("vae",)),
        "the output has 12 non-finite values (NaN or inf) of 48, so nothing was saved; likely cause: argument "
        "--guidance nan is not a finite number; the weights of vae hold NaN or inf values (a damaged model directory)",
    ),
    (
        NonFiniteOutputError(1, 2, float16=True),
        "the output has 1 non-finite values (NaN or inf) of 2, so nothing was saved; likely cause: --dtype float16 "
        "overflowed; try --dtype bfloat16 or float32",
    ),
    (
        NonFiniteOutputError(1, 2),
        "the output has 1 non-finite values (NaN or inf) of 2, so nothing was saved; no likely cause found: the "
        "call's numbers and the weights are finite",
    ),
]


@pytest.mark.parametrize(("error", "message"), NON_FINITE, ids=["arguments", "float16", "unknown"])
def test_a_non_finite_output_is_one_line_with_exit_2(
    error: NonFiniteOutputError, message: str, register_fake: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    register_fake(error)
    assert cli.main(["fake", "x"]) == 2
    assert capsys.readouterr().err == f"fastdit: error: {message}\n"
