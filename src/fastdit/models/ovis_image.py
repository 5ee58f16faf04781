"""Ovis-Image: ``OvisImageTransformer2DModel`` (a FLUX-style MMDiT conditioned on Qwen3).

Blocks (diffusers 0.42.1): 6 dual-stream ``transformer_blocks`` then 27 single-stream ``single_transformer_blocks``;
both are called by keyword with ``(hidden_states, encoder_hidden_states, temb, image_rotary_emb,
joint_attention_kwargs)`` and return ``(encoder_hidden_states, hidden_states)`` (pattern 1; the single blocks
concatenate and split the two streams internally). Nothing runs between blocks.
"""

from __future__ import annotations

from fastdit.models.base import BlockGroup, ForwardPattern, ModelAdapter, ModelPreset, StepInvariant, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan_shapes import mmdit_root_plan
from fastdit.parallel.tp_plan import Colwise, Rowwise, TensorParallelPlan
from fastdit.parallel.tp_shapes import joint_attention, modulation, under

TRANSFORMER = "diffusers.models.transformers.transformer_ovis_image.OvisImageTransformer2DModel"

_LATENT_CHANNELS = 4


def tiny_transformer(seed: int = 0, *, num_layers: int = 1, num_single_layers: int = 2):
    """A 3-block ``OvisImageTransformer2DModel`` (2 heads x 16, Qwen3 width 32) for 2x2-packed 4-channel latents."""
    from diffusers import OvisImageTransformer2DModel

    from fastdit.testing.components.encoders import build

    return build(
        OvisImageTransformer2DModel,
        seed=seed,
        patch_size=1,
        in_channels=_LATENT_CHANNELS * 4,
        out_channels=_LATENT_CHANNELS * 4,
        num_layers=num_layers,
        num_single_layers=num_single_layers,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        axes_dims_rope=(4, 6, 6),
    )


