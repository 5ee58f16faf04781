"""A tiny random-weight ``AutoencoderKLCogVideoX`` with every row-mixing part of the real one.

Three levels of 8 channels (space x4, time x4), one ResNet layer per level, two GroupNorm groups: the decoder's
spatial norms, the downsampler's pad, both temporal compressions and the conv caches of frame batches all run.
"""

from __future__ import annotations

from fastdit.testing.components.encoders import build

__all__ = ["autoencoder_kl_cogvideox"]


def autoencoder_kl_cogvideox(
    *, latent_channels: int = 4, levels: int = 3, frame_batches: tuple[int, int] | None = None, seed: int = 0
):
    """A tiny ``AutoencoderKLCogVideoX``: ``levels`` levels of 8 channels (space ``2 ** (levels - 1)``, time x4).

    Args:
        latent_channels: Channels of the latent.
        levels: Encoder and decoder levels; all but the last downsample space, the first two compress time.
        frame_batches: Latent and sample frames per batch of ``decode`` and ``encode`` (the VAE's
            ``num_latent_frames_batch_size`` and ``num_sample_frames_batch_size``; default 2 and 8): smaller batches
            carry conv caches between batches of a short video.
        seed: RNG seed for the weights.

    Returns:
        The VAE in ``eval()`` mode.
    """
    from diffusers import AutoencoderKLCogVideoX

    vae = build(
        AutoencoderKLCogVideoX,
        seed=seed,
        down_block_types=("CogVideoXDownBlock3D",) * levels,
        up_block_types=("CogVideoXUpBlock3D",) * levels,
        block_out_channels=(8,) * levels,
        latent_channels=latent_channels,
        layers_per_block=1,
        norm_num_groups=2,
        temporal_compression_ratio=4,
    )
    if frame_batches is not None:
        vae.num_latent_frames_batch_size, vae.num_sample_frames_batch_size = frame_batches
    return vae
