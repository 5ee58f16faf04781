"""A tiny BERT text encoder (``BertModel``) and a WordPiece ``BertTokenizer`` built locally (HunyuanDiT)."""

from __future__ import annotations

import string

from fastdit.testing.components.encoders import build
from fastdit.testing.components.tokenizers import WORDS, cached_copy

__all__ = ["bert_model", "bert_tokenizer"]

_SPECIALS: tuple[str, ...] = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


@cached_copy
def bert_tokenizer(model_max_length: int = 512):
    """A lower-casing WordPiece ``BertTokenizer`` over :data:`WORDS`, single characters and their ``##`` pieces."""
    from transformers import BertTokenizer

    vocab: dict[str, int] = {}
    pieces = [*_SPECIALS, *WORDS]
    for ch in string.ascii_lowercase + string.digits + string.punctuation:
        pieces += [ch, "##" + ch]
    for piece in pieces:
        vocab.setdefault(piece, len(vocab))
    return BertTokenizer(vocab=vocab, model_max_length=model_max_length)


def bert_model(hidden_size: int = 32, num_layers: int = 2, seed: int = 0):
    """``(BertModel, BertTokenizer)`` with ``hidden_size // 16`` heads and room for 512 positions."""
    from transformers import BertConfig, BertModel

    tok = bert_tokenizer()
    config = BertConfig(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=max(1, hidden_size // 16),
        intermediate_size=2 * hidden_size,
        max_position_embeddings=512,
        pad_token_id=tok.pad_token_id,
    )
    return build(BertModel, config, seed=seed), tok
