"""Named access to a module call's arguments, whether the caller passed them by position or by keyword.

Models call their blocks both ways (Flux by keyword, Wan positionally), so every hook that reads or replaces an
argument goes through :class:`ForwardArgs` instead of assuming one calling convention.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any

import torch

__all__ = ["ForwardArgs", "UnsteppedCalls", "forward_parameters"]


def forward_parameters(module: torch.nn.Module) -> list[str]:
    """The names of ``module``'s ``forward`` parameters after ``self``, in order (from its class, not a hook)."""
    return list(inspect.signature(type(module).forward).parameters)[1:]


class ForwardArgs:
    """Where each named argument of a module's ``forward`` arrives.

    Args:
        module: The module whose calls are read.
        names: The argument names to locate.
        positions: Positions for names absent from the signature (arguments that arrive through ``*args``).
    """

    def __init__(
        self, module: torch.nn.Module, names: Iterable[str], positions: Mapping[str, int | None] | None = None
    ) -> None:
        self.params = forward_parameters(module)
        extra = positions or {}
        self.positions: dict[str, int | None] = {
            name: self.params.index(name) if name in self.params else extra.get(name) for name in names
        }

    def get(self, name: str, args: tuple | list, kwargs: Mapping[str, Any]) -> Any:
        """The value of ``name`` in this call, or ``None`` if it was not passed."""
        if name in kwargs:
            return kwargs[name]
        position = self.positions.get(name)
        return args[position] if position is not None and position < len(args) else None

    def param(self, name: str, args: tuple | list, kwargs: Mapping[str, Any]) -> Any:
        """The value of any ``forward`` parameter ``name`` (not only the located ones), or ``None``."""
        if name in kwargs:
            return kwargs[name]
        i = self.params.index(name)
        return args[i] if i < len(args) else None

    def replace(self, name: str, value: Any, args: list, kwargs: dict) -> None:
        """Put ``value`` where ``name`` arrived (in place; nothing happens if it was not passed)."""
        if name in kwargs:
            kwargs[name] = value
            return
        position = self.positions.get(name)
        if position is not None and position < len(args):
            args[position] = value

    def passed(self, name: str, args: tuple | list, kwargs: Mapping[str, Any]) -> bool:
        """Whether the call passed ``name``."""
        position = self.positions.get(name)
        return name in kwargs or (position is not None and position < len(args))


class UnsteppedCalls:
    """Recognises the calls of a module that are no denoising step (:attr:`ModelAdapter.unstepped_calls`).

    A mark is a plain value the argument equals (Wan-Animate-2's ``kv_cache_mode="extract"``), a ``dict`` whose
    entries a ``dict`` argument holds (AnyFlow-FAR's ``kv_cache_flag={"is_cache_step": True, ...}``) or a function of
    the argument's value returning ``True`` for such a call (GLM-Image's ``kv_caches`` object in its write mode).
    Read on the host from the call's global arguments, so every rank decides alike.

    Args:
        module: The module whose calls are read.
        marks: Argument name -> the values (or predicates) marking an unstepped call.
    """

    def __init__(self, module: torch.nn.Module, marks: Mapping[str, tuple[Any, ...]] | None) -> None:
        self.marks = dict(marks or {})
        self._args = ForwardArgs(module, tuple(self.marks))

    def __bool__(self) -> bool:
        return bool(self.marks)

    def __call__(self, args: tuple | list, kwargs: Mapping[str, Any]) -> bool:
        """Whether this call is an unstepped one."""
        for name, marks in self.marks.items():
            value = self._args.get(name, args, kwargs)
            for mark in marks:
                if callable(mark):
                    if mark(value):
                        return True
                elif isinstance(mark, Mapping):
                    if isinstance(value, Mapping) and all(k in value and value[k] == v for k, v in mark.items()):
                        return True
                elif not isinstance(value, torch.Tensor) and value == mark:  # plain values (a mode string)
                    return True
        return False
