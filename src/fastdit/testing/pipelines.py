"""Run the tiny pipelines the family adapters declare (tests, demos and the CLI's offline mode)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fastdit.api import accelerate, disable, summary
from fastdit.models.base import TinyPipeline
from fastdit.models.registry import get_family
from fastdit.modular import call_pipeline, is_modular, set_progress_bar_config

__all__ = ["build_tiny", "run_accelerated", "run_tiny", "save_tiny", "scaled_steps"]


def build_tiny(family: str, variant: str | None = None) -> tuple[Any, TinyPipeline]:
    """Build the tiny pipeline ``variant`` of ``family`` (the first one if ``None``)."""
    tiny = get_family(family).tiny(variant)
    pipe = tiny.build()
    set_progress_bar_config(pipe, disable=True)
    return pipe, tiny


def run_tiny(pipe: Any, tiny: TinyPipeline, *, seed: int = 0, **overrides: Any) -> np.ndarray:
    """Run ``pipe`` with the tiny call arguments and return its output as a float numpy array.

    Image pipelines return ``(batch, H, W, C)``; video pipelines ``(batch, frames, H, W, C)``; audio pipelines
    (``audios``) ``(batch, channels, samples)``. A ModularPipeline is called through
    :func:`fastdit.modular.call_pipeline`.
    """
    kwargs = {**tiny.call_kwargs, **overrides}
    kwargs.setdefault("output_type", "np")
    torch.manual_seed(seed)  # a few pipelines draw from the global RNG besides the generator
    with torch.no_grad():
        result = call_pipeline(pipe, **kwargs, generator=torch.Generator().manual_seed(seed))
    if isinstance(result, torch.Tensor):  # a pipeline returning its output bare (SANA-WM's refiner)
        result = result.detach().float().cpu().numpy()
    if isinstance(result, np.ndarray):
        return result.astype(np.float32)
    out = next(
        getattr(result, name) for name in ("frames", "images", "image", "video", "audios") if hasattr(result, name)
    )
    if isinstance(out, torch.Tensor):  # audio pipelines return tensors unless asked for numpy
        out = out.detach().float().cpu().numpy()
    return np.asarray(out, dtype=np.float32)


def run_accelerated(
    pipe: Any, tiny: TinyPipeline, options: dict[str, Any], **overrides: Any
) -> tuple[np.ndarray, dict[str, Any]]:
    """Run ``pipe`` accelerated with ``options`` (:func:`fastdit.accelerate`'s keywords), then disable it.

    Returns:
        The output (as :func:`run_tiny`) and the summary of each transformer by name, taken before disabling.
    """
    accelerate(pipe, **options)
    try:
        return run_tiny(pipe, tiny, **overrides), summary(pipe).transformers
    finally:
        disable(pipe)


def scaled_steps(tiny: TinyPipeline, numerator: int, denominator: int = 1) -> dict[str, Any]:
    """The tiny call's step counts times ``numerator / denominator`` (rounded down), as call overrides.

    A step count is ``num_inference_steps``, or a list of per-stage counts named ``*num_inference_steps_list``
    (Helios' pyramid pipeline takes no ``num_inference_steps``, only ``pyramid_num_inference_steps_list``), or else
    the length of a ``sigmas`` schedule (its last entry the final sigma, not a step).
    """
    scaled: dict[str, Any] = {}
    for name, value in tiny.call_kwargs.items():
        if name == "num_inference_steps":
            scaled[name] = value * numerator // denominator
        elif name.endswith("num_inference_steps_list"):
            scaled[name] = [steps * numerator // denominator for steps in value]
    if not scaled and "sigmas" in tiny.call_kwargs:
        # A pipeline counting its steps by an explicit descending schedule ending at its final sigma (SANA-WM's
        # refiner): the same range, evenly respaced over the scaled count.
        sigmas = [float(s) for s in tiny.call_kwargs["sigmas"]]
        count = max(1, (len(sigmas) - 1) * numerator // denominator)
        head = np.linspace(sigmas[0], sigmas[-2], count) if count > 1 else np.asarray(sigmas[:1])
        scaled["sigmas"] = (*(float(s) for s in head), sigmas[-1])
    if not scaled:
        raise KeyError(f"tiny pipeline {tiny.name!r} declares no step count (num_inference_steps or sigmas)")
    return scaled


def save_tiny(family: str, directory: str, variant: str | None = None) -> str:
    """Save a tiny pipeline with ``save_pretrained`` so it loads with ``from_pretrained(directory)``."""
    pipe, _ = build_tiny(family, variant)
    # A ModularPipeline's index then points every component at the directory (its default as of diffusers 0.43).
    extra = {"overwrite_modular_index": True} if is_modular(pipe) else {}
    pipe.save_pretrained(directory, safe_serialization=True, **extra)
    return directory
