"""Tiny-pipeline call arguments built on first read.

Family files declare their tiny pipelines at import time, but some call arguments (a test image, a prompt template
sized by a tiny encoder) come from :mod:`fastdit.testing`. Loading the registry imports every family file, so those
values are declared as :class:`Deferred` and built, with their imports, only when a caller reads them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from PIL import Image

__all__ = ["Deferred", "LazyKwargs", "tiny_image", "tiny_waveform"]


@dataclass(frozen=True)
class Deferred:
    """A value that ``factory(*args)`` builds when a :class:`LazyKwargs` holding it is read.

    ``factory`` should be a module-level function, so the arguments pickle (worker processes receive them).
    """

    factory: Callable[..., Any]
    args: tuple[Any, ...] = ()

    def build(self) -> Any:
        """Run the factory."""
        return self.factory(*self.args)


class LazyKwargs(Mapping[str, Any]):
    """Call keyword arguments whose :class:`Deferred` values are built on first read, once per key.

    A read-only mapping: ``{**kwargs, ...}`` (how callers merge overrides) builds every deferred value, and a key
    read twice returns the same object, as a value built when the family file was imported would be.
    """

    def __init__(self, values: Mapping[str, Any]) -> None:
        self._values = dict(values)
        self._built: dict[str, Any] = {}

    def __getitem__(self, key: str) -> Any:
        value = self._values[key]
        if not isinstance(value, Deferred):
            return value
        if key not in self._built:
            self._built[key] = value.build()
        return self._built[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._values!r})"


def _random_image(size: int) -> Image.Image:
    from fastdit.testing.components.images import random_image

    return random_image(size)


def tiny_image(size: int = 32) -> Deferred:
    """:func:`fastdit.testing.components.images.random_image` of ``size``, drawn on first read."""
    return Deferred(_random_image, (size,))


def _waveform(channels: int, samples: int) -> Any:
    from fastdit.testing.components.audio import waveform

    return waveform(channels, samples)


def tiny_waveform(channels: int = 2, samples: int = 128) -> Deferred:
    """:func:`fastdit.testing.components.audio.waveform`, ``(1, channels, samples)``, built on first read."""
    return Deferred(_waveform, (channels, samples))
