"""A tiny Qwen3 text encoder (``Qwen3Model``) and a Qwen3-style tokenizer built locally (Z-Image, Ovis-Image).

The tokenizer is byte-level BPE with Qwen's chat special tokens and a short chat template of our own that renders the
ChatML layout the pipelines expect (``<|im_start|>role\\n...<|im_end|>``), including the empty think block Qwen3
emits when ``enable_thinking=False``; message content may be a string or a list of ``{"type": "text"}`` parts.
"""

from __future__ import annotations

from fastdit.testing.components.encoders import build
from fastdit.testing.components.tokenizers import byte_level_bpe, cached_copy

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
    from transformers import PreTrainedTokenizerFast, Qwen2TokenizerFast

    base = PreTrainedTokenizerFast(tokenizer_object=byte_level_bpe(QWEN3_SPECIALS, model_max_length))
    return Qwen2TokenizerFast(
        tokenizer_object=base._tokenizer,
        model_max_length=model_max_length,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        chat_template=QWEN3_CHAT_TEMPLATE,
    )


def qwen3_config(hidden_size: int = 32, num_layers: int = 2):
    """A ``Qwen3Config`` sized for :func:`qwen3_tokenizer`: 2 query heads over 1 KV head of 16 (GQA like Qwen3)."""
    from transformers import Qwen3Config

    tok = qwen3_tokenizer()
    head_dim = 16
    return Qwen3Config(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=hidden_size // head_dim,
        num_key_value_heads=1,
        head_dim=head_dim,
        max_position_embeddings=1024,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )


def qwen3_model(hidden_size: int = 32, num_layers: int = 2, seed: int = 0):
    """``(Qwen3Model, Qwen2TokenizerFast)``."""
    from transformers import Qwen3Model

    return build(Qwen3Model, qwen3_config(hidden_size, num_layers), seed=seed), qwen3_tokenizer()
