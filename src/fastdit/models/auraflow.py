"""AuraFlow (v0.1-v0.3): ``AuraFlowTransformer2DModel``.

Blocks (diffusers 0.42.1): ``joint_transformer_blocks`` (MMDiT) are called by keyword with
``(hidden_states, encoder_hidden_states, temb, attention_kwargs)`` and return ``(encoder_hidden_states,
hidden_states)`` (pattern 1). Then the model concatenates ``[text, image]`` into one sequence and runs
``single_transformer_blocks``, called by keyword with ``(hidden_states, temb, attention_kwargs)``, returning that
sequence (pattern 3); the image part is sliced off after the loop.
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
from fastdit.parallel.plan_shapes import joint_first_block_plan
from fastdit.parallel.tp_plan import Colwise, Rowwise, Style, TensorParallelPlan
from fastdit.parallel.tp_shapes import attention, joint_attention, modulation, under

TRANSFORMER = "diffusers.models.transformers.auraflow_transformer_2d.AuraFlowTransformer2DModel"

_TEXT_DIM = 32


def tiny_transformer(seed: int = 0):
    """A 3-block ``AuraFlowTransformer2DModel`` (1 joint + 2 single blocks) for 4-channel latents."""
    from diffusers import AuraFlowTransformer2DModel

    from fastdit.testing.components.encoders import build

    inner_dim = 2 * 16
    return build(
        AuraFlowTransformer2DModel,
        seed=seed,
        sample_size=16,
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_mmdit_layers=1,
        num_single_dit_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=_TEXT_DIM,
        caption_projection_dim=inner_dim,
        # A square table of learned positions (16 x 16 patches) from which the latent grid is cropped.
        pos_embed_max_size=256,
    )


def tiny_auraflow(seed: int = 0):
    """A complete tiny ``AuraFlowPipeline`` (UMT5 text encoder, SDXL-style VAE)."""
    from diffusers import AuraFlowPipeline, FlowMatchEulerDiscreteScheduler

    from fastdit.testing.components.autoencoder_kl import autoencoder_kl
    from fastdit.testing.components.encoders import umt5_encoder

    text_encoder, tokenizer = umt5_encoder(d_model=_TEXT_DIM, seed=seed + 1)
    return AuraFlowPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=autoencoder_kl(latent_channels=4, scaling_factor=0.13025, seed=seed),
        transformer=tiny_transformer(seed),
        scheduler=FlowMatchEulerDiscreteScheduler(),
    )


# forward builds both streams (patch embedding with a learned position table; 8 register tokens prepended to the
# text), so the split is at the first joint block's inputs. The single blocks concatenate [text, image] per rank and
# slice the text off by its local length, and no attention has a mask or RoPE, so any split of either stream is
# exact. AuraFlowAttnProcessor2_0 calls F.scaled_dot_product_attention itself: its module's F is routed.
CP_PLAN = joint_first_block_plan(
    "joint_transformer_blocks.0",
    sdpa_modules=("diffusers.models.attention_processor",),
    notes="Learned position table and register tokens added before the split at joint_transformer_blocks.0; no RoPE.",
)


# Tensor parallelism: AuraFlowAttnProcessor2_0 views q/k/v (and add_*_proj) with attn.heads, so the heads are divided
# and the projections split by heads (to_out / to_add_out row-wise); its QK-norms are per-head LayerNorms
# (replicated). The SwiGLU FFN (silu(linear_1) * linear_2, then out_projection) splits its hidden size: gate and up
# column-wise, out_projection row-wise. The per-block AdaLN linears (dim -> 6·dim, no bias) are split with a gathered
# output; the pre-final norm and the embedders stay replicated.
def _swiglu(ff: str) -> dict[str, Style]:
    return {f"{ff}.linear_1": Colwise(), f"{ff}.linear_2": Colwise(), f"{ff}.out_projection": Rowwise()}


TP_PLAN = TensorParallelPlan(
    layers={
        **under(
            "joint_transformer_blocks.*",
            {
                **joint_attention(),
                **_swiglu("ff"),
                **_swiglu("ff_context"),
                **modulation("norm1.linear", "norm1_context.linear"),
            },
        ),
        **under("single_transformer_blocks.*", {**attention(), **_swiglu("ff"), **modulation("norm1.linear")}),
    },
    divide=("joint_transformer_blocks.*.attn.heads", "single_transformer_blocks.*.attn.heads"),
    notes="Attention split by heads, SwiGLU FFNs by hidden size, per-block AdaLN split with a gathered output; "
    "QK-norms per head.",
)

# The pipeline passes the same prompt embeddings at every step (batched CFG's cat([negative, prompt]) is done once
# before the loop): the text projection repeats (the register tokens are concatenated after it). Not `pos_embed`:
# the patch embedding of the latent.
STEP_INVARIANT = (StepInvariant("context_embedder", inputs=("encoder_hidden_states",)),)

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "joint_transformer_blocks": (
        ("attn.to_q", "attn.to_k", "attn.to_v"),
        ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
        ("ff.linear_1", "ff.linear_2"),
        ("ff_context.linear_1", "ff_context.linear_2"),
    ),
    "single_transformer_blocks": (
        ("attn.to_q", "attn.to_k", "attn.to_v"),
        ("ff.linear_1", "ff.linear_2"),
    ),
}

ADAPTER = register(
    ModelAdapter(
        family="auraflow",
        fused_projections=FUSED_PROJECTIONS,
        # hidden_states is (batch, channels, height, width).
        latent=LatentLayout(),
        transformer_classes=(TRANSFORMER,),
        block_groups=(
            BlockGroup(path="joint_transformer_blocks", pattern=ForwardPattern.P1),
            BlockGroup(path="single_transformer_blocks", pattern=ForwardPattern.P3),
        ),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        step_invariant=STEP_INVARIANT,
        tiny_pipelines=(
            TinyPipeline(
                name="auraflow",
                build=tiny_auraflow,
                call_kwargs={
                    "prompt": "a cat holding a sign",
                    "height": 32,
                    "width": 32,
                    "num_inference_steps": 2,
                    "guidance_scale": 3.5,
                    "max_sequence_length": 16,
                },
            ),
        ),
        presets=(
            ModelPreset(
                name="auraflow",
                pipeline_class="diffusers.AuraFlowPipeline",
                hub_id="fal/AuraFlow-v0.3",
                defaults={"num_inference_steps": 50, "guidance_scale": 3.5, "height": 1024, "width": 1024},
            ),
        ),
        notes=(
            "The model prepends 8 learned register tokens to the text stream before the joint blocks and "
            "concatenates [text, image] before the single blocks, whose hidden stream is therefore text+image. "
            "Positions are a learned table cropped around the centre of the latent grid (no RoPE); padded prompt "
            "tokens are zeroed by the pipeline, no attention mask reaches the blocks. CFG is batched."
        ),
    )
)
