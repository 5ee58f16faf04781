"""HunyuanImage 2.1 (base and distilled): ``HunyuanImageTransformer2DModel``.

Blocks (diffusers 0.42.1): 20 dual-stream ``transformer_blocks`` then 40 single-stream ``single_transformer_blocks``;
both are called as ``block(hidden_states, encoder_hidden_states, temb, attention_mask=..., image_rotary_emb=...)``
(three positional, two keyword) and return ``(hidden_states, encoder_hidden_states)`` (pattern 0). The text tokens
first pass a token refiner (``context_embedder.token_refiner.refiner_blocks``, not declared: it runs once per call
on the text alone). Nothing runs between blocks.
"""

from __future__ import annotations

from fastdit.models.base import BlockGroup, ForwardPattern, LatentLayout, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, SplitOutput
from fastdit.parallel.plan_shapes import streams
from fastdit.parallel.tp_shapes import flux1_tp_plan

TRANSFORMER = "diffusers.models.transformers.transformer_hunyuanimage.HunyuanImageTransformer2DModel"

_LATENT_CHANNELS = 16


def tiny_transformer(seed: int = 0, *, distilled: bool = False):
    """A 3-block ``HunyuanImageTransformer2DModel`` (2 heads x 16; Qwen2.5-VL and ByT5 widths 32).

    ``distilled`` turns on the guidance embedding and MeanFlow's second timestep, as in the distilled checkpoint.
    """
    from diffusers import HunyuanImageTransformer2DModel

    from fastdit.testing.components.encoders import build

    return build(
        HunyuanImageTransformer2DModel,
        seed=seed,
        in_channels=_LATENT_CHANNELS,
        out_channels=_LATENT_CHANNELS,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=1,
        num_single_layers=2,
        num_refiner_layers=1,
        patch_size=(1, 1),
        guidance_embeds=distilled,
        use_meanflow=distilled,
        text_embed_dim=32,
        text_embed_2_dim=32,
        rope_axes_dim=(8, 8),
    )


def tiny_vae(seed: int = 0):
    """A tiny ``AutoencoderKLHunyuanImage`` with scale factor 2 (its GroupNorms need multiples of 32 channels)."""
    from diffusers import AutoencoderKLHunyuanImage

    from fastdit.testing.components.encoders import build

    return build(
        AutoencoderKLHunyuanImage,
        seed=seed,
        in_channels=3,
        out_channels=3,
        latent_channels=_LATENT_CHANNELS,
        block_out_channels=(32, 32),
        layers_per_block=1,
        spatial_compression_ratio=2,
        sample_size=32,
        scaling_factor=1.0,
    )


def _pipeline(seed: int, distilled: bool):
    from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanImagePipeline
    from diffusers.guiders import AdaptiveProjectedMixGuidance

    from fastdit.testing.components.byt5 import byt5_encoder
    from fastdit.testing.components.encoders import qwen2_5_vl_model

    text_encoder, tokenizer = qwen2_5_vl_model(seed=seed)
    text_encoder_2, tokenizer_2 = byt5_encoder(seed=seed + 1)
    # The base checkpoint ships a CFG/APG guider (two transformer calls per step); the distilled one ships none.
    guider = None if distilled else AdaptiveProjectedMixGuidance(guidance_scale=3.5)
    return HunyuanImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        vae=tiny_vae(seed),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=tiny_transformer(seed, distilled=distilled),
        guider=guider,
    )


def tiny_hunyuan_image(seed: int = 0):
    """A complete tiny ``HunyuanImagePipeline`` (Qwen2.5-VL + ByT5 glyph encoder, CFG guider)."""
    return _pipeline(seed, distilled=False)


def tiny_hunyuan_image_distilled(seed: int = 0):
    """A complete tiny distilled ``HunyuanImagePipeline`` (guidance embedding, MeanFlow, one call per step)."""
    return _pipeline(seed, distilled=True)


# The quoted word goes through the ByT5 glyph encoder as well.
_CALL = {
    "prompt": 'a cat holding a sign "hi"',
    "negative_prompt": "blue",
    "height": 32,
    "width": 32,
    "num_inference_steps": 2,
}

