"""Configs and results as plain, strict-JSON data."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

__all__ = ["json_ready", "plain", "plain_options"]


def plain(config: Any) -> dict[str, Any] | None:
    """A config dataclass as ``{"type": <class name>, <field>: <value>, ...}`` (``None`` stays ``None``).

    Static FP8's :class:`~fastdit.config.ActivationScales` inside a config are summarised (the model and the number
    of layers): hundreds of per-layer maxima would drown every report that shows the configuration.
    """
    from fastdit.config import ActivationScales

    if config is None:
        return None
    data = dataclasses.asdict(config)
    for name in list(data):
        scales = getattr(config, name)
        if isinstance(scales, ActivationScales):
            data[name] = {"type": "ActivationScales", "model": scales.model, "num_layers": len(scales.layers)}
    return {"type": type(config).__name__, **data}


def plain_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """``fastdit.accelerate`` keyword arguments with each config dataclass as :func:`plain` data."""

    def one(value: Any) -> Any:
        return plain(value) if dataclasses.is_dataclass(value) and not isinstance(value, type) else value

    return {name: one(value) for name, value in options.items()}


def json_ready(value: Any) -> Any:
    """``value`` with every non-finite float inside it written as ``"inf"``, ``"-inf"`` or ``"nan"``.

    JSON has no infinity, and PSNR of identical outputs is infinite; see :func:`fastdit.metrics.json_safe`.
    """
    if isinstance(value, float) and not math.isfinite(value):
        from fastdit.metrics import json_safe  # imported only when needed: it loads scikit-image

        return json_safe(value)
    if isinstance(value, Mapping):
        return {key: json_ready(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(item) for item in value]
    return value
