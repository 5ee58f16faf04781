"""One traced forward of a transformer: what every block list receives and returns, and where attention runs.

:func:`trace_forward` installs removable hooks (block calls, module-call boundaries, linear inputs of each list's
first block) and a :class:`~torch.overrides.TorchFunctionMode` that records every
``torch.nn.functional.scaled_dot_product_attention`` call with the module path that made it, runs the transformer
once and returns a :class:`Trace`. Tensors are kept (the model is tiny) so the analysis can compare them by value.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["AttentionCall", "BlockCall", "ModuleCall", "Trace", "block_list_paths", "trace_forward"]


@dataclass
class BlockCall:
    """One call of one block of a list.

    Attributes:
        group: Path of the block list.
        index: Index of the block in its list.
        order: Position of this call among every block call of the forward.
        arguments: The call bound to the block's ``forward`` parameters (name -> value).
        positional: Names of the parameters that were passed by position.
        output: What the block returned.
    """

    group: str
    index: int
    order: int
    arguments: dict[str, Any]
    positional: tuple[str, ...]
    output: Any


@dataclass
class AttentionCall:
    """One ``scaled_dot_product_attention`` call.

    Attributes:
        module: Path of the innermost module running when it was called (``""``: the root forward).
        query, key: Shapes of the query and key tensors, ``(B, H, S, D)``.
        mask: Shape of the attention mask, ``None`` if none was passed.
        enable_gqa: Whether the call asked SDPA to broadcast fewer key/value heads.
    """

    module: str
    query: tuple[int, ...]
    key: tuple[int, ...]
    mask: tuple[int, ...] | None
    enable_gqa: bool


@dataclass
class ModuleCall:
    """One call of a module outside the block lists (or a direct child of a list's first block).

    Attributes:
        path: Module path.
        cls: Class name.
        inputs: Tensors passed in (name -> tensor; nested tuples flattened as ``name[i]``).
        outputs: Tensors returned (``out`` or ``out[i]`` -> tensor).
    """

    path: str
    cls: str
    inputs: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]


@dataclass
class Trace:
    """Everything one forward showed.

    Attributes:
        root_arguments: The root call bound to ``forward``'s parameters.
        blocks: Every block call, in execution order.
        attention: Every attention call, in order.
        modules: Calls of modules outside the block lists, and of the direct children of each list's first block.
        linear_inputs: Per linear layer inside the first block of each list, the shape of its first input.
        error: Why the forward failed (``None``: it ran).
    """

    root_arguments: dict[str, Any] = field(default_factory=dict)
    blocks: list[BlockCall] = field(default_factory=list)
    attention: list[AttentionCall] = field(default_factory=list)
    modules: list[ModuleCall] = field(default_factory=list)
    linear_inputs: dict[str, tuple[int, ...]] = field(default_factory=dict)
    error: str | None = None

    def calls_of(self, group: str) -> list[BlockCall]:
        """The calls of one block list, in order."""
        return [call for call in self.blocks if call.group == group]


def block_list_paths(root: torch.nn.Module) -> list[str]:
    """Paths of the non-empty ``ModuleList`` s of ``root`` that are not inside an entry of another list.

    A list inside a block (an attention's ``to_out``) is part of that block, not a block list of its own.
    """
    found: list[str] = []
    for path, module in root.named_modules():
        if not path or not isinstance(module, torch.nn.ModuleList) or not len(module):
            continue
        if any(path.startswith(f"{outer}.") for outer in found):
            continue
        # Lists of bare layers (a stack of Linear or norm layers) are not block lists: a block has children.
        if all(not list(child.children()) for child in module):
            continue
        found.append(path)
    return found


def tensors_in(value: Any, name: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``(label, tensor)`` for each tensor in ``value`` (nested tuples, lists and dicts one level deep)."""
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            if isinstance(item, torch.Tensor):
                yield f"{name}[{i}]", item
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, torch.Tensor):
                yield f"{name}[{key!r}]", item


def _bind(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[dict[str, Any], tuple[str, ...]]:
    try:
        sig = inspect.signature(type(module).forward)
        bound = sig.bind(module, *args, **kwargs)
    except (TypeError, ValueError):
        names = tuple(f"arg{i}" for i in range(len(args)))
        return {**dict(zip(names, args, strict=True)), **kwargs}, names
    params = list(sig.parameters)[1 : 1 + len(args)]
    arguments = {k: v for k, v in bound.arguments.items() if k != next(iter(sig.parameters))}
    # **kwargs collected under one name are spread back out: their keys are what the caller passed.
    for name, param in sig.parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD and name in arguments:
            arguments.update(arguments.pop(name))
    return arguments, tuple(params)


class _AttentionRecorder(TorchFunctionMode):
    def __init__(self, stack: list[str], calls: list[AttentionCall]) -> None:
        super().__init__()
        self.stack, self.calls = stack, calls

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            named = dict(zip(("query", "key", "value", "attn_mask"), args, strict=False)) | kwargs
            query, key, mask = named["query"], named["key"], named.get("attn_mask")
            self.calls.append(
                AttentionCall(
                    module=self.stack[-1] if self.stack else "",
                    query=tuple(query.shape),
                    key=tuple(key.shape),
                    mask=tuple(mask.shape) if isinstance(mask, torch.Tensor) else None,
                    enable_gqa=bool(kwargs.get("enable_gqa", False)),
                )
            )
        return func(*args, **kwargs)


def _install(root: torch.nn.Module, trace: Trace, lists: list[str], stack: list[str]) -> list[Any]:
    """Register every hook of one trace; returns the handles."""
    handles: list[Any] = []
    firsts = {f"{path}.0" for path in lists}
    inside = tuple(f"{path}." for path in lists)

    def push(path: str) -> Callable:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            stack.append(path)

        return hook

    def pop(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        stack.pop()

    def boundary(path: str) -> Callable:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            arguments, _ = _bind(module, args, kwargs)
            inputs = {label: t for name, v in arguments.items() for label, t in tensors_in(v, name)}
            trace.modules.append(ModuleCall(path, type(module).__name__, inputs, dict(tensors_in(output, "out"))))

        return hook

    def block(group: str, index: int) -> Callable:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            arguments, positional = _bind(module, args, kwargs)
            trace.blocks.append(BlockCall(group, index, len(trace.blocks), arguments, positional, output))

        return hook

    def linear(path: str) -> Callable:
        def hook(module: torch.nn.Module, args: tuple) -> None:
            if args and isinstance(args[0], torch.Tensor):
                trace.linear_inputs.setdefault(path, tuple(args[0].shape))

        return hook

    for path, module in root.named_modules():
        if path:
            handles.append(module.register_forward_pre_hook(push(path), with_kwargs=True))
            handles.append(module.register_forward_hook(pop, with_kwargs=True, always_call=True))
        parent = path.rpartition(".")[0]
        # Boundaries: modules outside the lists down to depth 2, and the direct children of each list's first block.
        outside = bool(path) and not path.startswith(inside) and path not in lists and path.count(".") < 2
        if outside or parent in firsts:
            handles.append(module.register_forward_hook(boundary(path), with_kwargs=True))
        if parent in lists:
            handles.append(module.register_forward_hook(block(parent, int(path.rpartition(".")[2])), with_kwargs=True))
        if isinstance(module, torch.nn.Linear) and any(path.startswith(f"{first}.") for first in firsts):
            handles.append(module.register_forward_pre_hook(linear(path)))
    return handles


@contextmanager
def _hooked(root: torch.nn.Module, trace: Trace, lists: list[str]) -> Iterator[None]:
    stack: list[str] = []
    handles = _install(root, trace, lists, stack)
    try:
        with _AttentionRecorder(stack, trace.attention):
            yield
    finally:
        for handle in handles:
            handle.remove()


def trace_forward(root: torch.nn.Module, args: tuple, kwargs: dict) -> Trace:
    """Run ``root(*args, **kwargs)`` once under no-grad with every recording hook installed.

    A forward that raises is reported in :attr:`Trace.error` (with what was recorded up to the failure).
    """
    trace = Trace()
    trace.root_arguments, _ = _bind(root, args, kwargs)
    lists = block_list_paths(root)
    with torch.no_grad(), _hooked(root, trace, lists):
        try:
            root(*args, **kwargs)
        except Exception as exc:  # a model's own failure is a finding, not a crash of the tool
            trace.error = f"{type(exc).__name__}: {exc}"
    return trace
