"""CogView3-Plus: ``CogView3PlusTransformer2DModel``.

Blocks (diffusers 0.42.1): one list, ``transformer_blocks`` (30 ``CogView3PlusTransformerBlock``), called by keyword
with ``(hidden_states, encoder_hidden_states, emb)`` and returning ``(hidden_states, encoder_hidden_states)``
(pattern 0). Text and image tokens are concatenated inside each block's attention; nothing runs between blocks.
"""

from __future__ import annotations

from fastdit.models.base import BlockGroup, ForwardPattern, LatentLayout, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan_shapes import joint_first_block_plan
from fastdit.parallel.tp_plan import TensorParallelPlan
from fastdit.parallel.tp_shapes import attention, feed_forward, modulation, under

TRANSFORMER = "diffusers.models.transformers.transformer_cogview3plus.CogView3PlusTransformer2DModel"

_LATENT_CHANNELS = 16


def tiny_transformer(seed: int = 0, *, num_layers: int = 3):
    """A 3-block ``CogView3PlusTransformer2DModel`` (2 heads x 16, T5 width 32)."""
    from diffusers import CogView3PlusTransformer2DModel

    from fastdit.testing.components.encoders import build

    return build(
        CogView3PlusTransformer2DModel,
        seed=seed,
        patch_size=2,
        in_channels=_LATENT_CHANNELS,
        num_layers=num_layers,
        attention_head_dim=16,
        num_attention_heads=2,
        out_channels=_LATENT_CHANNELS,
        text_embed_dim=32,
        time_embed_dim=16,
        condition_dim=8,
        pos_embed_max_size=16,
        sample_size=16,
    )


def tiny_cogview3plus(seed: int = 0):
    """A complete tiny ``CogView3PlusPipeline`` (T5 text encoder, 16-channel KL VAE with scale factor 2, DDIM)."""
    from diffusers import CogVideoXDDIMScheduler, CogView3PlusPipeline

    from fastdit.testing.components.autoencoder_kl import autoencoder_kl
    from fastdit.testing.components.encoders import t5_encoder

    text_encoder, tokenizer = t5_encoder(seed=seed)
    # CogView3-Plus ships a v-prediction DDIM schedule with zero terminal SNR.
    scheduler = CogVideoXDDIMScheduler(
        beta_schedule="scaled_linear",
        prediction_type="v_prediction",
        rescale_betas_zero_snr=True,
        snr_shift_scale=4.0,
        timestep_spacing="trailing",
        set_alpha_to_one=True,
        clip_sample=False,
    )
    return CogView3PlusPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=autoencoder_kl(latent_channels=_LATENT_CHANNELS, scaling_factor=1.0, seed=seed),
        transformer=tiny_transformer(seed),
        scheduler=scheduler,
    )


# The patch embedding builds [text, image] (with sin-cos positions) and forward splits it into the two streams, so
# both are split at the first block's inputs. The joint attention concatenates [text, image] per rank without a mask
# or RoPE, so any split of either stream is exact. CogVideoXAttnProcessor2_0 calls F.scaled_dot_product_attention
# itself: its module's F is routed.
CP_PLAN = joint_first_block_plan(
    "transformer_blocks.0",
    sdpa_modules=("diffusers.models.attention_processor",),
    notes="Sin-cos positions added in the patch embedding before the split at transformer_blocks.0; no RoPE.",
)

# Tensor parallelism: each block runs one attention and one FFN over cat([text, image]). CogVideoXAttnProcessor2_0
# views q/k/v with attn.heads, so attn1.heads is divided and q/k/v split by heads (to_out row-wise); its QK-norms are
# per-head LayerNorms (replicated). The FFN is split by hidden size. The per-block AdaLN linear (time_embed_dim ->
# 12·dim, both streams' shift/scale/gate) is split with a gathered output; embedders and the final norm stay whole.
TP_PLAN = TensorParallelPlan(
    layers=under("transformer_blocks.*", {**attention("attn1"), **feed_forward(), **modulation("norm1.linear")}),
    divide=("transformer_blocks.*.attn1.heads",),
    notes="Attention split by heads, FFN by hidden size; per-block AdaLN (12·dim) split with a gathered output; "
    "QK-norms per head.",
)

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "transformer_blocks": (("attn1.to_q", "attn1.to_k", "attn1.to_v"),),
}

ADAPTER = register(
    ModelAdapter(
        family="cogview3",
        fused_projections=FUSED_PROJECTIONS,
        # hidden_states is (batch, channels, height, width).
        latent=LatentLayout(),
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="transformer_blocks", pattern=ForwardPattern.P0),),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        tiny_pipelines=(
            TinyPipeline(
                name="cogview3-plus",
                build=tiny_cogview3plus,
                # guidance_scale > 1 batches cond and uncond in one transformer call per step.
                call_kwargs={
                    "prompt": "a cat holding a sign",
                    "negative_prompt": "blue",
                    "guidance_scale": 7.0,
                    "height": 32,
                    "width": 32,
                    "num_inference_steps": 2,
                    "max_sequence_length": 16,
                },
            ),
        ),
        presets=(
            ModelPreset(
                name="cogview3-plus",
                pipeline_class="diffusers.CogView3PlusPipeline",
                hub_id="THUDM/CogView3-Plus-3B",
                defaults={"num_inference_steps": 50, "guidance_scale": 7.0, "height": 1024, "width": 1024},
            ),
        ),
        notes=(
            "Absolute 2-D sin-cos position embeddings (no RoPE) are added to the image tokens before the blocks; no "
            "attention mask. CFG is batched in one call and the transformer has no CacheMixin, so the pipeline opens "
            "no cache contexts."
        ),
    )
)
