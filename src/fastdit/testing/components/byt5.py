"""A tiny ByT5 text encoder: a ``T5EncoderModel`` over the byte vocabulary of ``ByT5Tokenizer`` (glyph text encoders).

``ByT5Tokenizer`` needs no vocabulary file (its tokens are the 256 bytes plus three specials), so the real tokenizer
class is used as is.
"""

from __future__ import annotations

from fastdit.testing.components.encoders import build

__all__ = ["byt5_encoder"]


def byt5_encoder(d_model: int = 32, num_layers: int = 2, seed: int = 0):
    """``(T5EncoderModel, ByT5Tokenizer)`` with ``d_model`` channels."""
    from transformers import ByT5Tokenizer, T5Config, T5EncoderModel

    tok = ByT5Tokenizer()
    config = T5Config(
        vocab_size=len(tok),
        d_model=d_model,
        d_ff=2 * d_model,
        d_kv=8,
        num_layers=num_layers,
        num_heads=max(1, d_model // 8),
        relative_attention_num_buckets=8,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        decoder_start_token_id=tok.pad_token_id,
    )
    return build(T5EncoderModel, config, seed=seed), tok
