"""Lumina-Next (Lumina-T2X's Next-DiT): ``LuminaNextDiT2DModel``.

Blocks (diffusers 0.42.1): one list ``layers`` of ``LuminaNextDiTBlock``, called positionally as ``layer(hidden_states,
mask, image_rotary_emb, encoder_hidden_states, encoder_mask, temb=..., cross_attention_kwargs=...)``; each returns the
hidden states alone (pattern 2). Unlike Lumina-Image 2.0 (``lumina2``: a joint [prompt, image] sequence after refiners),
every block runs self-attention over the image tokens and, beside it, cross-attention from the same normalised image
tokens to the prompt; the two attention outputs (cross gated per head by ``tanh(gate)``) are summed and projected by
``attn2.to_out`` (``attn1.to_out`` is an identity). The pipeline computes the 2-D RoPE table itself (complex, ``(384,
384, head_dim / 2)``) and passes it to forward; ``patch_embedder`` cuts it to the latent grid and returns an all-ones
key mask ``(B, S)``.

Proportional attention (the pipeline's default ``proportional_attn=True``): the self-attention processor scales
scores by ``sqrt(log_base(S))`` of its query length ``S`` (``base_sequence_length`` in ``cross_attention_kwargs``).
"""

from __future__ import annotations

import torch

from fastdit.models.base import BlockGroup, ForwardPattern, LatentLayout, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import (
    AttentionRouting,
    ContextParallelPlan,
    GatherOutput,
    LengthLogBase,
    SplitOutput,
)
from fastdit.parallel.tp_plan import Colwise, Rowwise, ShardedNorm, SplitParameter, Style, TensorParallelPlan
from fastdit.parallel.tp_shapes import modulation, under

TRANSFORMER = "diffusers.models.transformers.lumina_nextdit2d.LuminaNextDiT2DModel"

_TEXT_DIM = 32


def tiny_transformer(seed: int = 0):
    """A 3-block ``LuminaNextDiT2DModel``: 4 query heads of 8 over 2 KV heads (GQA), learned sigma."""
    from diffusers import LuminaNextDiT2DModel

    from fastdit.testing.components.encoders import build

    return build(
        LuminaNextDiT2DModel,
        seed=seed,
        # The pipeline's default image size is sample_size x 8: 64 px, the tiny call's size (scaling factor 1).
        sample_size=8,
        patch_size=2,
        in_channels=4,
        hidden_size=32,
        num_layers=3,
        num_attention_heads=4,
        num_kv_heads=2,
        multiple_of=16,
        learn_sigma=True,
        qk_norm=True,
        cross_attention_dim=_TEXT_DIM,
    )


