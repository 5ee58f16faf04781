"""Tiny random-weight text encoders and VAEs shared by the family tiny pipelines.

Every builder seeds the RNG, builds from a small config (no Hub), and returns the module in ``eval()`` mode so runs
are deterministic (dropout off).
"""

from __future__ import annotations

from typing import Any

import torch

from fastdit.testing.components.decoder_lm import HEAD_DIM, decoder_lm_kwargs, vision_token_ids
from fastdit.testing.components.tokenizers import clip_tokenizer, qwen2_tokenizer, t5_tokenizer

__all__ = [
    "build",
    "clip_text_model",
    "clip_text_model_with_projection",
    "qwen2_5_vl_model",
    "t5_config_kwargs",
    "t5_encoder",
    "umt5_encoder",
]


def build(factory: Any, *args: Any, seed: int = 0, **kwargs: Any) -> Any:
    """Seed the global RNG, call ``factory(*args, **kwargs)`` and return the result in ``eval()`` mode."""
    torch.manual_seed(seed)
    module = factory(*args, **kwargs)
    return module.eval() if isinstance(module, torch.nn.Module) else module


def _clip_config(hidden_size: int, projection_dim: int | None):
    from transformers import CLIPTextConfig

    tok = clip_tokenizer()
    kwargs = {"projection_dim": projection_dim} if projection_dim else {}
    return CLIPTextConfig(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=77,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **kwargs,
    )


def clip_text_model(hidden_size: int = 32, seed: int = 0):
    """``(CLIPTextModel, CLIPTokenizer)``."""
    from transformers import CLIPTextModel

    return build(CLIPTextModel, _clip_config(hidden_size, None), seed=seed), clip_tokenizer()


def clip_text_model_with_projection(hidden_size: int = 32, projection_dim: int = 32, seed: int = 0):
    """``(CLIPTextModelWithProjection, CLIPTokenizer)`` (SD3, HunyuanDiT-style pooled embeddings)."""
    from transformers import CLIPTextModelWithProjection

    config = _clip_config(hidden_size, projection_dim)
    return build(CLIPTextModelWithProjection, config, seed=seed), clip_tokenizer()


def t5_config_kwargs(tokenizer: Any, d_model: int, num_layers: int) -> dict[str, Any]:
    """Config arguments of a tiny T5-family encoder (T5, UMT5, ByT5) reading ``tokenizer``.

    Args:
        tokenizer: Gives the vocabulary size and the pad/EOS ids.
        d_model: Model width; heads are 8 channels wide.
        num_layers: Encoder layers.

    Returns:
        Keyword arguments for ``T5Config`` or ``UMT5Config``.
    """
    return dict(
        vocab_size=len(tokenizer),
        d_model=d_model,
        d_ff=2 * d_model,
        d_kv=8,
        num_layers=num_layers,
        num_heads=max(1, d_model // 8),
        relative_attention_num_buckets=8,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )


def t5_encoder(d_model: int = 32, num_layers: int = 2, seed: int = 0):
    """``(T5EncoderModel, T5TokenizerFast)``."""
    from transformers import T5Config, T5EncoderModel

    config = T5Config(**t5_config_kwargs(t5_tokenizer(), d_model, num_layers))
    return build(T5EncoderModel, config, seed=seed), t5_tokenizer()


def umt5_encoder(d_model: int = 32, num_layers: int = 2, seed: int = 0):
    """``(UMT5EncoderModel, T5TokenizerFast)`` (Wan, SkyReels)."""
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(**t5_config_kwargs(t5_tokenizer(), d_model, num_layers))
    return build(UMT5EncoderModel, config, seed=seed), t5_tokenizer()


def qwen2_5_vl_model(hidden_size: int = 32, seed: int = 0):
    """``(Qwen2_5_VLForConditionalGeneration, Qwen2TokenizerFast)`` with a tiny text and vision tower (Qwen-Image)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tok = qwen2_tokenizer()
    config = Qwen2_5_VLConfig(
        text_config=decoder_lm_kwargs(
            tok,
            hidden_size,
            2,
            num_key_value_heads=hidden_size // HEAD_DIM,
            head_dim=False,
            max_position_embeddings=None,
            token_ids=("eos",),
            bos_token_id=None,
            rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
            rope_theta=10000.0,
        ),
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_heads": 2,
            "out_hidden_size": hidden_size,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "fullatt_block_indexes": [0],
        },
        vocab_size=len(tok),
        **vision_token_ids(tok, vision_end=False),
    )
    return build(Qwen2_5_VLForConditionalGeneration, config, seed=seed), tok
