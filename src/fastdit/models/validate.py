"""Check an adapter against a real module tree before anything is applied.

Two checks: a static one (:func:`check_adapter`: block lists exist, block ``forward`` signatures accept the declared
arguments) that runs on any device including ``meta``, and a dynamic one (:func:`probe_patterns`: record what every
block receives and returns during a real forward and compare it with the declared :class:`ForwardPattern`).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fastdit.attrs import expand_path, is_pattern
from fastdit.models.base import BlockGroup, ForwardPattern, ModelAdapter, resolve_attr

__all__ = [
    "AdapterError",
    "PatternReport",
    "bind_block_args",
    "block_lists",
    "check_adapter",
    "check_block_call",
    "concrete_groups",
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
    """Resolve ``groups`` on ``transformer`` (``owner`` names the family in errors).

    A group with a ``*`` path becomes one group per ``ModuleList`` it matches (its path made concrete), an optional
    group whose path does not exist none; every other group is exactly one, in declaration order.
    """
    return [(group, _resolve_list(transformer, group, owner)) for group in concrete_groups(transformer, groups)]


def concrete_groups(transformer: torch.nn.Module, groups: Sequence[BlockGroup]) -> list[BlockGroup]:
    """``groups`` with each ``*`` path expanded to the lists it matches and each missing optional list left out."""
    out: list[BlockGroup] = []
    for group in groups:
        if is_pattern(group.path):
            matched = [name for name in expand_path(transformer, group.path) if _is_list(transformer, name)]
            out += [dataclasses.replace(group, path=name) for name in matched]
        elif group.optional and not _exists(transformer, group.path):
            continue
        else:
            out.append(group)
    return out


def _exists(transformer: torch.nn.Module, path: str) -> bool:
    try:
        resolve_attr(transformer, path)
    except (AttributeError, IndexError):
        return False
    return True


def _is_list(transformer: torch.nn.Module, path: str) -> bool:
    return isinstance(resolve_attr(transformer, path), torch.nn.ModuleList)


def resolve_interleaved(
    transformer: torch.nn.Module, groups: Sequence[BlockGroup], owner: str
) -> list[tuple[BlockGroup, torch.nn.ModuleList] | None]:
    """Per resolved group (as :func:`resolve_block_groups` lists them), its :attr:`BlockGroup.interleaved` list
    resolved (``None`` where it has none)."""
    out: list[tuple[BlockGroup, torch.nn.ModuleList] | None] = []
    for group in concrete_groups(transformer, groups):
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
        raise AdapterError(
            f"{adapter.family}: {type(transformer).__name__} has no blocks in the block groups "
            f"{[g.path for g in adapter.block_groups]}"
        )
    for group, blocks in block_lists(transformer, adapter):
        try:
            kinds = {(type(b), group.pattern_at(i, len(blocks))): b for i, b in enumerate(blocks)}
        except ValueError as exc:
            raise AdapterError(f"{adapter.family}: {exc}") from None
        for (_, pattern), block in kinds.items():
            params = _forward_signature(block).parameters
            names = list(params)[1:]  # drop self
            wanted = [group.hidden_arg] + ([group.encoder_arg] if pattern.takes_encoder else [])
            for name in wanted:
                if name not in names:
                    raise AdapterError(
                        f"{adapter.family}: {type(block).__name__}.forward has no parameter {name!r} "
                        f"(group {group.path!r}, pattern {pattern.value}); parameters: {names}"
                    )
    _check_timestep_arg(transformer, adapter)
    _check_step_invariant(transformer, adapter)


def _check_step_invariant(transformer: torch.nn.Module, adapter: ModelAdapter) -> None:
    """Each declared step-invariant module lies outside the blocks and its inputs are ``forward`` parameters.

    A declared module this transformer lacks is no error (some exist only in some configurations: a projection the
    widths make unnecessary); the cache reports it as left out, and the family suite requires its tiny pipelines to
    have every one.
    """
    params = inspect.signature(type(transformer).forward).parameters
    holders = {group.path.split(".", 1)[0] for group in adapter.block_groups}
    for rule in adapter.step_invariant:
        if rule.module.split(".", 1)[0] in holders:
            raise AdapterError(
                f"{adapter.family}: step_invariant names {rule.module!r}, which is inside the block list "
                f"{rule.module.split('.', 1)[0]!r}: only modules outside the blocks repeat between steps"
            )
        missing = [name for name in rule.inputs if name not in params]
        if missing:
            raise AdapterError(
                f"{adapter.family}: step_invariant {rule.module!r} reads {missing}, which are not parameters of "
                f"{type(transformer).__name__}.forward {list(params)[1:]}"
            )


def _check_timestep_arg(transformer: torch.nn.Module, adapter: ModelAdapter) -> None:
    """A declared ``timestep_arg`` must be a parameter of the transformer's ``forward`` (else runs go undetected)."""
    if adapter.timestep_arg is None:
        return
    params = inspect.signature(type(transformer).forward).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if adapter.timestep_arg not in params and not takes_any:
        names = list(params)[1:]
        raise AdapterError(
            f"{adapter.family}: timestep_arg={adapter.timestep_arg!r} is not a parameter of "
            f"{type(transformer).__name__}.forward {names}; name the one that carries the timestep (or None)"
        )
    for name in adapter.unstepped_calls:
        if name not in params:
            raise AdapterError(
                f"{adapter.family}: unstepped_calls names {name!r}, which is not a parameter of "
                f"{type(transformer).__name__}.forward {list(params)[1:]}"
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


def _distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().mean() / (b.float().abs().mean() + 1e-12))


