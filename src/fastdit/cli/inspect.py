"""``fastdit inspect TARGET``: read a transformer's structure and one traced forward, and say how fastdit fits it.

TARGET is a registered model name or family (``fastdit list``), a diffusers transformer class name, a
``module.path:Class``, or a local model folder (its config; weights are never read). The report covers the block
lists and their ForwardPattern, work between block calls, masks, heads and GQA, fused projections, QK-norms, AdaLN
linears, RoPE sources and sequence-carrying tensors, divisibility by parallel degrees, the CP and TP decisions, and
the registered adapter compared with the findings (or a proposed adapter for an unregistered model).
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``inspect`` command.

    Args:
        subparsers: The action returned by ``ArgumentParser.add_subparsers``.

    Returns:
        The command's parser.
    """
    parser = subparsers.add_parser(
        "inspect",
        help="analyse a transformer: block patterns, heads, RoPE, CP/TP plan",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
    )
    parser.add_argument("target", metavar="TARGET", help="model name, diffusers class, module:Class or model folder")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH (atomically)")
    parser.add_argument(
        "--example",
        metavar="MODULE:FUNCTION",
        help="a function returning (model, kwargs) or (model, args, kwargs): a small instance of TARGET and one call "
        "of it, traced instead of inputs made from the signature (third-party models with their own argument names)",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    """Inspect ``args.target`` and print the report.

    Args:
        args: Parsed arguments of the ``inspect`` command.

    Returns:
        0.

    Raises:
        CLIError: if the target names nothing inspectable.
    """
    from fastdit.cli import CLIError
    from fastdit.diagnostics.inspect import inspect_target
    from fastdit.diagnostics.report import render_text
    from fastdit.diagnostics.target import TargetError

    try:
        report = inspect_target(args.target, args.example)
    except TargetError as error:
        raise CLIError(str(error)) from None
    print(render_text(report), end="")
    if args.json:
        from fastdit.io import write_json

        write_json(args.json, report.to_dict())
    return 0
