"""How a command's distributed run is set up and how it ends when a rank is lost: ``--dist-timeout``, and one line
per rank (never a backend traceback) when a collective times out, a peer leaves, or the run is interrupted.

Under ``torchrun`` an interrupt (Ctrl-C reaches ``torchrun``, which passes it to every rank) ends each rank in the
middle of its work: a rank blocked in a collective sees its peer's sockets close before its own interrupt is
delivered, and would print the backend's error with the interrupt's traceback on top.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from fastdit.cli import CLIError
from fastdit.config import DEFAULT_TIMEOUT_S, Parallel
from fastdit.errors import FieldError
from fastdit.parallel.failures import CollectiveError
from fastdit.process import process_count, process_rank

__all__ = ["EXIT_FAILED", "EXIT_INTERRUPTED", "TIMEOUT_FLAG", "add_timeout_argument", "report_stop", "with_timeout"]

TIMEOUT_FLAG = "--dist-timeout"
EXIT_FAILED = 1
"""A run that failed on a healthy input: here, a collective that lost a rank."""
EXIT_INTERRUPTED = 130
"""128 + SIGINT, what shells report for a program ended by Ctrl-C."""


def add_timeout_argument(group: argparse._ArgumentGroup) -> None:
    """Add ``--dist-timeout SECONDS`` (:attr:`Parallel.timeout_s`) to ``group``."""
    group.add_argument(
        TIMEOUT_FLAG,
        type=float,
        metavar="SECONDS",
        help="with --parallel: how long a rank waits for the others (in a collective, or to join) before the run "
        f"fails naming the ranks that stopped answering (default {DEFAULT_TIMEOUT_S:g}: room for slow weight "
        "loading and first-call compilation)",
    )


def with_timeout(args: argparse.Namespace, parallel: Parallel | None) -> Parallel | None:
    """``parallel`` with ``--dist-timeout`` applied.

    Raises:
        CLIError: ``--dist-timeout`` without ``--parallel``, or a value :class:`Parallel` refuses.
    """
    seconds = getattr(args, "dist_timeout", None)
    if seconds is None:
        return parallel
    if parallel is None:
        raise CLIError(f"argument {TIMEOUT_FLAG}: applies only to a run with --parallel")
    try:
        return replace(parallel, timeout_s=seconds)
    except FieldError as error:
        raise CLIError(f"argument {TIMEOUT_FLAG} {seconds:g}: {error}") from None


def report_stop(stop: CollectiveError | KeyboardInterrupt) -> int:
    """Print the one line of this rank about a run that lost a rank or was interrupted; return the exit code.

    Raises:
        KeyboardInterrupt: ``stop`` itself on a single process, which the command line handles as any interrupt.
    """
    if isinstance(stop, KeyboardInterrupt):
        if process_count() == 1:
            raise stop
        print(f"fastdit: interrupted (rank {process_rank()} of {process_count()})", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(f"fastdit: error: {stop.describe(TIMEOUT_FLAG)}", file=sys.stderr)
    return EXIT_FAILED
