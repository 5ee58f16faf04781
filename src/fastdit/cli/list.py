"""``fastdit list``: the models ``fastdit generate`` loads by name, their families and what fastdit can do for them.

Features come from each family's adapter (what it declares), not from a hand-kept list. ``--families`` lists the
families with their tiny offline pipelines; ``--cache-presets`` the named cache configurations.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from typing import Any

from fastdit.cache.presets import CACHE_PRESETS
from fastdit.models.base import ModelAdapter
from fastdit.models.registry import all_adapters, all_presets

__all__ = ["FEATURES", "add_parser", "features", "run"]

FEATURES: tuple[tuple[str, Callable[[ModelAdapter], bool]], ...] = (
    # Step caching needs nothing but the block lists every adapter declares.
    ("cache", lambda adapter: bool(adapter.block_groups)),
    # Context parallelism (Ulysses, ring) needs the family's plan of where to split and gather the sequence.
    ("cp", lambda adapter: adapter.cp_plan is not None),
    # Tensor parallelism needs the family's plan of which layers split and which attributes divide.
    ("tp", lambda adapter: adapter.tp_plan is not None),
    # CFG parallelism needs only that the family does not opt out (a call without an unconditional branch is refused).
    ("cfg", lambda adapter: adapter.cfg_parallel),
)
"""Feature name and the test of an adapter that says whether the family supports it, in display order."""


def features(adapter: ModelAdapter) -> list[str]:
    """The features ``adapter`` supports, in :data:`FEATURES` order."""
    return [name for name, supported in FEATURES if supported(adapter)]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``list`` command.

    Args:
        subparsers: The action returned by ``ArgumentParser.add_subparsers``.

    Returns:
        The command's parser.
    """
    parser = subparsers.add_parser(
        "list",
        help="list registered models, families or cache presets",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
    )
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--families", action="store_true", help="list model families and their tiny pipelines")
    what.add_argument("--cache-presets", action="store_true", help="list the named cache configurations")
    parser.add_argument("--json", action="store_true", help="print one JSON array instead of a table")
    return parser


def model_rows() -> list[dict[str, Any]]:
    """One row per registered model name."""
    return [
        {
            "name": preset.name,
            "family": adapter.family,
            "features": features(adapter),
            "hub_id": preset.hub_id,
            "pipeline_class": preset.pipeline_class,
            "env_var": preset.env_var,
        }
        for preset, adapter in all_presets()
    ]


def family_rows() -> list[dict[str, Any]]:
    """One row per registered family."""
    return [
        {
            "family": adapter.family,
            "features": features(adapter),
            "tiny_pipelines": [tiny.name for tiny in adapter.tiny_pipelines],
            "models": [preset.name for preset in adapter.presets],
            "transformer_classes": list(adapter.transformer_classes),
        }
        for adapter in all_adapters()
    ]


def cache_preset_rows() -> list[dict[str, Any]]:
    """One row per cache preset."""
    return [
        {
            "name": preset.name,
            "config": preset.kind.__name__ if preset.kind is not None else None,
            "values": {k: repr(v) if not isinstance(v, (int, float, str)) else v for k, v in preset.values.items()},
            "doc": preset.doc,
        }
        for preset in CACHE_PRESETS.values()
    ]


def _cell(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(str(v) for v in value) or "-"
    return str(value) if value not in (None, "") else "-"


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """Plain-text table of ``columns`` of ``rows``, with an upper-case header."""
    cells = [[c.upper() for c in columns]] + [[_cell(row[c]) for c in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in cells)


def run(args: argparse.Namespace) -> int:
    """Print the requested listing.

    Args:
        args: Parsed arguments of the ``list`` command.

    Returns:
        0.
    """
    if args.families:
        rows, columns = family_rows(), ("family", "features", "tiny_pipelines", "models")
    elif args.cache_presets:
        rows, columns = cache_preset_rows(), ("name", "config", "doc")
    else:
        rows, columns = model_rows(), ("name", "family", "features", "pipeline_class", "env_var", "hub_id")
    print(json.dumps(rows) if args.json else table(rows, columns))
    return 0
