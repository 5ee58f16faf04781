"""Error types that carry what they are about, so front ends (CLI, server) map them without reading message text."""

from __future__ import annotations

from typing import Any

__all__ = ["FieldError"]


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
