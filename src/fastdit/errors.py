"""Error types that carry what they are about, so front ends (CLI, server) map them without reading message text."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "ArgumentError",
    "FastditWarning",
    "FieldError",
    "FieldsError",
    "NonFiniteOutputError",
    "ShardError",
    "UnavailableError",
]


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


class ShardError(ValueError):
    """An input of a call cannot be split over the ranks of the parallel layout (fewer tokens than ranks, a size
    not a multiple of its split unit). The layout does not fit this call, not the model: a smaller degree, or a
    larger input, does. Raised from global sizes, so every rank raises alike."""


class NonFiniteOutputError(FloatingPointError):
    """A pipeline call produced NaN or infinite values: saved, its output would be a wrong (often black) image.

    A :class:`FloatingPointError` (an :class:`ArithmeticError`), not a :class:`ValueError`: the values given may
    each be valid, the arithmetic they lead to is not. :attr:`arguments` and :attr:`components` say what was found
    to be the likely cause, so a front end can name its own flags for it.

    Attributes:
        count: Non-finite values in the output.
        total: Values in the output.
        arguments: Call arguments that likely caused it, by ``__call__`` parameter name: numbers that are not finite,
            and guidance scales far above their usual range.
        components: Pipeline components whose weights hold non-finite values (``"transformer"``, ...).
        float16: Whether the pipeline runs in float16, whose range (±65504) activations can overflow; reported
            as a cause only when nothing else was found.
    """

    def __init__(
        self,
        count: int,
        total: int,
        *,
        arguments: Mapping[str, Any] | None = None,
        components: tuple[str, ...] = (),
        float16: bool = False,
    ) -> None:
        self.count = count
        self.total = total
        self.arguments = dict(arguments or {})
        self.components = tuple(components)
        self.float16 = float16
        super().__init__(f"{self.finding}; {self.likely_cause}")

    @property
    def finding(self) -> str:
        """What is wrong, without the cause: ``"the output has 3072 non-finite values (NaN or inf) of 3072"``."""
        return f"the output has {self.count} non-finite values (NaN or inf) of {self.total}"

    @property
    def likely_cause(self) -> str:
        """The likely cause, in the library's terms (call parameter and component names)."""
        causes = [f"{name}={value!r}" for name, value in self.arguments.items()]
        if self.components:
            causes.append(f"non-finite weights in {', '.join(self.components)}")
        if causes:
            return f"likely cause: {'; '.join(causes)}"
        if self.float16:
            return "likely cause: float16 overflow (bfloat16 or float32 have the range it lacks)"
        return "no likely cause found: the call's numbers and the weights are finite"

    def __reduce__(self) -> tuple:
        return (
            _rebuild_non_finite,
            (self.count, self.total, self.arguments, self.components, self.float16),
        )


def _rebuild_non_finite(
    count: int, total: int, arguments: Mapping[str, Any], components: tuple[str, ...], float16: bool
) -> NonFiniteOutputError:
    return NonFiniteOutputError(count, total, arguments=arguments, components=components, float16=float16)


class FastditWarning(UserWarning):
    """Something fastdit cannot tell on its own and works around, e.g. where a sampler's runs begin."""
