"""A tiny random-weight ``AutoencoderKLWan`` for the pipelines that decode with the Wan VAE.

Wan, SkyReels-V2, ChronoEdit, SANA-Video, Cosmos Predict2/2.5 and Bria FIBO all use this class, in the Wan 2.1 layout
(space x8, time x4) or the Wan 2.2 layout (residual blocks and a 2x2 pixel patchify: space x16); they differ in the
latent channel count, which with the layout is the argument here.
"""

from __future__ import annotations

from typing import Any

from fastdit.testing.components.encoders import build

__all__ = ["WAN_LATENT_CHANNELS", "autoencoder_kl_wan", "wan_components"]

# Latent channels of the released Wan 2.1 VAE: the class's default latent statistics have this many entries.
WAN_LATENT_CHANNELS = 16


def autoencoder_kl_wan(*, latent_channels: int = WAN_LATENT_CHANNELS, wan22: bool = False, seed: int = 0):
    """A tiny ``AutoencoderKLWan``: 3 base channels (Wan 2.1 layout) or 4 (Wan 2.2 layout), one residual block a level.

    Args:
        latent_channels: Channels of the latent (``z_dim``). With :data:`WAN_LATENT_CHANNELS` the class's default
            (Wan 2.1) latent statistics apply; any other count gets identity statistics (mean 0, std 1).
        wan22: The Wan 2.2 layout: residual blocks and a 2x2 pixel patchify, spatial factor 16 instead of 8.
        seed: RNG seed for the weights.

    Returns:
        The VAE in ``eval()`` mode.
    """
    from diffusers import AutoencoderKLWan

    extra: dict[str, Any] = {}
    if wan22:
        extra.update(is_residual=True, in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16)
    if latent_channels != WAN_LATENT_CHANNELS:
        extra.update(latents_mean=[0.0] * latent_channels, latents_std=[1.0] * latent_channels)
    return build(
        AutoencoderKLWan,
        seed=seed,
        base_dim=4 if wan22 else 3,
        z_dim=latent_channels,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        **extra,
    )


def wan_components(*, text_dim: int, scheduler: Any, seed: int = 0) -> dict[str, Any]:
    """The parts Wan-style pipelines share: a tiny UMT5 text encoder and tokenizer, the tiny Wan 2.1 VAE, ``scheduler``.

    Args:
        text_dim: The text encoder's width (the transformer's ``text_dim``).
        scheduler: The pipeline's scheduler (families differ in its class and shift).
        seed: Seed of the random weights.

    Returns:
        ``vae``, ``text_encoder``, ``tokenizer`` and ``scheduler``, as pipeline keyword arguments.
    """
    from fastdit.testing.components.encoders import umt5_encoder

    text_encoder, tokenizer = umt5_encoder(d_model=text_dim, seed=seed)
    return {"vae": autoencoder_kl_wan(seed=seed), "text_encoder": text_encoder, "tokenizer": tokenizer,
            "scheduler": scheduler}  # fmt: skip
