"""Sizing shared by the tiny decoder-only language models (Llama, Qwen, Gemma, GLM, SmolLM3, Mistral text towers).

Every tiny decoder LM has query heads of :data:`HEAD_DIM` channels (``hidden_size // HEAD_DIM`` of them), an MLP twice
as wide as the hidden size, and takes its vocabulary size and special-token ids from its tokenizer. Families differ
in the KV head count, the context length and a few class-specific fields, which are the arguments here.
"""

from __future__ import annotations

from typing import Any

__all__ = ["HEAD_DIM", "decoder_lm_kwargs", "vision_token_ids"]

HEAD_DIM = 16


def decoder_lm_kwargs(
    tokenizer: Any,
    hidden_size: int,
    num_layers: int,
    *,
    num_key_value_heads: int = 1,
    head_dim: bool = True,
    max_position_embeddings: int | None = 1024,
    vocab_size: int | None = None,
    token_ids: tuple[str, ...] = ("pad", "bos", "eos"),
    **extra: Any,
) -> dict[str, Any]:
    """Config arguments of a tiny decoder LM (for a config class or a ``text_config`` dict).

    Args:
        tokenizer: The tokenizer the model reads: it gives the vocabulary size and the special-token ids.
        hidden_size: Model width; a multiple of :data:`HEAD_DIM`.
        num_layers: Decoder layers.
        num_key_value_heads: KV heads (1: grouped-query attention like the real models; the query head count for
            plain multi-head attention).
        head_dim: Whether to write ``head_dim`` (some config classes derive it and take no such argument).
        max_position_embeddings: Context length, or ``None`` to leave the class default.
        vocab_size: Embedding rows when they must exceed the tokenizer's vocabulary (``None``: ``len(tokenizer)``).
        token_ids: Which of the tokenizer's ``<name>_token_id`` to write (e.g. ``("pad", "eos")``).
        **extra: Further config arguments (sliding window, RoPE parameters, ids set to ``None``, ...).

    Returns:
        Keyword arguments for the config.
    """
    kwargs: dict[str, Any] = {
        "vocab_size": len(tokenizer) if vocab_size is None else vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": hidden_size // HEAD_DIM,
        "num_key_value_heads": num_key_value_heads,
    }
    if head_dim:
        kwargs["head_dim"] = HEAD_DIM
    if max_position_embeddings is not None:
        kwargs["max_position_embeddings"] = max_position_embeddings
    for name in token_ids:
        kwargs[f"{name}_token_id"] = getattr(tokenizer, f"{name}_token_id")
    return {**kwargs, **extra}


def vision_token_ids(tokenizer: Any, *, vision_end: bool = True) -> dict[str, int]:
    """The image, video and vision-start (and vision-end) token ids of a Qwen-style VL config, from ``tokenizer``."""
    ids = {
        "image_token_id": tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        "video_token_id": tokenizer.convert_tokens_to_ids("<|video_pad|>"),
        "vision_start_token_id": tokenizer.convert_tokens_to_ids("<|vision_start|>"),
    }
    if vision_end:
        ids["vision_end_token_id"] = tokenizer.convert_tokens_to_ids("<|vision_end|>")
    return ids