def tiny_lumina_next(seed: int = 0):
    """A complete tiny ``LuminaPipeline`` (Gemma-style text encoder, 4-level SD-style VAE)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, LuminaPipeline

    from fastdit.testing.components.autoencoder_kl import autoencoder_kl
    from fastdit.testing.components.gemma2 import gemma2_model

    text_encoder, tokenizer = gemma2_model(hidden_size=_TEXT_DIM, seed=seed + 1)
    with torch.no_grad():  # the model's pad token is torch.empty: give it defined values
        transformer = tiny_transformer(seed)
        transformer.pad_token.zero_()
    return LuminaPipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(),
        # The pipeline hard-codes a VAE scale factor of 8, so the VAE needs four levels.
        vae=autoencoder_kl(latent_channels=4, num_levels=4, scaling_factor=0.13025),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
    )


def _query_row(mask: torch.Tensor) -> torch.Tensor:
    """One query row of the self-attention mask: the processor expands a key mask ``(B, 1, 1, S)`` over its local
    queries, so every row is the same key-padding mask."""
    return mask[..., :1, :]


# Context parallelism. The tokens exist after patch_embedder inside forward: its outputs (tokens, RoPE table cut to the
# grid (1, S, head_dim / 2)) are split on the token dim; the all-ones key mask it returns stays whole (it indexes the
# global keys) and is cut to one query row in attention, where the processor has expanded it over its local queries.
# Self-attention (attn1, F.scaled_dot_product_attention in LuminaAttnProcessor2_0) is context-parallel; the
# cross-attention attn2 runs locally from the local image tokens to the whole prompt. Proportional attention reads the
# local query length: the base it is measured in is adjusted so each rank computes log_base of the global length.
# Everything else in a block (AdaLN, FFN, the per-head gate) is token-wise. Gathered at norm_out, before unpatchify.
CP_PLAN = ContextParallelPlan(
    # The block passes cross_attention_kwargs to both attentions; only self-attention (with key RoPE) reads the base.
    inputs={"layers.*": {"cross_attention_kwargs": LengthLogBase(of="patch_embedder[0]", key="base_sequence_length")}},
    outputs={
        "patch_embedder": (
            SplitOutput(dim=1, expected_dims=3, index=0),
            SplitOutput(dim=1, expected_dims=3, index=3),
        )
    },
    gather={"norm_out": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(
        sdpa_modules=("diffusers.models.attention_processor",), local=("layers.*.attn2",), mask_transform=_query_row
    ),
    notes="Tokens and their RoPE table split at patch_embedder; the key mask whole; proportional attention measured "
    "on the global length; text replicated (cross-attention local).",
)

# Tensor parallelism. Both attentions split by heads: q by query heads, k/v in whole KV heads (unit inner_dim / heads:
# no module holds the head dim of k/v) so GQA groups stay on one rank; the QK-norms are LayerNorms over all heads
# (ShardedNorm). attn2.to_out projects the sum of both attention outputs (each rank holds its heads of both): row-wise.
# The per-head cross-attention gate is read directly by the block (view(1, 1, -1, 1)): split with the heads. SwiGLU FFN
# and the per-block AdaLN linear (gathered) split. When tp does not divide the KV heads, attention stays replicated.
_HEAD = ("inner_dim", "heads")
_ATTENTION: dict[str, Style] = {
    **{f"{attn}.to_q": Colwise() for attn in ("attn1", "attn2")},
    **{f"{attn}.{kv}": Colwise(unit=_HEAD) for attn in ("attn1", "attn2") for kv in ("to_k", "to_v")},
    **{f"{attn}.{norm}": ShardedNorm() for attn in ("attn1", "attn2") for norm in ("norm_q", "norm_k")},
    "attn2.to_out.0": Rowwise(),
}
_REST: dict[str, Style] = {
    "feed_forward.linear_1": Colwise(),
    "feed_forward.linear_3": Colwise(),
    "feed_forward.linear_2": Rowwise(),
    **modulation("norm1.linear"),
}

TP_PLAN = TensorParallelPlan(
    # The gate is a parameter of the block itself.
    layers={**under("layers.*", {**_ATTENTION, **_REST}), "layers.*": SplitParameter("gate")},
    divide=("layers.*.attn1.heads", "layers.*.attn2.heads"),
    notes="Self- and cross-attention by heads (GQA groups whole, QK LayerNorms sharded, the per-head gate split), "
    "SwiGLU FFN and per-block AdaLN (gathered) split; attention replicated (no-attention fallback) when tp does not "
    "divide the KV heads.",
    fallback=TensorParallelPlan(
        layers=under("layers.*", _REST),
        notes="SwiGLU FFN and per-block AdaLN (gathered) split; attention replicated: tp does not divide the KV heads.",
        name="no-attention",
    ),
)

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "layers": (
        ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn2.to_q"),
        ("attn2.to_k", "attn2.to_v"),
        ("feed_forward.linear_1", "feed_forward.linear_3"),
    ),
}

ADAPTER = register(
    ModelAdapter(
        family="lumina_next",
        fused_projections=FUSED_PROJECTIONS,
        # hidden_states is (batch, channels, height, width).
        latent=LatentLayout(),
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="layers", pattern=ForwardPattern.P2),),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        tiny_pipelines=(
            TinyPipeline(
                name="lumina-next",
                build=tiny_lumina_next,
                call_kwargs={
                    "prompt": "a cat holding a sign",
                    "negative_prompt": "blue",
                    # 64 px -> 8x8 latents -> 16 image tokens.
                    "height": 64,
                    "width": 64,
                    "num_inference_steps": 2,
                    "guidance_scale": 4.0,
                    "clean_caption": False,  # would need bs4 / ftfy
                    "max_sequence_length": 32,
                },
            ),
        ),
        presets=(
            ModelPreset(
                name="lumina-next",
                pipeline_class="diffusers.LuminaPipeline",
                hub_id="Alpha-VLLM/Lumina-Next-SFT-diffusers",
                defaults={"num_inference_steps": 30, "guidance_scale": 4.0, "height": 1024, "width": 1024},
            ),
        ),
        notes=(
            "The timestep rises during a run (0 = noise, 1 = image). CFG is batched ([cond, uncond] in one call) "
            "and applied to the first 3 latent channels only; the model predicts a learned sigma "
            "(2 x in_channels out). The RoPE table is passed in by the pipeline (NTK / linear scaling switched at "
            "`scaling_watershed`). Attention is GQA (num_kv_heads). Proportional attention scales self-attention "
            "by sqrt(log_base(S)) of the query length S, so context parallelism adjusts the base for the local "
            "length."
        ),
    )
)
