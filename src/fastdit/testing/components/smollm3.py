"""A tiny SmolLM3 text encoder (``SmolLM3ForCausalLM``) built locally (Bria-Fibo).

SmolLM3 uses the Llama 3 vocabulary, so the tokenizer is the tiny Llama-3-style one of
:mod:`fastdit.testing.components.llama`. The embedding table keeps SmolLM3's full 128,256 rows although the tiny
tokenizer emits only a few hundred ids: pipelines hard-code Llama 3 ids (Bria-Fibo encodes an empty prompt as the
``<|begin_of_text|>`` id 128000), which must stay valid rows.
"""

from __future__ import annotations

from fastdit.testing.components.decoder_lm import decoder_lm_kwargs
from fastdit.testing.components.encoders import build
from fastdit.testing.components.llama import llama_tokenizer

__all__ = ["SMOLLM3_VOCAB_SIZE", "smollm3_model"]

SMOLLM3_VOCAB_SIZE = 128256


def smollm3_model(hidden_size: int = 32, num_layers: int = 2, seed: int = 0):
    """``(SmolLM3ForCausalLM, PreTrainedTokenizerFast)``: 2 query heads over 1 KV head of 16, RoPE off every 4th layer.

    Returns:
        The causal LM (pipelines read its ``hidden_states``) in ``eval()`` mode and the tiny Llama 3 tokenizer.
    """
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    tok = llama_tokenizer()
    kwargs = decoder_lm_kwargs(
        tok, hidden_size, num_layers, head_dim=False, max_position_embeddings=4096, vocab_size=SMOLLM3_VOCAB_SIZE
    )
    config = SmolLM3Config(**kwargs)
    return build(SmolLM3ForCausalLM, config, seed=seed), tok
