"""A tiny GLM text encoder (``GlmModel``) and a GLM-4-style tokenizer built locally (CogView4 family).

The tokenizer is byte-level BPE like GLM-4's and, like it, prefixes every encoded text with ``[gMASK]<sop>``; its pad
token is ``<|endoftext|>`` (CogView4 left-pads prompts to a multiple of 16 tokens with it).
"""

from __future__ import annotations

from fastdit.testing.components.decoder_lm import decoder_lm_kwargs
from fastdit.testing.components.encoders import build
from fastdit.testing.components.tokenizers import byte_level_bpe, cached_copy

__all__ = ["glm_model", "glm_tokenizer"]

_SPECIALS = ("<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|user|>", "<|assistant|>")


@cached_copy
def glm_tokenizer(model_max_length: int = 1024):
    """A ``PreTrainedTokenizerFast`` over bytes and the shared test words, with GLM-4's special tokens."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    backend = byte_level_bpe(_SPECIALS, model_max_length)
    prefix = [(tok, backend.token_to_id(tok)) for tok in ("[gMASK]", "<sop>")]
    # GLM-4 marks the start of every text with "[gMASK]<sop>" when special tokens are added.
    backend.post_processor = processors.TemplateProcessing(
        single="[gMASK] <sop> $A", pair="[gMASK] <sop> $A $B", special_tokens=prefix
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        model_max_length=model_max_length,
        pad_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        padding_side="left",
    )


def glm_model(hidden_size: int = 32, num_layers: int = 2, seed: int = 0):
    """``(GlmModel, PreTrainedTokenizerFast)``: 2 layers, 2 query heads over 1 KV head (GQA like GLM-4)."""
    from transformers import GlmConfig, GlmModel

    tok = glm_tokenizer()
    config = GlmConfig(**decoder_lm_kwargs(tok, hidden_size, num_layers, token_ids=("pad", "eos"), bos_token_id=None))
    return build(GlmModel, config, seed=seed), tok
