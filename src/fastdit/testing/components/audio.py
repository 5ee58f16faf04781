"""Tiny random-weight audio autoencoders and text encoders, and a test waveform, for the audio tiny pipelines.

Each builder seeds the RNG, builds from a small config (no Hub) and returns the module in ``eval()`` mode.
"""

from __future__ import annotations

from fastdit.testing.components.encoders import build

__all__ = ["autoencoder_oobleck", "autoencoder_same", "t5gemma_encoder", "waveform"]


def autoencoder_oobleck(
    *,
    latent_channels: int = 4,
    audio_channels: int = 2,
    sampling_rate: int = 16,
    ratios: tuple[int, ...] = (2, 4),
    seed: int = 0,
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


def autoencoder_same(*, latent_dim: int = 4, sampling_rate: int = 16, seed: int = 0):
    """A one-level ``AutoencoderSAME`` (Stable Audio 3) downsampling by 8: patches of 4 samples, one stride-2 level
    of one differential-attention transformer layer."""
    from diffusers import AutoencoderSAME

    return build(
        AutoencoderSAME,
        seed=seed,
        audio_channels=2,
        patch_size=4,
        encoder_channels=8,
        encoder_c_mults=(2,),
        encoder_strides=(2,),
        encoder_transformer_depths=(1,),
        latent_dim=latent_dim,
        dim_heads=8,
        ff_mult=2,
        sampling_rate=sampling_rate,
    )


def t5gemma_encoder(hidden_size: int = 32, num_layers: int = 2, seed: int = 0, max_length: int = 16):
    """``(T5GemmaEncoderModel, GemmaTokenizer)``: an encoder-only T5Gemma over the local Gemma tokenizer (a private
    copy padding to ``max_length`` tokens: pipelines pad prompts to the tokenizer's maximum length)."""
    import copy

    from transformers import T5GemmaConfig, T5GemmaEncoderModel, T5GemmaModuleConfig

    from fastdit.testing.components.decoder_lm import decoder_lm_kwargs
    from fastdit.testing.components.gemma2 import gemma_tokenizer

    tokenizer = copy.deepcopy(gemma_tokenizer())
    tokenizer.model_max_length = max_length
    module = decoder_lm_kwargs(tokenizer, hidden_size, num_layers, sliding_window=64)
    config = T5GemmaConfig(
        encoder=T5GemmaModuleConfig(**module),
        decoder=T5GemmaModuleConfig(**module),
        is_encoder_decoder=False,
        vocab_size=len(tokenizer),
    )
    return build(T5GemmaEncoderModel, config, seed=seed), tokenizer


def waveform(channels: int = 2, samples: int = 128, seed: int = 0):
    """A reproducible test waveform ``(1, channels, samples)`` in [-1, 1]: two sines per channel and some noise."""
    import math

    import torch

    generator = torch.Generator().manual_seed(seed)
    t = torch.arange(samples, dtype=torch.float32)
    rows = []
    for channel in range(channels):
        tone = 0.4 * torch.sin(2 * math.pi * t * (3 + channel) / 64) + 0.2 * torch.sin(2 * math.pi * t * 11 / 64)
        rows.append(tone + 0.05 * torch.randn(samples, generator=generator))
    return torch.stack(rows)[None].clamp(-1.0, 1.0)
