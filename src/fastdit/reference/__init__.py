"""The built-in reference pipeline: a small trained ``FluxPipeline`` that draws handwritten digits, offline.

Random weights behave nothing like a trained model under step caching (residuals never settle, so a cache never
hits). This pipeline is trained (``tools/train_reference.py``) on scikit-learn's 8x8 handwritten digits upscaled to
32x32, ships inside the package, and loads with no network access. It gives the CLI an offline main job and the test
suite a quality check that can fail: prompt it with :func:`digit_prompt` and the digit drawn must match.

Layout (see ``docs/reference.md``): ``FluxTransformer2DModel`` with 2 double-stream + 6 single-stream blocks, a trained
``AutoencoderKL`` (scale factor 2, 4 latent channels: 32x32 pixels -> 16x16 latents -> 64 tokens), frozen random
tiny CLIP and T5 encoders with the local tokenizers, and ``FlowMatchEulerDiscreteScheduler``. The transformer has no
guidance embedding (``guidance_embeds=False``): ``guidance_scale`` is ignored and classifier-free guidance is
FluxPipeline's true CFG (``negative_prompt`` + ``true_cfg_scale > 1``, two transformer forwards per step), which
works because 10% of the training prompts were empty.
"""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

__all__ = [
    "REFERENCE_DEFAULTS",
    "REFERENCE_TRUE_CFG",
    "digit_prompt",
    "load_reference_pipeline",
    "reference_dir",
]

# The call arguments the pipeline was trained for. ``max_sequence_length`` matters: FluxPipeline pads the T5 prompt to
# this length and the transformer attends to the padding, so other lengths shift the conditioning it learned.
REFERENCE_DEFAULTS: MappingProxyType[str, Any] = MappingProxyType(
    {
        "height": 32,
        "width": 32,
        "num_inference_steps": 28,
        "max_sequence_length": 16,
        "true_cfg_scale": 1.0,
    }
)

# Extra arguments for the two-forward true-CFG path (cond and uncond branch per step).
REFERENCE_TRUE_CFG: MappingProxyType[str, Any] = MappingProxyType({"negative_prompt": "", "true_cfg_scale": 3.0})


def reference_dir() -> Path:
    """Directory of the packaged pipeline (``FluxPipeline.save_pretrained`` layout).

    Returns:
        The path to ``fastdit/reference/weights``.

    Raises:
        FileNotFoundError: If the weights are missing (e.g. a source checkout without them).
    """
    path = Path(__file__).resolve().parent / "weights"
    if not (path / "model_index.json").is_file():
        raise FileNotFoundError(f"reference weights not found in {path}; run tools/train_reference.py to create them")
    return path


def digit_prompt(digit: int) -> str:
    """The prompt the reference pipeline was trained on for ``digit``.

    Args:
        digit: A numeral 0-9.

    Returns:
        ``"a handwritten digit <digit>"``.

    Raises:
        ValueError: If ``digit`` is not in 0-9.
    """
    if not isinstance(digit, int) or not 0 <= digit <= 9:
        raise ValueError(f"digit={digit!r}: must be an int in 0-9")
    return f"a handwritten digit {digit}"


def load_reference_pipeline(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> Any:
    """Load the packaged reference ``FluxPipeline`` (offline, progress bar off).

    Args:
        device: Where to put every component.
        dtype: Parameter dtype (the weights are stored in float32).

    Returns:
        A ``diffusers.FluxPipeline``; call it with ``**REFERENCE_DEFAULTS``.
    """
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(reference_dir(), dtype=dtype, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)
