"""Error types that carry what they are about, so front ends (CLI, server) map them without reading message text."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["FieldError", "FieldsError"]


class FieldError(ValueError):
    """A bad value for one named field of a config or request: ``owner.field=value: requirement``.

    A ``ValueError``, so code that catches those keeps working. The CLI maps ``(owner, field)`` to the flag that set
    the value; the server maps it to the request field.

    Attributes:
        owner: What the field belongs to (a config class name such as ``"DBCache"``, or ``"model"`` for a request).
        field: The field's name (``"threshold"``).
        value: The offending value.
        requirement: What the value must be (``"must be a number >= 0"``).
    """

    def __init__(self, owner: str, field: str, value: Any, requirement: str) -> None:
        super().__init__(f"{owner}.{field}={value!r}: {requirement}")
        self.owner = owner
        self.field = field
        self.value = value
        self.requirement = requirement

    def __reduce__(self) -> tuple:  # picklable across worker processes
        return (type(self), (self.owner, self.field, self.value, self.requirement))


class FieldsError(FieldError):
    """Values of several fields of one owner that are refused together: ``owner(a=1, b=2): requirement``.

    Each value may be fine alone (``DBCache(fn=5, bn=5)`` on a model of 8 blocks leaves no middle block), so a front
    end names the source of every one of :attr:`fields`. ``field`` and ``value`` are the first of them, so code that
    reads a :class:`FieldError` still finds one field.

    Attributes:
        fields: The refused values by field name, in the order they are named.
    """

    def __init__(self, owner: str, fields: Mapping[str, Any], requirement: str) -> None:
        if not fields:
            raise TypeError("FieldsError needs at least one field")
        first = next(iter(fields))
        super().__init__(owner, first, fields[first], requirement)
        self.fields = dict(fields)
        # The message of a combination lists every value, in the shape of the owner's repr.
        values = ", ".join(f"{name}={value!r}" for name, value in self.fields.items())
        self.args = (f"{owner}({values}): {requirement}",)

    def __reduce__(self) -> tuple:
        return (type(self), (self.owner, self.fields, self.requirement))


class ArgumentError(FieldError):
    """A value of one argument of a call (owner: the function, e.g. ``"accelerate"``), refused as a whole.

    Unlike a config field, the value is a whole config (``cache=DBCache(...)``) refused for what it meets — the model,
    another argument, the machine — so the message reads ``argument=value: requirement``.
    """

    def __init__(self, owner: str, field: str, value: Any, requirement: str) -> None:
        super().__init__(owner, field, value, requirement)
        self.args = (f"{field}={value}: {requirement}",)

    def __str__(self) -> str:
        return self.args[0]


class UnavailableError(ArgumentError, NotImplementedError):
    """An argument asks for something this version of fastdit does not provide (also a ``NotImplementedError``)."""
