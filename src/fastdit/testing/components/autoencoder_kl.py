"""A tiny random-weight ``AutoencoderKL`` for the image pipelines that use the classic KL VAE.

FLUX.1, SD3, AuraFlow, Chroma, HiDream, PixArt, DiT, HunyuanDiT, Lumina2, LongCat-Image and others all decode with
``AutoencoderKL``; they differ in the latent channel count, the spatial scale factor, the latent normalisation
constants and (for pipelines that always encode at ~1 MP) the width, which are the arguments here.
"""

from __future__ import annotations

from fastdit.testing.components.encoders import build

__all__ = ["autoencoder_kl"]


def autoencoder_kl(
    *,
    latent_channels: int = 4,
    num_levels: int = 2,
    scaling_factor: float = 0.18215,
    shift_factor: float | None = None,
    use_quant_conv: bool = True,
    width: int | None = None,
    layers_per_block: int = 1,
    seed: int = 0,
):
    """A tiny ``AutoencoderKL`` whose spatial scale factor is ``2 ** (num_levels - 1)``.

    Args:
        latent_channels: Channels of the latent the transformer denoises.
        num_levels: Encoder/decoder resolution levels; pipelines derive ``vae_scale_factor`` from their count.
        scaling_factor: Latent scaling constant written to the config (pipelines read it when decoding).
        shift_factor: Latent shift constant (SD3/Flux-style VAEs), or ``None`` for the SD-style VAE.
        use_quant_conv: Whether the 1x1 quant convolutions exist (SD-style VAEs have them, SD3-style do not).
        width: Channels (and norm groups) of every level, for narrow VAEs that stay cheap at full resolution;
            ``None`` gives 8 channels on the first level and 16 on the others, in 8 norm groups.
        layers_per_block: ResNet layers per encoder level (the decoder has one more); 0 keeps encodes cheap.
        seed: RNG seed for the weights.

    Returns:
        The VAE in ``eval()`` mode.
    """
    from diffusers import AutoencoderKL

    return build(
        AutoencoderKL,
        seed=seed,
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * num_levels,
        up_block_types=("UpDecoderBlock2D",) * num_levels,
        block_out_channels=(8,) + (16,) * (num_levels - 1) if width is None else (width,) * num_levels,
        layers_per_block=layers_per_block,
        latent_channels=latent_channels,
        norm_num_groups=8 if width is None else width,
        sample_size=32,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        use_quant_conv=use_quant_conv,
        use_post_quant_conv=use_quant_conv,
    )
