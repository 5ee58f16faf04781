"""Tiny random-weight video VAEs for the VAE-parallel tests: HunyuanVideo 1.5, Cosmos, Magvit, Qwen-Image 2.1, Allegro.

Each is the smallest configuration that still has every kind of module its class uses (causal convolutions, the
resamplers of each kind, norms, the mid-block attention), so a band decode exercises all of them.
"""

from __future__ import annotations

from typing import Any

from fastdit.testing.components.encoders import build

__all__ = [
    "autoencoder_kl_allegro",
    "autoencoder_kl_cosmos",
    "autoencoder_kl_hunyuanvideo15",
    "autoencoder_kl_magvit",
    "autoencoder_kl_qwenimage21",
]


def autoencoder_kl_hunyuanvideo15(*, seed: int = 0) -> Any:
    """A tiny ``AutoencoderKLHunyuanVideo15``: 3 levels of 8-16 channels (spatial factor 4, temporal factor 2)."""
    from diffusers import AutoencoderKLHunyuanVideo15

    return build(
        AutoencoderKLHunyuanVideo15,
        seed=seed,
        latent_channels=4,
        block_out_channels=(8, 16, 16),
        layers_per_block=1,
        spatial_compression_ratio=4,
        temporal_compression_ratio=2,
    )


def autoencoder_kl_cosmos(*, seed: int = 0) -> Any:
    """A tiny ``AutoencoderKLCosmos``: Haar patches of 2 and two levels (spatial factor 8, temporal factor 4),
    attention in the mid block and in the levels at resolution 8 (``resolution=16``)."""
    from diffusers import AutoencoderKLCosmos

    return build(
        AutoencoderKLCosmos,
        seed=seed,
        latent_channels=4,
        encoder_block_out_channels=(8, 8, 8, 8),
        decode_block_out_channels=(8, 8, 8, 8),
        attention_resolutions=(8,),
        resolution=16,
        num_layers=1,
        patch_size=2,
        patch_type="haar",
        spatial_compression_ratio=8,
        temporal_compression_ratio=4,
        latents_mean=None,
        latents_std=None,
    )


def autoencoder_kl_magvit(*, spatial_group_norm: bool = True, seed: int = 0) -> Any:
    """A tiny ``AutoencoderKLMagvit``: 3 levels of 8 channels (spatial factor 4, temporal factor 2)."""
    from diffusers import AutoencoderKLMagvit

    return build(
        AutoencoderKLMagvit,
        seed=seed,
        latent_channels=4,
        block_out_channels=(8, 8, 8),
        down_block_types=("SpatialDownBlock3D", "SpatialTemporalDownBlock3D", "SpatialTemporalDownBlock3D"),
        up_block_types=("SpatialUpBlock3D", "SpatialTemporalUpBlock3D", "SpatialTemporalUpBlock3D"),
        layers_per_block=1,
        norm_num_groups=4,
        spatial_group_norm=spatial_group_norm,
    )


def autoencoder_kl_qwenimage21(*, seed: int = 0) -> Any:
    """A tiny ``AutoencoderKLQwenImage21``: patches of 2, 2 residual levels (spatial factor 8), mid-block attention."""
    from diffusers import AutoencoderKLQwenImage21

    return build(
        AutoencoderKLQwenImage21,
        seed=seed,
        base_dim=8,
        decoder_base_dim=8,
        z_dim=4,
        dim_mult=[1, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True],
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
        in_channels=12,  # RGB in patches of 2 x 2: the patchify folds them into channels before the encoder
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=8,
        scale_factor_temporal=2,
    )


def autoencoder_kl_allegro(*, seed: int = 0) -> Any:
    """A tiny ``AutoencoderKLAllegro``: 2 levels of 8 channels (spatial factor 2, temporal factor 2).

    It decodes and encodes by tiles only; its tiles (``kernel``, ``stride``: frames, rows, columns of the sample) are
    shrunk from 24 x 320 x 320 to 4 x 8 x 8 so a small video holds several of them along every dim.
    """
    from diffusers import AutoencoderKLAllegro

    vae = build(
        AutoencoderKLAllegro,
        seed=seed,
        block_out_channels=(8, 8),
        down_block_types=("AllegroDownBlock3D",) * 2,
        up_block_types=("AllegroUpBlock3D",) * 2,
        temporal_downsample_blocks=(True, False),
        temporal_upsample_blocks=(False, True),
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=4,
        temporal_compression_ratio=2,
        sample_size=16,
    )
    vae.kernel, vae.stride = (4, 8, 8), (2, 4, 4)
    return vae
