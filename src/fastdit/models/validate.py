"""Check an adapter against a real module tree before anything is applied.

Two checks: a static one (:func:`check_adapter`: block lists exist, block ``forward`` signatures accept the declared
arguments) that runs on any device including ``meta``, and a dynamic one (:func:`probe_patterns`: record what every
block receives and returns during a real forward and compare it with the declared :class:`ForwardPattern`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fastdit.models.base import BlockGroup, ForwardPattern, ModelAdapter, resolve_attr

__all__ = [
    "AdapterError",
    "PatternReport",
    "bind_block_args",
    "block_lists",
    "check_adapter",
    "probe_patterns",
    "resolve_block_groups",
    "resolve_interleaved",
]


class AdapterError(ValueError):
    """An adapter does not fit the module it is applied to."""


def block_lists(transformer: torch.nn.Module, adapter: ModelAdapter) -> list[tuple[BlockGroup, torch.nn.ModuleList]]:
    """Resolve every block group of ``adapter`` on ``transformer``."""
    return resolve_block_groups(transformer, adapter.block_groups, adapter.family)


def resolve_block_groups(
    transformer: torch.nn.Module, groups: Sequence[BlockGroup], owner: str
) -> list[tuple[BlockGroup, torch.nn.ModuleList]]:
    """Resolve ``groups`` on ``transformer`` (``owner`` names the family in errors)."""
    return [(group, _resolve_list(transformer, group, owner)) for group in groups]


def resolve_interleaved(
    transformer: torch.nn.Module, groups: Sequence[BlockGroup], owner: str
) -> list[tuple[BlockGroup, torch.nn.ModuleList] | None]:
    """Per group, its :attr:`BlockGroup.interleaved` list resolved (``None`` where it has none)."""
    out: list[tuple[BlockGroup, torch.nn.ModuleList] | None] = []
    for group in groups:
        if group.interleaved is None:
            out.append(None)
            continue
        main = _resolve_list(transformer, group, owner)
        companion = _resolve_list(transformer, group.interleaved, owner)
        if len(companion) != len(main):
            raise AdapterError(
                f"{owner}: block group {group.path!r} ({len(main)} blocks) is interleaved with "
                f"{group.interleaved.path!r}, which has {len(companion)}; they must have the same length"
            )
        out.append((group.interleaved, companion))
    return out


def _resolve_list(transformer: torch.nn.Module, group: BlockGroup, owner: str) -> torch.nn.ModuleList:
    try:
        blocks = resolve_attr(transformer, group.path)
    except (AttributeError, IndexError) as exc:
        raise AdapterError(
            f"{owner}: block group path={group.path!r} does not exist on {type(transformer).__name__}"
        ) from exc
    if not isinstance(blocks, torch.nn.ModuleList):
        raise AdapterError(f"{owner}: block group path={group.path!r} is a {type(blocks).__name__}, not a ModuleList")
    return blocks


def _forward_signature(block: torch.nn.Module) -> inspect.Signature:
    # The class's forward, not the instance attribute: hooks may have wrapped the latter.
    return inspect.signature(type(block).forward)


def check_adapter(transformer: torch.nn.Module, adapter: ModelAdapter) -> None:
    """Static check: block lists exist and each block ``forward`` takes the arguments its pattern names.

    Raises:
        AdapterError: naming the family, the group path and the missing piece.
    """
    if not any(len(blocks) for _, blocks in block_lists(transformer, adapter)):
        raise AdapterError(f"{adapter.family}: every block group of {type(transformer).__name__} is empty")
    for group, blocks in block_lists(transformer, adapter):
        for block in {type(b): b for b in blocks}.values():
            params = _forward_signature(block).parameters
            names = list(params)[1:]  # drop self
            wanted = [group.hidden_arg] + ([group.encoder_arg] if group.pattern.takes_encoder else [])
            for name in wanted:
                if name not in names:
                    raise AdapterError(
                        f"{adapter.family}: {type(block).__name__}.forward has no parameter {name!r} "
                        f"(group {group.path!r}, pattern {group.pattern.value}); parameters: {names}"
                    )


def bind_block_args(block: torch.nn.Module, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    """Bind a block call's ``args``/``kwargs`` to its ``forward`` parameters (positional or keyword alike)."""
    sig = _forward_signature(block)
    bound = sig.bind(block, *args, **kwargs)
    return bound


@dataclass
class PatternReport:
    """What one probe saw: per group, the number of calls and the first mismatch (if any)."""

    calls: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def raise_if_failed(self) -> None:
        """Raise :class:`AdapterError` listing every mismatch."""
        if self.errors:
            raise AdapterError("; ".join(self.errors))


def _shape(x: Any) -> tuple[int, ...] | None:
    return tuple(x.shape) if isinstance(x, torch.Tensor) else None


def _check_output(group: BlockGroup, bound: inspect.BoundArguments, output: Any) -> str | None:
    pattern: ForwardPattern = group.pattern
    hidden_in = bound.arguments.get(group.hidden_arg)
    if not isinstance(hidden_in, torch.Tensor):
        return f"{group.hidden_arg} is {type(hidden_in).__name__}, not a tensor"
    needs_tuple = pattern.returns_encoder or not isinstance(output, torch.Tensor)
    if needs_tuple and (not isinstance(output, (tuple, list)) or len(output) < (2 if pattern.returns_encoder else 1)):
        return f"returned {type(output).__name__}, pattern {pattern.value} expects a tuple"
    hidden_out, encoder_out = pattern.unpack(output)
    if _shape(hidden_out) != _shape(hidden_in):
        return f"hidden output shape {_shape(hidden_out)} != input shape {_shape(hidden_in)}"
    if pattern.returns_encoder and pattern.takes_encoder:
        encoder_in = bound.arguments.get(group.encoder_arg)
        if encoder_out is not None and _shape(encoder_out) != _shape(encoder_in):
            return f"encoder output shape {_shape(encoder_out)} != input shape {_shape(encoder_in)}"
    return None


def probe_patterns(transformer: torch.nn.Module, adapter: ModelAdapter, run: Callable[[], Any]) -> PatternReport:
    """Run ``run()`` (which must call ``transformer``) and check every block call against its group's pattern.

    Blocks that return ``None`` for the encoder stream (e.g. the last SD3 block) pass: the pattern allows it.
    """
    report = PatternReport()
    handles = []

    def make_hook(group: BlockGroup):
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            report.calls[group.path] = report.calls.get(group.path, 0) + 1
            try:
                bound = bind_block_args(module, args, kwargs)
            except TypeError as exc:
                report.errors.append(f"{adapter.family}: {group.path}: call does not bind: {exc}")
                return
            problem = _check_output(group, bound, output)
            if problem and len(report.errors) < 8:
                report.errors.append(f"{adapter.family}: {group.path} (pattern {group.pattern.value}): {problem}")

        return hook

    try:
        for group, blocks in block_lists(transformer, adapter):
            for block in blocks:
                handles.append(block.register_forward_hook(make_hook(group), with_kwargs=True))
        run()
    finally:
        for h in handles:
            h.remove()
    for group, blocks in block_lists(transformer, adapter):
        if len(blocks) and not report.calls.get(group.path):
            report.errors.append(f"{adapter.family}: block group {group.path!r} was never called")
    return report
