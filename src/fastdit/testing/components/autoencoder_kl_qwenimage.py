"""A tiny random-weight ``AutoencoderKLQwenImage`` (causal 3-D convolutions) for Qwen-Image and Krea 2 pipelines.

Pipelines of these families derive ``vae_scale_factor`` from ``len(vae.temperal_downsample)``, so the number of
downsampling levels is the argument that sets the pixel-to-latent scale.
"""

from __future__ import annotations

from fastdit.testing.components.encoders import build

__all__ = ["autoencoder_kl_qwenimage"]


def autoencoder_kl_qwenimage(
    *,
    latent_channels: int = 4,
    num_downsamples: int = 3,
    base_dim: int = 4,
    num_res_blocks: int = 1,
    seed: int = 0,
):
    """A tiny ``AutoencoderKLQwenImage`` with spatial scale factor ``2 ** num_downsamples``.

    Args:
        latent_channels: Channels of the latent (``z_dim``); latent normalisation is the identity.
        num_downsamples: Spatial downsampling levels (none of them temporal).
        base_dim: Channel width of every level.
        num_res_blocks: Residual blocks per encoder level (the decoder has one more); 0 keeps full-resolution
            encodes cheap for pipelines that resize inputs to ~1 MP.
        seed: RNG seed for the weights.

    Returns:
        The VAE in ``eval()`` mode.
    """
    from diffusers import AutoencoderKLQwenImage

    return build(
        AutoencoderKLQwenImage,
        seed=seed,
        base_dim=base_dim,
        z_dim=latent_channels,
        dim_mult=[1] * (num_downsamples + 1),
        num_res_blocks=num_res_blocks,
        temperal_downsample=[False] * num_downsamples,
        latents_mean=[0.0] * latent_channels,
        latents_std=[1.0] * latent_channels,
    )
