"""A tiny ByT5 text encoder: a ``T5EncoderModel`` over the byte vocabulary of ``ByT5Tokenizer`` (glyph text encoders).

``ByT5Tokenizer`` needs no vocabulary file (its tokens are the 256 bytes plus three specials), so the real tokenizer
class is used as is.
"""

from __future__ import annotations

from fastdit.testing.components.encoders import build, t5_config_kwargs

__all__ = ["byt5_encoder"]


def byt5_encoder(d_model: int = 32, num_layers: int = 2, seed: int = 0):
    """``(T5EncoderModel, ByT5Tokenizer)`` with ``d_model`` channels."""
    from transformers import ByT5Tokenizer, T5Config, T5EncoderModel

    tok = ByT5Tokenizer()
    return build(T5EncoderModel, T5Config(**t5_config_kwargs(tok, d_model, num_layers)), seed=seed), tok
