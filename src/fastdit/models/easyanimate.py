"""EasyAnimate V5.1 (text-to-video): ``EasyAnimateTransformer3DModel``.

Blocks (diffusers 0.42.1): one list, ``transformer_blocks`` (``EasyAnimateTransformerBlock``; the first
``mmdit_layers`` keep separate text/video weights), called positionally with ``(hidden_states, encoder_hidden_states,
temb, image_rotary_emb)`` and returning ``(hidden_states, encoder_hidden_states)`` (pattern 0). Video tokens are all
frames flattened into one sequence; nothing runs between blocks.
"""

from __future__ import annotations

from fastdit.models.base import BlockGroup, ForwardPattern, LatentLayout, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, SplitOutput
from fastdit.parallel.plan_shapes import streams
from fastdit.parallel.tp_plan import TensorParallelPlan
from fastdit.parallel.tp_shapes import feed_forward, joint_attention, modulation, under

TRANSFORMER = "diffusers.models.transformers.transformer_easyanimate.EasyAnimateTransformer3DModel"

_LATENT_CHANNELS = 4


def tiny_transformer(seed: int = 0, *, num_layers: int = 3):
    """A 3-block ``EasyAnimateTransformer3DModel`` (2 heads x 16, MMDiT weights in every block, Qwen2-VL width 32)."""
    from diffusers import EasyAnimateTransformer3DModel

    from fastdit.testing.components.encoders import build

    return build(
        EasyAnimateTransformer3DModel,
        seed=seed,
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=_LATENT_CHANNELS,
        out_channels=_LATENT_CHANNELS,
        patch_size=2,
        sample_width=8,
        sample_height=8,
        num_layers=num_layers,
        mmdit_layers=num_layers,
        time_embed_dim=16,
        text_embed_dim=32,
        add_norm_text_encoder=True,
    )


def tiny_vae(seed: int = 0):
    """A tiny ``AutoencoderKLMagvit``: spatial factor 4, temporal factor 2 (one level of each kind of block)."""
    from diffusers import AutoencoderKLMagvit

    from fastdit.testing.components.encoders import build

    return build(
        AutoencoderKLMagvit,
        seed=seed,
        in_channels=3,
        latent_channels=_LATENT_CHANNELS,
        out_channels=3,
        block_out_channels=(8, 8, 8),
        down_block_types=("SpatialDownBlock3D", "SpatialTemporalDownBlock3D", "SpatialTemporalDownBlock3D"),
        up_block_types=("SpatialUpBlock3D", "SpatialTemporalUpBlock3D", "SpatialTemporalUpBlock3D"),
        layers_per_block=1,
        norm_num_groups=8,
        spatial_group_norm=True,
    )


def tiny_easyanimate(seed: int = 0):
    """A complete tiny ``EasyAnimatePipeline`` (Qwen2-VL text encoder, MagViT VAE)."""
    from diffusers import EasyAnimatePipeline, FlowMatchEulerDiscreteScheduler

    from fastdit.testing.components.qwen2_vl import qwen2_vl_model

    text_encoder, tokenizer = qwen2_vl_model(seed=seed)
    return EasyAnimatePipeline(
        vae=tiny_vae(seed),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=tiny_transformer(seed),
        scheduler=FlowMatchEulerDiscreteScheduler(),
    )


# forward builds the video sequence (patch projection) and the 3-D RoPE (cos, sin) from hidden_states.shape, so the
# streams are split at the first block's inputs and the RoPE tables at the rope module's output. The joint attention
# concatenates [text, video] per rank, rotates the video part by the local text length and has no mask, so any split
# is exact. EasyAnimateAttnProcessor2_0 calls F.scaled_dot_product_attention itself: its module's F is routed.
CP_PLAN = ContextParallelPlan(
    inputs={
        "transformer_blocks.0": streams(),
    },
    outputs={
        "rope_embedding": (SplitOutput(dim=0, expected_dims=2, index=0), SplitOutput(dim=0, expected_dims=2, index=1))
    },
    gather={"proj_out": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(sdpa_modules=("diffusers.models.transformers.transformer_easyanimate",)),
    notes="3-D RoPE (cos, sin) split at the rope module's output with the tokens (split at transformer_blocks.0).",
)

# Tensor parallelism for MMDiT blocks (every block when mmdit_layers >= num_layers, as in diffusers' default config):
# joint attention (video q/k/v and the text add_*_proj column-wise, to_out / to_add_out row-wise) and the video and
# text FFNs. The processor reshapes with unflatten(2, (attn.heads, -1)), so `heads` is divided; the QK-norms are
# LayerNorm over head_dim (per head): replicated, and the optional norm3 acts on the FFN's reduced output. The AdaLN
# modulation of norm1 / norm2 (time_embed_dim -> 6 dim, per block) is split with a gathered output. A block built
# with is_mmdit_block=False would return its text part straight from attention with no out projection (still split):
# such a checkpoint fails loudly on the residual add. Replicated: text projections, time embedding, norm_out,
# proj_out.
TP_PLAN = TensorParallelPlan(
    layers=under(
        "transformer_blocks.*",
        {
            **joint_attention("attn1"),
            **feed_forward("ff"),
            **feed_forward("txt_ff"),
            **modulation("norm1.linear", "norm2.linear"),
        },
    ),
    divide=("transformer_blocks.*.attn1.heads",),
    notes="Joint attention and the video / text FFNs split; per-block AdaLN modulation (6 dim) split with a "
    "gathered output; QK-norms per head replicated; assumes every block is an MMDiT block.",
)

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "transformer_blocks": (
        ("attn1.to_q", "attn1.to_k", "attn1.to_v"),
        ("attn1.add_q_proj", "attn1.add_k_proj", "attn1.add_v_proj"),
    ),
}

ADAPTER = register(
    ModelAdapter(
        family="easyanimate",
        fused_projections=FUSED_PROJECTIONS,
        # hidden_states is (batch, channels, frames, height, width). Inpainting latents arrive apart
        # (inpaint_latents).
        latent=LatentLayout(),
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="transformer_blocks", pattern=ForwardPattern.P0),),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        tiny_pipelines=(
            TinyPipeline(
                name="t2v",
                build=tiny_easyanimate,
                # guidance_scale > 1 batches cond and uncond in one transformer call per step.
                call_kwargs={
                    "prompt": "a cat holding a sign",
                    "negative_prompt": "blue",
                    "guidance_scale": 5.0,
                    "num_frames": 5,
                    "height": 32,
                    "width": 32,
                    "num_inference_steps": 2,
                },
            ),
        ),
        presets=(
            ModelPreset(
                name="easyanimate-v5.1",
                pipeline_class="diffusers.EasyAnimatePipeline",
                hub_id="alibaba-pai/EasyAnimateV5.1-7b-zh-diffusers",
                defaults={
                    "num_inference_steps": 50,
                    "guidance_scale": 6.0,
                    "num_frames": 49,
                    "height": 512,
                    "width": 512,
                },
            ),
        ),
        notes=(
            "3-D RoPE is computed from hidden_states.shape inside forward. Text is padded to 256 tokens with no mask "
            "reaching the transformer. CFG is batched in one call and the pipeline opens no cache contexts."
        ),
    )
)
