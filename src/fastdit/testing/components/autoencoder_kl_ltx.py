"""Tiny random-weight LTX video VAEs: ``AutoencoderKLLTXVideo`` (LTX-Video) and ``AutoencoderKLLTX2Video`` (LTX-2).

Both classes share one layout: 8 channels per level, one ResNet layer per level, patch size 1, a causal encoder and a
non-causal decoder, by default without timestep conditioning or noise injection. Every level that scales halves space
and time, so three scaling levels give factors x8 (space) and x8 (time); the real VAEs are x32 and x8.
"""

from __future__ import annotations

from typing import Any

import torch

from fastdit.testing.components.encoders import build

__all__ = ["autoencoder_kl_ltx2_video", "autoencoder_kl_ltx_video"]


def _layout(
    latent_channels: int, scaling: tuple[bool, ...], timestep_conditioning: bool = False, inject_noise: bool = False
) -> dict[str, Any]:
    """Constructor arguments of the shared layout; ``scaling`` says which levels scale (one entry per level)."""
    levels = len(scaling)
    return {
        "latent_channels": latent_channels,
        "block_out_channels": (8,) * levels,
        "decoder_block_out_channels": (8,) * levels,
        "layers_per_block": (1,) * (levels + 1),
        "decoder_layers_per_block": (1,) * (levels + 1),
        "spatio_temporal_scaling": scaling,
        "decoder_spatio_temporal_scaling": scaling,
        "decoder_inject_noise": (inject_noise,) * (levels + 1),
        "upsample_residual": (False,) * levels,
        "upsample_factor": (1,) * levels,
        "timestep_conditioning": timestep_conditioning,
        "patch_size": 1,
        "patch_size_t": 1,
        "encoder_causal": True,
        "decoder_causal": False,
    }


def _noise_scales(vae: torch.nn.Module) -> torch.nn.Module:
    """Give the injected noise a weight: the classes initialise its per-channel scales to zero, which would make
    ``inject_noise`` a no-op in a random-weight VAE."""
    with torch.no_grad():
        for name, param in vae.named_parameters():
            if name.rsplit(".", 1)[-1].startswith("per_channel_scale"):
                param.fill_(0.1)
    return vae


def autoencoder_kl_ltx_video(
    *, latent_channels: int = 8, timestep_conditioning: bool = False, inject_noise: bool = False, seed: int = 0
):
    """A tiny ``AutoencoderKLLTXVideo``: 4 levels, the last one without scaling (space x8, time x8).

    Args:
        latent_channels: Channels of the latent the transformer denoises.
        timestep_conditioning: Condition the decoder on the decode timestep (LTX-Video 0.9.1 and later); its
            ``decode`` then takes ``temb``.
        inject_noise: Add spatial noise inside every decoder ResNet layer (LTX-Video 0.9.1).
        seed: RNG seed for the weights.

    Returns:
        The VAE in ``eval()`` mode.
    """
    from diffusers import AutoencoderKLLTXVideo

    layout = _layout(latent_channels, (True, True, True, False), timestep_conditioning, inject_noise)
    return _noise_scales(build(AutoencoderKLLTXVideo, seed=seed, **layout))


def autoencoder_kl_ltx2_video(
    *, latent_channels: int = 4, timestep_conditioning: bool = False, inject_noise: bool = False, seed: int = 0
):
    """A tiny ``AutoencoderKLLTX2Video``: 3 spatio-temporal levels (space x8, time x8).

    Args:
        latent_channels: Channels of the latent the transformer denoises.
        timestep_conditioning: Condition the decoder on the decode timestep; its ``decode`` then takes ``temb``.
        inject_noise: Add spatial noise inside every decoder ResNet layer.
        seed: RNG seed for the weights.

    Returns:
        The VAE in ``eval()`` mode.
    """
    from diffusers import AutoencoderKLLTX2Video

    return _noise_scales(
        build(
            AutoencoderKLLTX2Video,
            seed=seed,
            **_layout(latent_channels, (True, True, True), timestep_conditioning, inject_noise),
            down_block_types=("LTX2VideoDownBlock3D",) * 3,
            downsample_type=("spatiotemporal",) * 3,
            upsample_type=("spatiotemporal",) * 3,
        )
    )
