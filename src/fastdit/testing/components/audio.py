"""Tiny random-weight audio autoencoders shared by the audio family tiny pipelines.

Each builder seeds the RNG, builds from a small config (no Hub) and returns the module in ``eval()`` mode.
"""

from __future__ import annotations

from fastdit.testing.components.encoders import build

__all__ = ["autoencoder_oobleck"]


def autoencoder_oobleck(
    *, latent_channels: int = 4, audio_channels: int = 2, sampling_rate: int = 16, ratios: tuple[int, ...] = (2, 4),
    seed: int = 0
):
    """An ``AutoencoderOobleck`` (Stable Audio, ACE-Step) with a hop of ``prod(ratios)`` samples per latent frame.

    ``latent_channels`` is the decoder's input width; the encoder produces twice that (mean and scale). The sampling
    rate is tiny on purpose: pipelines size their audio in seconds, so a few seconds stay a few hundred samples.
    """
    from diffusers import AutoencoderOobleck

    return build(
        AutoencoderOobleck,
        seed=seed,
        encoder_hidden_size=2 * latent_channels,
        downsampling_ratios=list(ratios),
        channel_multiples=[min(i + 1, 2) for i in range(len(ratios))],
        decoder_channels=4,
        decoder_input_channels=latent_channels,
        audio_channels=audio_channels,
        sampling_rate=sampling_rate,
    )
