"""A tiny random-weight ``AutoencoderKLMochi`` with its attention blocks (the pipelines' tiny VAE has none).

Its group norms have 32 groups, so 32 channels per level is the least; one ResNet layer per level, attention in
every encoder level that has a layer.
"""

from __future__ import annotations

from fastdit.testing.components.encoders import build

__all__ = ["autoencoder_kl_mochi"]


def autoencoder_kl_mochi(*, latent_channels: int = 4, seed: int = 0):
    """A tiny ``AutoencoderKLMochi``: 4 levels of 32 channels (space x8, time x6 as the real one).

    Args:
        latent_channels: Channels of the latent; latent statistics are the identity.
        seed: RNG seed for the weights.

    Returns:
        The VAE in ``eval()`` mode.
    """
    from diffusers import AutoencoderKLMochi

    return build(
        AutoencoderKLMochi,
        seed=seed,
        encoder_block_out_channels=(32,) * 4,
        decoder_block_out_channels=(32,) * 4,
        latent_channels=latent_channels,
        layers_per_block=(0, 0, 0, 1, 1),
        add_attention_block=(False, False, False, True, True),
        latents_mean=(0.0,) * latent_channels,
        latents_std=(1.0,) * latent_channels,
    )
