"""A tiny Qwen2-VL encoder (``Qwen2VLForConditionalGeneration``) built locally (EasyAnimate V5.1).

It uses the ChatML tokenizer of :mod:`fastdit.testing.components.qwen3` (same Qwen vocabulary layout and special
tokens); its chat template accepts the ``[{"type": "text", ...}]`` message content VL pipelines send.
"""

from __future__ import annotations

from fastdit.testing.components.encoders import build
from fastdit.testing.components.qwen3 import qwen3_tokenizer

__all__ = ["qwen2_vl_model"]


def qwen2_vl_model(hidden_size: int = 32, num_layers: int = 2, seed: int = 0):
    """``(Qwen2VLForConditionalGeneration, Qwen2TokenizerFast)``: 2 heads of 16, M-RoPE sections (2, 3, 3)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    tok = qwen3_tokenizer()
    head_dim = 16
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": len(tok),
            "hidden_size": hidden_size,
            "intermediate_size": 2 * hidden_size,
            "num_hidden_layers": num_layers,
            "num_attention_heads": hidden_size // head_dim,
            "num_key_value_heads": hidden_size // head_dim,
            "max_position_embeddings": 1024,
            "bos_token_id": None,
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id,
            # The three sections split head_dim / 2 frequencies over the (t, h, w) position axes.
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        },
        vision_config={
            "depth": 1,
            "embed_dim": 16,
            "hidden_size": hidden_size,
            "mlp_ratio": 2,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"),
    )
    return build(Qwen2VLForConditionalGeneration, config, seed=seed), tok
