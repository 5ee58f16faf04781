"""A tiny Llama text encoder (``LlamaModel``) and a Llama-3-style tokenizer built locally (HunyuanVideo family).

The tokenizer is byte-level BPE like Llama 3's and knows its chat special tokens (``<|start_header_id|>``,
``<|end_header_id|>``, ``<|eot_id|>``, ...) plus the ``<image>`` placeholder LLaVA-style encoders expand into image
features. The chat roles and ``"\n\n"`` are single tokens, as in Llama 3, so pipelines that locate the assistant header
by token offsets (HunyuanVideo I2V) cut where they would on the real tokenizer. It adds no BOS token: prompt templates
in the tiny pipelines are written out in full.
"""

from __future__ import annotations

from fastdit.testing.components.decoder_lm import decoder_lm_kwargs
from fastdit.testing.components.encoders import build
from fastdit.testing.components.tokenizers import byte_level_bpe, cached_copy

__all__ = ["LLAMA_SPECIALS", "llama_config", "llama_model", "llama_tokenizer"]

LLAMA_SPECIALS: tuple[str, ...] = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|finetune_right_pad_id|>",
    "<image>",
)

# Ordinary (non-special) words that Llama 3 encodes as one token and prompt templates rely on.
_SINGLE_TOKENS: tuple[str, ...] = ("system", "user", "assistant", "\n\n")


@cached_copy
def llama_tokenizer(model_max_length: int = 1024):
    """A ``PreTrainedTokenizerFast`` over bytes, the shared test words and :data:`LLAMA_SPECIALS` (right padding)."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    backend = byte_level_bpe(LLAMA_SPECIALS, model_max_length)
    backend.add_tokens([AddedToken(word, normalized=False) for word in _SINGLE_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        model_max_length=model_max_length,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        pad_token="<|finetune_right_pad_id|>",
    )


def llama_config(hidden_size: int = 32, num_layers: int = 2):
    """A ``LlamaConfig`` sized for :func:`llama_tokenizer`: 2 query heads over 1 KV head (GQA like Llama 3)."""
    from transformers import LlamaConfig

    return LlamaConfig(**decoder_lm_kwargs(llama_tokenizer(), hidden_size, num_layers))


def llama_model(hidden_size: int = 32, num_layers: int = 2, seed: int = 0):
    """``(LlamaModel, PreTrainedTokenizerFast)``."""
    from transformers import LlamaModel

    return build(LlamaModel, llama_config(hidden_size, num_layers), seed=seed), llama_tokenizer()