def tiny_ovis_image(seed: int = 0):
    """A complete tiny ``OvisImagePipeline`` (Qwen3 text encoder, FLUX-style KL VAE with scale factor 2)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, OvisImagePipeline

    from fastdit.testing.components.autoencoder_kl import autoencoder_kl
    from fastdit.testing.components.qwen3 import qwen3_model

    text_encoder, tokenizer = qwen3_model(seed=seed)
    return OvisImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=autoencoder_kl(latent_channels=_LATENT_CHANNELS, scaling_factor=0.3611, shift_factor=0.1159, seed=seed),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=tiny_transformer(seed),
    )


# Context parallelism: as for Flux, the forward is "embed, loop over blocks, project out" (the single blocks concatenate
# and split [text, image] themselves, by the local text length), so the root inputs are split. RoPE is computed inside
# forward from cat(txt_ids, img_ids); splitting the ids on their sequence dim (-2 for the 2-D ids and the deprecated
# 3-D ones) like the streams gives every rank the rotary embedding of exactly its tokens.
CP_PLAN = mmdit_root_plan(
    "diffusers.models.transformers.transformer_ovis_image",
    notes="RoPE from img_ids/txt_ids, split on their sequence dim with the streams: no RoPE patch needed.",
)

# Tensor parallelism: FLUX.1's split with SwiGLU FFNs. The processor reshapes with ``attn.heads`` (divided); the
# QK-norms are per head (replicated). Every up projection is fused: the dual blocks' ``net.0.proj`` is [hidden|gate]
# (chunked in two) and the single block's ``proj_mlp`` is [hidden|gate] split at ``mlp_hidden_dim`` (divided, as the
# block's forward splits with it), so each half is split on its own. The per-block AdaLN linears (dim -> 6·dim per
# stream and dual block, dim -> 3·dim per single block) are split with a gathered output, as for FLUX.1; embedders and
# the output layers stay whole. The single block's proj_out reads cat([attn_out, mlp_hidden]).
_SWIGLU_FF = {"net.0.proj": Colwise(segments=(1, 1)), "net.2": Rowwise()}
TP_PLAN = TensorParallelPlan(
    layers={
        **under("transformer_blocks.*", joint_attention()),
        **under("transformer_blocks.*.ff", _SWIGLU_FF),
        **under("transformer_blocks.*.ff_context", _SWIGLU_FF),
        **under("transformer_blocks.*", modulation("norm1.linear", "norm1_context.linear")),
        **under(
            "single_transformer_blocks.*",
            {
                "attn.to_q": Colwise(),
                "attn.to_k": Colwise(),
                "attn.to_v": Colwise(),
                "proj_mlp": Colwise(segments=("mlp_hidden_dim", "mlp_hidden_dim")),
                "proj_out": Rowwise(segments=("attn.inner_dim", "mlp_hidden_dim")),
                **modulation("norm.linear"),
            },
        ),
    },
    divide=(
        "transformer_blocks.*.attn.heads",
        "single_transformer_blocks.*.attn.heads",
        "single_transformer_blocks.*.mlp_hidden_dim",
    ),
    notes="FLUX.1's split with fused SwiGLU [hidden|gate] halves split on their own, per-block AdaLN modulation "
    "split with a gathered output; embedders, output layers and QK-norms (per head) replicated.",
)

# The pipeline passes the same position ids and prompt embeddings at every step (the uncond call its own, also fixed):
# the rotary table (computed in forward from cat(txt_ids, img_ids)) and the text projection (RMSNorm, then a linear)
# repeat. All are keyed on the transformer's arguments, which context parallelism splits beneath the lookup (a new
# shard every call); the linear reads the norm's output, itself a function of encoder_hidden_states.
STEP_INVARIANT = (
    StepInvariant("pos_embed", inputs=("txt_ids", "img_ids")),
    StepInvariant("context_embedder_norm", inputs=("encoder_hidden_states",)),
    StepInvariant("context_embedder", inputs=("encoder_hidden_states",)),
)

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "transformer_blocks": (
        ("attn.to_q", "attn.to_k", "attn.to_v"),
        ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    ),
    "single_transformer_blocks": (("proj_mlp", "attn.to_q", "attn.to_k", "attn.to_v"),),
}

ADAPTER = register(
    ModelAdapter(
        family="ovis_image",
        fused_projections=FUSED_PROJECTIONS,
        transformer_classes=(TRANSFORMER,),
        block_groups=(
            BlockGroup(path="transformer_blocks", pattern=ForwardPattern.P1),
            BlockGroup(path="single_transformer_blocks", pattern=ForwardPattern.P1),
        ),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        step_invariant=STEP_INVARIANT,
        tiny_pipelines=(
            TinyPipeline(
                name="ovis-image",
                build=tiny_ovis_image,
                # guidance_scale > 1 turns on CFG: two transformer calls per step ("cond" then "uncond").
                call_kwargs={
                    "prompt": "a cat holding a sign",
                    "negative_prompt": "blue",
                    "guidance_scale": 5.0,
                    "height": 32,
                    "width": 32,
                    "num_inference_steps": 2,
                    "max_sequence_length": 16,
                },
            ),
        ),
        presets=(
            ModelPreset(
                name="ovis-image",
                pipeline_class="diffusers.OvisImagePipeline",
                hub_id="AIDC-AI/Ovis-Image-7B",
                defaults={"num_inference_steps": 50, "guidance_scale": 5.0, "height": 1024, "width": 1024},
            ),
        ),
        notes=(
            "FLUX-like layout (img_ids/txt_ids, RoPE built from the concatenated ids, no attention mask: padded text "
            "tokens are zeroed by the pipeline). CFG runs two transformer calls per step (cond/uncond)."
            " No spectral signal: the latent arrives packed into a token sequence (batch, tokens, channels): no grid "
            "to filter."
        ),
    )
)
