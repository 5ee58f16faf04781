"""Allegro: ``AllegroTransformer3DModel``.

Blocks (diffusers 0.42.1): one list ``transformer_blocks`` of ``AllegroTransformerBlock``; the model calls each by
keyword as ``block(hidden_states=..., encoder_hidden_states=..., temb=..., attention_mask=...,
encoder_attention_mask=..., image_rotary_emb=...)`` and the block returns ``hidden_states`` alone (pattern 2): text
enters through cross-attention only.
"""

from __future__ import annotations

from fastdit.models.base import (
    BlockGroup,
    ForwardPattern,
    LatentLayout,
    ModelAdapter,
    ModelPreset,
    StepInvariant,
    TinyPipeline,
)
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, SplitInput
from fastdit.parallel.tp_plan import TensorParallelPlan
from fastdit.parallel.tp_shapes import attention, feed_forward, under

TRANSFORMER = "diffusers.models.transformers.transformer_allegro.AllegroTransformer3DModel"

_LATENT = 4
_TEXT_DIM = 32


def tiny_transformer(seed: int = 0):
    """A 3-block ``AllegroTransformer3DModel`` (patch 2x2, one frame per token)."""
    from diffusers import AllegroTransformer3DModel

    from fastdit.testing.components.encoders import build

    return build(
        AllegroTransformer3DModel,
        seed=seed,
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=_LATENT,
        out_channels=_LATENT,
        num_layers=3,
        cross_attention_dim=24,
        sample_width=4,
        sample_height=4,
        sample_frames=8,
        caption_channels=_TEXT_DIM,
    )


def tiny_vae(seed: int = 0):
    """An ``AutoencoderKLAllegro`` with 8 channels per level (space x8, time x4), tiled decoding on.

    diffusers 0.42.1 implements Allegro's decoder only in tiled form, so tiling is switched on here as the real
    pipeline requires.
    """
    from diffusers import AutoencoderKLAllegro

    from fastdit.testing.components.encoders import build

    vae = build(
        AutoencoderKLAllegro,
        seed=seed,
        down_block_types=("AllegroDownBlock3D",) * 4,
        up_block_types=("AllegroUpBlock3D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        latent_channels=_LATENT,
        layers_per_block=1,
        norm_num_groups=2,
        temporal_compression_ratio=4,
    )
    vae.enable_tiling()
    return vae


def tiny_allegro(seed: int = 0):
    """A complete tiny ``AllegroPipeline`` (T5 text encoder, Euler-ancestral sampling as the released model)."""
    from diffusers import AllegroPipeline, EulerAncestralDiscreteScheduler

    from fastdit.testing.components.encoders import t5_encoder

    text_encoder, tokenizer = t5_encoder(d_model=_TEXT_DIM, seed=seed)
    return AllegroPipeline(
        transformer=tiny_transformer(seed),
        vae=tiny_vae(seed),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        scheduler=EulerAncestralDiscreteScheduler(),
    )


CP_PLAN = ContextParallelPlan(
    inputs={
        # image_rotary_emb = ((t, h, w) cos/sin tables indexed by position, (grid_t, grid_h, grid_w) positions of
        # the tokens, each (1, S)): only the positions follow the tokens.
        "": {"image_rotary_emb": SplitInput(dim=1, expected_dims=2, index=1)},
        "transformer_blocks.0": {"hidden_states": SplitInput(dim=1, expected_dims=3)},
    },
    gather={"proj_out": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(
        sdpa_modules=("diffusers.models.attention_processor",), local=("transformer_blocks.*.attn2",)
    ),
    notes="RoPE positions split at the root, tables whole; cross-attention local.",
)

# Tensor parallelism: AllegroAttnProcessor2_0 views q/k/v with attn.heads in both the self-attention and the
# cross-attention (q from the video, k/v from the prompt), so both heads are divided and both split by heads (to_out
# row-wise); the 3-D RoPE rotates thirds of each head (replicated). The FFN is split by hidden size. Modulation is
# the global adaln_single plus a per-block scale_shift_table parameter: both small, replicated, like the embedders
# and the caption projection.
TP_PLAN = TensorParallelPlan(
    layers=under("transformer_blocks.*", {**attention("attn1"), **attention("attn2"), **feed_forward()}),
    divide=("transformer_blocks.*.attn1.heads", "transformer_blocks.*.attn2.heads"),
    notes="Self- and cross-attention split by heads, FFN by hidden size; the global adaln_single and the per-block "
    "scale_shift_table are replicated.",
)

# The pipeline passes the same prompt embeddings at every step (batched CFG's cat([negative, prompt]) is done once
# before the loop): the caption projection repeats. The RoPE tables come from the pipeline (no module computes them);
# `adaln_single` reads the timestep and `pos_embed` the latent.
STEP_INVARIANT = (StepInvariant("caption_projection", inputs=("encoder_hidden_states",)),)

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "transformer_blocks": (
        ("attn1.to_q", "attn1.to_k", "attn1.to_v"),
        ("attn2.to_k", "attn2.to_v"),
    ),
}

ADAPTER = register(
    ModelAdapter(
        family="allegro",
        fused_projections=FUSED_PROJECTIONS,
        # hidden_states is (batch, channels, frames, height, width).
        latent=LatentLayout(),
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="transformer_blocks", pattern=ForwardPattern.P2),),
        tiny_pipelines=(
            TinyPipeline(
                name="t2v",
                build=tiny_allegro,
                call_kwargs={
                    "prompt": "a cat holding a sign",
                    "negative_prompt": "blue",
                    "height": 32,
                    "width": 32,
                    "num_frames": 8,
                    "num_inference_steps": 2,
                    "guidance_scale": 7.5,
                    "max_sequence_length": 16,
                    "clean_caption": False,  # caption cleaning needs bs4 and ftfy
                },
            ),
        ),
        presets=(
            ModelPreset(
                name="allegro",
                pipeline_class="diffusers.AllegroPipeline",
                hub_id="rhymes-ai/Allegro",
                defaults={
                    "num_inference_steps": 100,
                    "guidance_scale": 7.5,
                    "height": 720,
                    "width": 1280,
                    "num_frames": 88,
                },
            ),
        ),
        notes=(
            "Text is padded to max_sequence_length and its mask becomes an additive bias for cross-attention; "
            "the pipeline computes 3-D RoPE for the whole latent grid and passes it to forward (image_rotary_emb: "
            "slice it per rank under a sequence split). The VAE decodes only in tiled form. CFG is batched."
        ),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        step_invariant=STEP_INVARIANT,
        # The pipeline's RoPE tables cover the latent grid, not the batch (a dim may equal the batch by chance).
        cfg_batch_dims={"image_rotary_emb": None},
    )
)
