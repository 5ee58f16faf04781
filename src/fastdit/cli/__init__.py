"""The ``fastdit`` command line: one argparse subcommand per module in :data:`COMMANDS`.

A command module ``fastdit.cli.<name>`` exposes ``add_parser(subparsers) -> argparse.ArgumentParser`` and
``run(args) -> int``. Bad user input is reported by raising :class:`CLIError`, which :func:`main` turns into one line
``fastdit: error: <message>`` on stderr and exit code 2 — the same code argparse uses for usage errors. A
:class:`~fastdit.errors.FieldError` that leaves a command (a config value refused once the model is loaded) is reported
the same way, naming the flags that set its field (found by its owner and field, not by its message), and so is a
:class:`~fastdit.errors.NonFiniteOutputError` (an output with NaN or infinite values, never saved). Ctrl-C ends
with one line ``fastdit: interrupted`` and exit code :data:`EXIT_INTERRUPTED`, without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from typing import Any

from fastdit.errors import FieldError, NonFiniteOutputError

__all__ = ["COMMANDS", "EXIT_INTERRUPTED", "EXIT_USAGE", "CLIError", "build_parser", "main"]

COMMANDS: tuple[str, ...] = ("generate", "serve", "list", "bench", "calibrate", "metrics", "inspect", "verify")
"""Command modules under ``fastdit.cli``, in help order; adding a command is adding its name here."""

EXIT_USAGE = 2
"""Exit code for bad input, shared with argparse's usage errors."""

EXIT_INTERRUPTED = 130
"""Exit code after Ctrl-C (SIGINT): 128 + the signal number, what shells report for a process the signal ended."""


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


def _error(message: str) -> int:
    print(f"fastdit: error: {_one_line(message)}", file=sys.stderr)
    return EXIT_USAGE


def _run(args: argparse.Namespace) -> int:
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except CLIError as error:
        return _error(str(error))
    except FieldError as error:
        # Here, not in the command: only the parsed arguments tell which of the flags that can set the field were
        # passed. Commands apply their configs before writing anything, so this is bad input like a CLIError.
        from fastdit.cli.options import field_error_message

        return _error(field_error_message(error, args))
    except NonFiniteOutputError as error:
        # Raised before anything is saved; the likely causes are values the user gave (guidance, weights, dtype).
        from fastdit.cli.fields import non_finite_message

        return _error(non_finite_message(error))


# Loggers of optional packages that announce, as warnings, at import time, what the machine lacks: torchao's CUDA
# extensions on a CPU-only torch, diffusers' torchao checkpoint types, torch's pytree notes on torchao's enums. They
# are not about the command's work, and they would bury its one-line errors; errors still come through.
_IMPORT_CHATTER = ("torchao", "diffusers.quantizers.torchao.torchao_quantizer", "torch.utils._pytree")


def _quiet_import_chatter() -> None:
    import logging

    for name in _IMPORT_CHATTER:
        logging.getLogger(name).setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    """Run the ``fastdit`` command line.

    Args:
        argv: Arguments without the program name; ``None`` reads ``sys.argv[1:]``.

    Returns:
        The exit code: 0 on success, 2 on bad input or usage errors, 130 after Ctrl-C, or what the command returns.
    """
    _quiet_import_chatter()
    try:
        parser = build_parser()
        try:
            args = parser.parse_args(argv)
        except SystemExit as exit_:
            # argparse exits for --help/--version (0) and usage errors (2); return the code so that in-process
            # callers get an int like every other outcome.
            return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
        return _run(args)
    except KeyboardInterrupt:
        # Writers clean up on the way out (fastdit.io), so there is nothing to report but the interruption. On a
        # terminal the line starts after the "^C" it echoed.
        newline = "\n" if _on_terminal(sys.stderr) else ""
        print(f"{newline}fastdit: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _on_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # replaced or closed streams
        return False
