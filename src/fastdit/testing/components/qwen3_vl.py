"""A tiny Qwen3-VL encoder (``Qwen3VLModel``: text tower plus a one-block vision tower) built locally (Krea 2).

It shares the Qwen3 tokenizer of :mod:`fastdit.testing.components.qwen3` (Qwen3-VL checkpoints use the same
vocabulary and ChatML special tokens).
"""

from __future__ import annotations

from fastdit.testing.components.decoder_lm import decoder_lm_kwargs, vision_token_ids
from fastdit.testing.components.encoders import build
from fastdit.testing.components.qwen3 import qwen3_tokenizer

__all__ = ["qwen3_vl_model"]


def qwen3_vl_model(hidden_size: int = 32, num_layers: int = 2, seed: int = 0):
    """``(Qwen3VLModel, Qwen2TokenizerFast)``: 2 query heads over 1 KV head of 16, interleaved M-RoPE (2, 3, 3)."""
    from transformers import Qwen3VLConfig, Qwen3VLModel

    tok = qwen3_tokenizer()
    config = Qwen3VLConfig(
        text_config=decoder_lm_kwargs(
            tok,
            hidden_size,
            num_layers,
            token_ids=("pad",),
            # The three sections split head_dim / 2 frequencies over the (t, h, w) position axes.
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        ),
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
        **vision_token_ids(tok),
    )
    return build(Qwen3VLModel, config, seed=seed), tok
