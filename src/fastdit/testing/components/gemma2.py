"""A tiny Gemma 2 text encoder (``Gemma2Model``) and a ``GemmaTokenizer`` built locally (Sana, Lumina-Image 2.0).

The tokenizer is a SentencePiece-style BPE like Gemma's: spaces become ``▁``, unknown bytes fall back to ``<0xNN>``
pieces, and a BOS token is prepended.
"""

from __future__ import annotations

import copy
import string

from fastdit.testing.components.decoder_lm import decoder_lm_kwargs
from fastdit.testing.components.encoders import build
from fastdit.testing.components.tokenizers import WORDS, cached_copy, merge_left_to_right

__all__ = ["gemma2_config", "gemma2_model", "gemma_tokenizer"]

_SPECIALS: tuple[str, ...] = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>")


@cached_copy
def gemma_tokenizer(model_max_length: int = 1024):
    """A ``GemmaTokenizer`` over byte-fallback pieces, single characters and ``▁``-prefixed :data:`WORDS`."""
    from transformers import GemmaTokenizer

    vocab: dict[str, int] = {}
    for piece in _SPECIALS:
        vocab[piece] = len(vocab)
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for ch in "▁" + string.ascii_lowercase + string.digits + string.punctuation:
        vocab.setdefault(ch, len(vocab))
    merges: list[tuple[str, str]] = []
    for word in WORDS:
        merge_left_to_right(list("▁" + word), vocab, merges)  # "▁ c a t" -> "▁c a t" -> "▁ca t" -> "▁cat"
    return GemmaTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length, add_bos_token=True)


def gemma2_config(hidden_size: int = 32, num_layers: int = 2):
    """A ``Gemma2Config`` sized for :func:`gemma_tokenizer`: 2 query heads over 1 KV head of 16 (GQA like Gemma 2)."""
    from transformers import Gemma2Config

    return Gemma2Config(**decoder_lm_kwargs(gemma_tokenizer(), hidden_size, num_layers, sliding_window=64))


def gemma2_model(hidden_size: int = 32, num_layers: int = 2, seed: int = 0):
    """``(Gemma2Model, GemmaTokenizer)``; the tokenizer is a private copy because pipelines set its padding side."""
    from transformers import Gemma2Model

    model = build(Gemma2Model, gemma2_config(hidden_size, num_layers), seed=seed)
    return model, copy.deepcopy(gemma_tokenizer())
