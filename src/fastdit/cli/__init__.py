"""The ``fastdit`` command line: one argparse subcommand per module in :data:`COMMANDS`.

A command module ``fastdit.cli.<name>`` exposes ``add_parser(subparsers) -> argparse.ArgumentParser`` and
``run(args) -> int``. Bad user input is reported by raising :class:`CLIError`, which :func:`main` turns into one line
``fastdit: error: <message>`` on stderr and exit code 2 — the same code argparse uses for usage errors. A
:class:`~fastdit.errors.FieldError` that leaves a command (a config value refused once the model is loaded) is reported
the same way, naming the flags that set its field (found by its owner and field, not by its message).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

from fastdit.errors import FieldError

__all__ = ["COMMANDS", "EXIT_USAGE", "CLIError", "build_parser", "main"]

COMMANDS: tuple[str, ...] = ("generate", "list", "bench", "metrics")
"""Command modules under ``fastdit.cli``, in help order; adding a command is adding its name here."""

EXIT_USAGE = 2
"""Exit code for bad input, shared with argparse's usage errors."""


class CLIError(Exception):
    """Bad user input: reported as ``fastdit: error: <message>`` with exit code 2, without a traceback."""


def _version() -> str:
    from fastdit import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    """Build the top-level parser with every command in :data:`COMMANDS` registered.

    Returns:
        The parser; each subcommand stores its ``run`` function in ``args.run``.
    """
    parser = argparse.ArgumentParser(
        prog="fastdit", description="Make Diffusion Transformers fast without editing their code."
    )
    parser.add_argument("--version", action="version", version=f"fastdit {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        module = importlib.import_module(f"fastdit.cli.{name}")
        command_parser = module.add_parser(subparsers)
        command_parser.set_defaults(run=module.run)
    return parser


def _one_line(message: str) -> str:
    return " ".join(str(message).split())


def main(argv: list[str] | None = None) -> int:
    """Run the ``fastdit`` command line.

    Args:
        argv: Arguments without the program name; ``None`` reads ``sys.argv[1:]``.

    Returns:
        The exit code: 0 on success, 2 on bad input or usage errors, or what the command returns.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        # argparse exits for --help/--version (0) and usage errors (2); return the code so that in-process callers
        # get an int like every other outcome.
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except CLIError as error:
        print(f"fastdit: error: {_one_line(str(error))}", file=sys.stderr)
        return EXIT_USAGE
    except FieldError as error:
        # Here, not in the command: only the parsed arguments tell which of the flags that can set the field were
        # passed. Commands apply their configs before writing anything, so this is bad input like a CLIError.
        from fastdit.cli.options import field_error_message

        print(f"fastdit: error: {_one_line(field_error_message(error, args))}", file=sys.stderr)
        return EXIT_USAGE
