"""A tiny Qwen2-VL encoder (``Qwen2VLForConditionalGeneration``) built locally (EasyAnimate V5.1).

It uses the ChatML tokenizer of :mod:`fastdit.testing.components.qwen3` (same Qwen vocabulary layout and special
tokens); its chat template accepts the ``[{"type": "text", ...}]`` message content VL pipelines send.
"""

from __future__ import annotations

from fastdit.testing.components.decoder_lm import HEAD_DIM, decoder_lm_kwargs, vision_token_ids
from fastdit.testing.components.encoders import build
from fastdit.testing.components.qwen3 import qwen3_tokenizer

__all__ = ["qwen2_vl_model"]


def qwen2_vl_model(hidden_size: int = 32, num_layers: int = 2, seed: int = 0):
    """``(Qwen2VLForConditionalGeneration, Qwen2TokenizerFast)``: 2 heads of 16, M-RoPE sections (2, 3, 3)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    tok = qwen3_tokenizer()
    config = Qwen2VLConfig(
        text_config=decoder_lm_kwargs(
            tok,
            hidden_size,
            num_layers,
            num_key_value_heads=hidden_size // HEAD_DIM,
            head_dim=False,
            token_ids=("pad", "eos"),
            bos_token_id=None,
            # The three sections split head_dim / 2 frequencies over the (t, h, w) position axes.
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        ),
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
        **vision_token_ids(tok),
    )
    return build(Qwen2VLForConditionalGeneration, config, seed=seed), tok
