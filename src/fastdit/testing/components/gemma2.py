"""A tiny Gemma 2 text encoder (``Gemma2Model``) and a ``GemmaTokenizer`` built locally (Sana, Lumina-Image 2.0).

The tokenizer is a SentencePiece-style BPE like Gemma's: spaces become ``▁``, unknown bytes fall back to ``<0xNN>``
pieces, and a BOS token is prepended.
"""

from __future__ import annotations

import copy
import string

from fastdit.testing.components.encoders import build
from fastdit.testing.components.tokenizers import WORDS, cached_copy

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
        # Merge left to right: "▁ c a t" -> "▁c a t" -> "▁ca t" -> "▁cat".
        pieces = list("▁" + word)
        while len(pieces) > 1:
            pair = (pieces[0], pieces[1])
            if pair not in merges:
                merges.append(pair)
            merged = pieces[0] + pieces[1]
            vocab.setdefault(merged, len(vocab))
            pieces = [merged, *pieces[2:]]
    return GemmaTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length, add_bos_token=True)


def gemma2_config(hidden_size: int = 32, num_layers: int = 2):
    """A ``Gemma2Config`` sized for :func:`gemma_tokenizer`: 2 query heads over 1 KV head of 16 (GQA like Gemma 2)."""
    from transformers import Gemma2Config

    tok = gemma_tokenizer()
    head_dim = 16
    return Gemma2Config(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=hidden_size // head_dim,
        num_key_value_heads=1,
        head_dim=head_dim,
        max_position_embeddings=1024,
        sliding_window=64,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )


def gemma2_model(hidden_size: int = 32, num_layers: int = 2, seed: int = 0):
    """``(Gemma2Model, GemmaTokenizer)``; the tokenizer is a private copy because pipelines set its padding side."""
    from transformers import Gemma2Model

    model = build(Gemma2Model, gemma2_config(hidden_size, num_layers), seed=seed)
    return model, copy.deepcopy(gemma_tokenizer())
