"""A tiny Qwen3-VL encoder (``Qwen3VLModel``: text tower plus a one-block vision tower) built locally (Krea 2).

It shares the Qwen3 tokenizer of :mod:`fastdit.testing.components.qwen3` (Qwen3-VL checkpoints use the same
vocabulary and ChatML special tokens).
"""

from __future__ import annotations

from fastdit.testing.components.encoders import build
from fastdit.testing.components.qwen3 import qwen3_tokenizer

__all__ = ["qwen3_vl_model"]


def qwen3_vl_model(hidden_size: int = 32, num_layers: int = 2, seed: int = 0):
    """``(Qwen3VLModel, Qwen2TokenizerFast)``: 2 query heads over 1 KV head of 16, interleaved M-RoPE (2, 3, 3)."""
    from transformers import Qwen3VLConfig, Qwen3VLModel

    tok = qwen3_tokenizer()
    head_dim = 16
    config = Qwen3VLConfig(
        text_config={
            "vocab_size": len(tok),
            "hidden_size": hidden_size,
            "intermediate_size": 2 * hidden_size,
            "num_hidden_layers": num_layers,
            "num_attention_heads": hidden_size // head_dim,
            "num_key_value_heads": 1,
            "head_dim": head_dim,
            "max_position_embeddings": 1024,
            "pad_token_id": tok.pad_token_id,
            # The three sections split head_dim / 2 frequencies over the (t, h, w) position axes.
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_heads": 2,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": hidden_size,
            "num_position_embeddings": 16,
            "deepstack_visual_indexes": [0],
        },
        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"),
    )
    return build(Qwen3VLModel, config, seed=seed), tok
