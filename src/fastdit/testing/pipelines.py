"""Run the tiny pipelines the family adapters declare (tests, demos and the CLI's offline mode)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fastdit.models.base import TinyPipeline
from fastdit.models.registry import get_family

__all__ = ["build_tiny", "run_tiny", "save_tiny"]


def build_tiny(family: str, variant: str | None = None) -> tuple[Any, TinyPipeline]:
    """Build the tiny pipeline ``variant`` of ``family`` (the first one if ``None``)."""
    tiny = get_family(family).tiny(variant)
    pipe = tiny.build()
    pipe.set_progress_bar_config(disable=True)
    return pipe, tiny


def run_tiny(pipe: Any, tiny: TinyPipeline, *, seed: int = 0, **overrides: Any) -> np.ndarray:
    """Run ``pipe`` with the tiny call arguments and return its output as a float numpy array.

    Image pipelines return ``(batch, H, W, C)``; video pipelines ``(batch, frames, H, W, C)``.
    """
    kwargs = {**tiny.call_kwargs, **overrides}
    kwargs.setdefault("output_type", "np")
    torch.manual_seed(seed)  # a few pipelines draw from the global RNG besides the generator
    with torch.no_grad():
        result = pipe(**kwargs, generator=torch.Generator().manual_seed(seed))
    out = next(getattr(result, name) for name in ("frames", "images", "image") if hasattr(result, name))
    return np.asarray(out, dtype=np.float32)


def save_tiny(family: str, directory: str, variant: str | None = None) -> str:
    """Save a tiny pipeline with ``save_pretrained`` so it loads with ``from_pretrained(directory)``."""
    pipe, _ = build_tiny(family, variant)
    pipe.save_pretrained(directory, safe_serialization=True)
    return directory
