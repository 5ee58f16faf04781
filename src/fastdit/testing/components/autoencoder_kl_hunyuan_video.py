"""A tiny random-weight ``AutoencoderKLHunyuanVideo`` (HunyuanVideo, Kandinsky 5 video pipelines)."""

from __future__ import annotations

from fastdit.testing.components.encoders import build

__all__ = ["autoencoder_kl_hunyuan_video"]


def autoencoder_kl_hunyuan_video(*, latent_channels: int = 4, seed: int = 0):
    """A tiny ``AutoencoderKLHunyuanVideo``: 4 levels of 8 channels (spatial factor 8, temporal factor 4).

    Args:
        latent_channels: Channels of the latent the transformer denoises.
        seed: RNG seed for the weights.

    Returns:
        The VAE in ``eval()`` mode.
    """
    from diffusers import AutoencoderKLHunyuanVideo

    return build(
        AutoencoderKLHunyuanVideo,
        seed=seed,
        latent_channels=latent_channels,
        down_block_types=("HunyuanVideoDownBlock3D",) * 4,
        up_block_types=("HunyuanVideoUpBlock3D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        norm_num_groups=4,
        spatial_compression_ratio=8,
        temporal_compression_ratio=4,
    )
