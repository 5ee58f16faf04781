"""A tiny SmolLM3 text encoder (``SmolLM3ForCausalLM``) built locally (Bria-Fibo).

SmolLM3 uses the Llama 3 vocabulary, so the tokenizer is the tiny Llama-3-style one of
:mod:`fastdit.testing.components.llama`. The embedding table keeps SmolLM3's full 128,256 rows although the tiny
tokenizer emits only a few hundred ids: pipelines hard-code Llama 3 ids (Bria-Fibo encodes an empty prompt as the
``<|begin_of_text|>`` id 128000), which must stay valid rows.
"""

from __future__ import annotations

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
    head_dim = 16
    config = SmolLM3Config(
        vocab_size=SMOLLM3_VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=hidden_size // head_dim,
        num_key_value_heads=1,
        max_position_embeddings=4096,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    return build(SmolLM3ForCausalLM, config, seed=seed), tok