# Context parallelism: forward builds the joint sequence itself (patch embedding, the text refiner, reordering valid
# text tokens first), so the image and text tokens are split at the first block; every block returns both streams,
# so the shards flow through all dual- and single-stream blocks. `rope`'s (cos, sin) tables (S_img, D) cover the whole
# image and are split on dim 0 like the image tokens. The attention mask (B, 1, 1, S_img + S_txt) is built over the
# global [image | text] sequence, hence mask_segments. The token refiner inside context_embedder runs before the split
# on the whole, replicated text with diffusers' AttnProcessor2_0, so it stays local. Gathered at proj_out (before
# unpatchify); the text stream is dropped after the blocks.
CP_PLAN = ContextParallelPlan(
    inputs={
        "transformer_blocks.0": streams(),
    },
    outputs={"rope": (SplitOutput(dim=0, expected_dims=2, index=0), SplitOutput(dim=0, expected_dims=2, index=1))},
    gather={"proj_out": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(
        modules=("diffusers.models.transformers.transformer_hunyuanimage",),
        mask_segments=("hidden_states", "encoder_hidden_states"),
        local=("context_embedder",),
    ),
    notes=(
        "Image and text tokens split at transformer_blocks.0 (joint mask reordered by segments); RoPE tables from "
        "`rope` split on dim 0; the text token refiner in context_embedder runs locally on the replicated text."
    ),
)

# Tensor parallelism: FLUX.1's split. HunyuanImageAttnProcessor reshapes with ``attn.heads`` (divided); the QK-norms
# are per head (replicated). The per-block AdaLN linears (dim -> 6·dim per stream and dual block, dim -> 3·dim per
# single block) are split with a gathered output. The single block's proj_out reads cat([attn_out, mlp_hidden]) and
# the block keeps no MLP width attribute: the MLP part is read off proj_mlp. The text token refiner, the ByT5
# projection (context_embedder_2), the embedders and the output layers run once per call outside the blocks and stay
# whole.
TP_PLAN = flux1_tp_plan(
    notes="FLUX.1's split plus per-block AdaLN modulation split with a gathered output; token refiner, ByT5 "
    "projection, embedders and QK-norms (per head) replicated.",
    mlp_width="proj_mlp.out_features",
)

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "transformer_blocks": (
        ("attn.to_q", "attn.to_k", "attn.to_v"),
        ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    ),
    "single_transformer_blocks": (("attn.to_q", "attn.to_k", "attn.to_v"),),
}

ADAPTER = register(
    ModelAdapter(
        family="hunyuan_image",
        fused_projections=FUSED_PROJECTIONS,
        # hidden_states is (batch, channels, height, width).
        latent=LatentLayout(),
        transformer_classes=(TRANSFORMER,),
        block_groups=(
            BlockGroup(path="transformer_blocks", pattern=ForwardPattern.P0),
            BlockGroup(path="single_transformer_blocks", pattern=ForwardPattern.P0),
        ),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        tiny_pipelines=(
            TinyPipeline(name="hunyuan-image", build=tiny_hunyuan_image, call_kwargs=_CALL),
            TinyPipeline(
                name="distilled",
                build=tiny_hunyuan_image_distilled,
                call_kwargs={**_CALL, "distilled_guidance_scale": 3.25},
            ),
        ),
        presets=(
            ModelPreset(
                name="hunyuan-image-2.1",
                pipeline_class="diffusers.HunyuanImagePipeline",
                hub_id="hunyuanvideo-community/HunyuanImage-2.1-Diffusers",
                defaults={"num_inference_steps": 50, "height": 2048, "width": 2048},
            ),
            ModelPreset(
                name="hunyuan-image-2.1-distilled",
                pipeline_class="diffusers.HunyuanImagePipeline",
                hub_id="hunyuanvideo-community/HunyuanImage-2.1-Distilled-Diffusers",
                defaults={"num_inference_steps": 8, "distilled_guidance_scale": 3.25, "height": 2048, "width": 2048},
            ),
        ),
        notes=(
            "Blocks take a joint attention mask ([image | text] with text padding: Qwen text is padded to 1000 "
            "tokens, ByT5 glyph text to 128, valid tokens moved first); under context parallelism it must be "
            "reordered with the tokens. RoPE is computed from hidden_states.shape inside forward (image tokens only). "
            "CFG runs through a diffusers guider: two calls per step, contexts pred_cond/pred_uncond."
        ),
    )
)
