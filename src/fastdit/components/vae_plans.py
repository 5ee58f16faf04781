"""The VAE-parallel plans, keyed by exact VAE class (fully qualified name; no prefix or ``isinstance`` matching).

A plan says what a band decode of that class needs beyond plain ``Conv2d``/``Conv3d`` halos and ``GroupNorm``
reductions (which the engine finds itself): modules that pad inside their ``forward`` (with their halo), softmax
and linear attention modules, and how many image rows one latent row covers (encoder bands are whole multiples).
A VAE class without a plan here is refused by ``Parallel(vae=True)``, naming the class.
"""

from __future__ import annotations

import torch

from fastdit.components.vae_parallel import HaloSpec, VaePlan

__all__ = ["VAE_PLANS", "plan_for"]

_D = "diffusers.models"
_AE = f"{_D}.autoencoders"
_ATTENTION = f"{_D}.attention_processor.Attention"
# Pads (0, 1, 0, 1) before a 3 x 3 stride-2 convolution with no padding of its own: one row below, stride 2.
_DOWNSAMPLE_2D = {f"{_D}.downsampling.Downsample2D": HaloSpec(radius=1, stride=2)}


def _levels_factor(vae: torch.nn.Module) -> int:
    """Image rows per latent row of a VAE that halves the resolution between consecutive levels."""
    return 2 ** (len(vae.config.block_out_channels) - 1)


VAE_PLANS: dict[str, VaePlan] = {
    f"{_AE}.autoencoder_kl.AutoencoderKL": VaePlan(
        encode_unit=_levels_factor,
        halo_modules=_DOWNSAMPLE_2D,
        attention=(_ATTENTION,),
        notes="3 x 3 convolutions (halo 1), Downsample2D (halo 2, stride 2), GroupNorm, mid-block softmax attention.",
    ),
}
"""Plans by fully qualified VAE class name."""


def plan_for(vae: torch.nn.Module) -> VaePlan | None:
    """The plan of exactly ``type(vae)`` (``None`` if there is none)."""
    cls = type(vae)
    return VAE_PLANS.get(f"{cls.__module__}.{cls.__qualname__}")