def _swapped(hidden_in: Any, encoder_in: Any, hidden_out: Any, encoder_out: Any) -> str | None:
    """Evidence that the two returned streams are the other way round (only when their shapes cannot tell).

    Blocks are residual, so each output stream stays nearer its own input than the other stream's; a declared
    order whose distances are twice the swapped order's is taken as wrong.
    """
    tensors = (hidden_in, encoder_in, hidden_out, encoder_out)
    if not all(isinstance(t, torch.Tensor) for t in tensors) or len({t.shape for t in tensors}) != 1:
        return None
    declared = _distance(hidden_out, hidden_in) + _distance(encoder_out, encoder_in)
    swapped = _distance(hidden_out, encoder_in) + _distance(encoder_out, hidden_in)
    if swapped < 0.5 * declared:
        return (
            f"the returned streams look swapped: read as declared they differ from their inputs by {declared:.3g} "
            f"(relative L1, summed), the other way round by {swapped:.3g}"
        )
    return None


def check_block_call(
    group: BlockGroup, pattern: ForwardPattern, bound: inspect.BoundArguments, output: Any
) -> str | None:
    """What is wrong with one block call read as ``pattern`` (``None`` if it fits).

    Args:
        group: The block's group (argument names).
        pattern: The block's own pattern (:meth:`BlockGroup.pattern_at`).
        bound: The call's arguments bound to the block's ``forward`` (:func:`bind_block_args`).
        output: What the block returned.
    """
    hidden_in = bound.arguments.get(group.hidden_arg)
    if not isinstance(hidden_in, torch.Tensor):
        return f"{group.hidden_arg} is {type(hidden_in).__name__}, not a tensor"
    needs_tuple = pattern.returns_encoder or not isinstance(output, torch.Tensor)
    if needs_tuple and (not isinstance(output, (tuple, list)) or len(output) < (2 if pattern.returns_encoder else 1)):
        return f"returned {type(output).__name__}, pattern {pattern.value} expects a tuple"
    hidden_out, encoder_out = pattern.unpack(output)
    if _shape(hidden_out) != _shape(hidden_in):
        return f"hidden output shape {_shape(hidden_out)} != input shape {_shape(hidden_in)}"
    encoder_in = bound.arguments.get(group.encoder_arg) if pattern.takes_encoder else None
    if pattern.returns_encoder and pattern.takes_encoder:
        if encoder_out is not None and _shape(encoder_out) != _shape(encoder_in):
            return f"encoder output shape {_shape(encoder_out)} != input shape {_shape(encoder_in)}"
        return _swapped(hidden_in, encoder_in, hidden_out, encoder_out)
    if pattern.takes_encoder and isinstance(output, (tuple, list)) and len(output) > 1:
        second = output[1]
        if isinstance(encoder_in, torch.Tensor) and _shape(second) == _shape(encoder_in) != _shape(hidden_in):
            return (
                f"pattern {pattern.value} returns only the hidden states, but the block also returned a tensor "
                f"shaped like {group.encoder_arg} {_shape(encoder_in)}: declare a pattern that returns it"
            )
    return None


def probe_patterns(transformer: torch.nn.Module, adapter: ModelAdapter, run: Callable[[], Any]) -> PatternReport:
    """Run ``run()`` (which must call ``transformer``) and check every block call against its group's pattern.

    Blocks that return ``None`` for the encoder stream (e.g. the last SD3 block) pass: the pattern allows it.
    """
    report = PatternReport()
    handles = []

    def make_hook(group: BlockGroup, pattern: ForwardPattern):
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            report.calls[group.path] = report.calls.get(group.path, 0) + 1
            try:
                bound = bind_block_args(module, args, kwargs)
            except TypeError as exc:
                report.errors.append(f"{adapter.family}: {group.path}: call does not bind: {exc}")
                return
            problem = check_block_call(group, pattern, bound, output)
            if problem and len(report.errors) < 8:
                report.errors.append(f"{adapter.family}: {group.path} (pattern {pattern.value}): {problem}")

        return hook

    try:
        for group, blocks in block_lists(transformer, adapter):
            for i, block in enumerate(blocks):
                hook = make_hook(group, group.pattern_at(i, len(blocks)))
                handles.append(block.register_forward_hook(hook, with_kwargs=True))
        run()
    finally:
        for h in handles:
            h.remove()
    for group, blocks in block_lists(transformer, adapter):
        if len(blocks) and not report.calls.get(group.path):
            report.errors.append(f"{adapter.family}: block group {group.path!r} was never called")
    return report
