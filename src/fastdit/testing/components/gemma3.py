"""A tiny Gemma 3 text encoder (``Gemma3ForConditionalGeneration``) built locally (LTX-2).

Text tower: 2 layers, 2 query heads over 1 KV head; vision tower: a one-layer SigLIP for 32x32 images, present
because the class requires one (the pipelines here feed text only). The tokenizer is the shared tiny
``GemmaTokenizer`` of :mod:`fastdit.testing.components.gemma2`; image special-token ids keep their Gemma 3
defaults, outside this small vocabulary, so text never matches them.
"""

from __future__ import annotations

import copy

from fastdit.testing.components.decoder_lm import decoder_lm_kwargs
from fastdit.testing.components.encoders import build
from fastdit.testing.components.gemma2 import gemma_tokenizer

__all__ = ["gemma3_config", "gemma3_model"]


def gemma3_config(hidden_size: int = 32, num_layers: int = 2):
    """A ``Gemma3Config`` sized for the tiny Gemma tokenizer."""
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

    text = Gemma3TextConfig(**decoder_lm_kwargs(gemma_tokenizer(), hidden_size, num_layers, sliding_window=64))
    vision = SiglipVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8
    )
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=16)


def gemma3_model(hidden_size: int = 32, num_layers: int = 2, seed: int = 0):
    """``(Gemma3ForConditionalGeneration, GemmaTokenizer)``; a private tokenizer copy (pipelines set its padding)."""
    from transformers import Gemma3ForConditionalGeneration

    model = build(Gemma3ForConditionalGeneration, gemma3_config(hidden_size, num_layers), seed=seed)
    return model, copy.deepcopy(gemma_tokenizer())
