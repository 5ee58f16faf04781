"""Run the tiny pipelines the family adapters declare (tests, demos and the CLI's offline mode)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fastdit.models.base import TinyPipeline
from fastdit.models.registry import get_family
from fastdit.modular import call_pipeline, is_modular, set_progress_bar_config

__all__ = ["build_tiny", "run_tiny", "save_tiny", "scaled_steps"]


def build_tiny(family: str, variant: str | None = None) -> tuple[Any, TinyPipeline]:
    """Build the tiny pipeline ``variant`` of ``family`` (the first one if ``None``)."""
    tiny = get_family(family).tiny(variant)
    pipe = tiny.build()
    set_progress_bar_config(pipe, disable=True)
    return pipe, tiny


def run_tiny(pipe: Any, tiny: TinyPipeline, *, seed: int = 0, **overrides: Any) -> np.ndarray:
    """Run ``pipe`` with the tiny call arguments and return its output as a float numpy array.

    Image pipelines return ``(batch, H, W, C)``; video pipelines ``(batch, frames, H, W, C)``; audio pipelines
    ``(batch, channels, samples)``. A ModularPipeline is called through :func:`fastdit.modular.call_pipeline`.
    """
    kwargs = {**tiny.call_kwargs, **overrides}
    kwargs.setdefault("output_type", "np")
    torch.manual_seed(seed)  # a few pipelines draw from the global RNG besides the generator
    with torch.no_grad():
        result = call_pipeline(pipe, **kwargs, generator=torch.Generator().manual_seed(seed))
    out = next(getattr(result, name) for name in ("frames", "images", "image", "audios") if hasattr(result, name))
    return np.asarray(out, dtype=np.float32)


def scaled_steps(tiny: TinyPipeline, numerator: int, denominator: int = 1) -> dict[str, Any]:
    """The tiny call's step counts times ``numerator / denominator`` (rounded down), as call overrides.

    A step count is ``num_inference_steps``, or a list of per-stage counts named ``*num_inference_steps_list``
    (Helios' pyramid pipeline takes no ``num_inference_steps``, only ``pyramid_num_inference_steps_list``).
    """
    scaled: dict[str, Any] = {}
    for name, value in tiny.call_kwargs.items():
        if name == "num_inference_steps":
            scaled[name] = value * numerator // denominator
        elif name.endswith("num_inference_steps_list"):
            scaled[name] = [steps * numerator // denominator for steps in value]
    if not scaled:
        raise KeyError(f"tiny pipeline {tiny.name!r} declares no step count (num_inference_steps)")
    return scaled


def save_tiny(family: str, directory: str, variant: str | None = None) -> str:
    """Save a tiny pipeline with ``save_pretrained`` so it loads with ``from_pretrained(directory)``."""
    pipe, _ = build_tiny(family, variant)
    # A ModularPipeline's index then points every component at the directory (its default as of diffusers 0.43).
    extra = {"overwrite_modular_index": True} if is_modular(pipe) else {}
    pipe.save_pretrained(directory, safe_serialization=True, **extra)
    return directory
