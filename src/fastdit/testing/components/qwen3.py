"""A tiny Qwen3 text encoder (``Qwen3Model``) and a Qwen3-style tokenizer built locally (Z-Image, Ovis-Image).

The tokenizer is byte-level BPE with Qwen's chat special tokens and a short chat template of our own that renders the
ChatML layout the pipelines expect (``<|im_start|>role\\n...<|im_end|>``), including the empty think block Qwen3
emits when ``enable_thinking=False``; message content may be a string or a list of ``{"type": "text"}`` parts.
"""

from __future__ import annotations

from fastdit.testing.components.decoder_lm import decoder_lm_kwargs
from fastdit.testing.components.encoders import build
from fastdit.testing.components.tokenizers import cached_copy, qwen_chat_tokenizer

__all__ = ["QWEN3_CHAT_TEMPLATE", "QWEN3_SPECIALS", "qwen3_config", "qwen3_model", "qwen3_tokenizer"]

QWEN3_SPECIALS: tuple[str, ...] = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
)  # fmt: skip

QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)


@cached_copy
def qwen3_tokenizer(model_max_length: int = 1024):
    """A ``Qwen2TokenizerFast`` (the class Qwen3 checkpoints use) with a ChatML chat template."""
    return qwen_chat_tokenizer(QWEN3_SPECIALS, model_max_length, chat_template=QWEN3_CHAT_TEMPLATE)


def qwen3_config(hidden_size: int = 32, num_layers: int = 2):
    """A ``Qwen3Config`` sized for :func:`qwen3_tokenizer`: 2 query heads over 1 KV head of 16 (GQA like Qwen3)."""
    from transformers import Qwen3Config

    kwargs = decoder_lm_kwargs(qwen3_tokenizer(), hidden_size, num_layers, token_ids=("pad", "eos"), bos_token_id=None)
    return Qwen3Config(**kwargs)


def qwen3_model(hidden_size: int = 32, num_layers: int = 2, seed: int = 0):
    """``(Qwen3Model, Qwen2TokenizerFast)``."""
    from transformers import Qwen3Model

    return build(Qwen3Model, qwen3_config(hidden_size, num_layers), seed=seed), qwen3_tokenizer()
