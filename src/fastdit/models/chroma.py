"""Chroma (Chroma1-HD / Base / Flash, text-to-image and image-to-image): ``ChromaTransformer2DModel``.

Blocks (diffusers 0.42.1): ``transformer_blocks`` (double stream) are called by keyword with ``(hidden_states,
encoder_hidden_states, temb, image_rotary_emb, attention_mask, joint_attention_kwargs)`` and return
``(encoder_hidden_states, hidden_states)`` (pattern 1). The model then concatenates ``[text, image]`` and runs
``single_transformer_blocks``, called by keyword with ``(hidden_states, temb, image_rotary_emb, attention_mask,
joint_attention_kwargs)`` and returning the joint sequence (pattern 3).
"""

from __future__ import annotations

from fastdit.models._lazy import LazyKwargs, tiny_image
from fastdit.models.base import BlockGroup, ForwardPattern, ModelAdapter, ModelPreset, StepInvariant, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan_shapes import mmdit_root_plan
from fastdit.parallel.tp_shapes import flux1_tp_plan

TRANSFORMER = "diffusers.models.transformers.transformer_chroma.ChromaTransformer2DModel"

_TEXT_DIM = 32


def tiny_transformer(seed: int = 0):
    """A 3-block ``ChromaTransformer2DModel`` (1 double + 2 single) for 2x2-packed 4-channel latents."""
    from diffusers import ChromaTransformer2DModel

    from fastdit.testing.components.encoders import build

    return build(
        ChromaTransformer2DModel,
        seed=seed,
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=_TEXT_DIM,
        axes_dims_rope=(4, 6, 6),
        approximator_num_channels=16,
        approximator_hidden_dim=32,
        approximator_layers=1,
    )


def _components(seed: int) -> dict:
    from diffusers import FlowMatchEulerDiscreteScheduler

    from fastdit.testing.components.autoencoder_kl import autoencoder_kl
    from fastdit.testing.components.encoders import t5_encoder

    text_encoder, tokenizer = t5_encoder(d_model=_TEXT_DIM, seed=seed + 1)
    return {
        "transformer": tiny_transformer(seed),
        "vae": autoencoder_kl(latent_channels=4, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False),
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=False),
    }


def tiny_chroma(seed: int = 0):
    """A complete tiny ``ChromaPipeline``."""
    from diffusers import ChromaPipeline

    return ChromaPipeline(**_components(seed))


def tiny_chroma_img2img(seed: int = 0):
    """A complete tiny ``ChromaImg2ImgPipeline``."""
    from diffusers import ChromaImg2ImgPipeline

    return ChromaImg2ImgPipeline(**_components(seed))


# Context parallelism: as for Flux, the forward is "embed, double blocks, concatenate [text, image], single blocks,
# drop the text, project out", token-wise outside attention, so the root inputs are split; RoPE is computed inside
# forward from txt_ids/img_ids, split on their sequence dim (-2 for the 2-D ids and the deprecated 3-D ones) like the
# streams. The pipeline's attention_mask covers the global [text, image] sequence and every block expands it to a
# (B, 1, S, S) mask over it, so it stays whole: attention reorders it into shard order by mask_segments.
CP_PLAN = mmdit_root_plan(
    "diffusers.models.transformers.transformer_flux",
    notes="RoPE from img_ids/txt_ids split with the streams; the global [text, image] mask is reordered in attention.",
)

# Tensor parallelism: FLUX.1's split of the attention and FFN linears (FluxAttnProcessor reshapes with head_dim, the
# QK-norms are per head). Chroma prunes the per-block AdaLN linears: every block reads its modulation from the shared
# approximator (distilled_guidance_layer), which stays replicated with the embedders and the output layers. The single
# block's proj_out reads cat([attn_out, mlp_hidden]): each stream is split on its own.
TP_PLAN = flux1_tp_plan(
    notes="FLUX.1's attention/FFN split; no per-block AdaLN linears (pruned: the shared approximator stays "
    "replicated); QK-norms are per head (replicated).",
    modulated=False,
)

# The pipelines pass the same position ids and prompt embeddings at every step (the uncond call its own, also fixed):
# the rotary table (computed in forward from cat(txt_ids, img_ids)) and the text projection repeat. Both are keyed on
# the transformer's arguments, which context parallelism splits beneath the lookup (a new shard every call).
STEP_INVARIANT = (
    StepInvariant("pos_embed", inputs=("txt_ids", "img_ids")),
    StepInvariant("context_embedder", inputs=("encoder_hidden_states",)),
)

_CALL = {
    "prompt": "a cat holding a sign",
    "negative_prompt": "a dog",
    "height": 32,
    "width": 32,
    "num_inference_steps": 2,
    "guidance_scale": 4.0,
    "max_sequence_length": 16,
}

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
        family="chroma",
        fused_projections=FUSED_PROJECTIONS,
        # CFG as two unannounced calls per step, each output used only after both: paired by timestep.
        cfg_pairs_by_timestep=True,
        transformer_classes=(TRANSFORMER,),
        block_groups=(
            BlockGroup(path="transformer_blocks", pattern=ForwardPattern.P1),
            BlockGroup(path="single_transformer_blocks", pattern=ForwardPattern.P3),
        ),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        step_invariant=STEP_INVARIANT,
        tiny_pipelines=(
            TinyPipeline(name="chroma", build=tiny_chroma, call_kwargs=_CALL),
            TinyPipeline(
                name="img2img",
                build=tiny_chroma_img2img,
                # strength 0.5 of 4 scheduled steps leaves 2 denoising steps.
                call_kwargs=LazyKwargs({**_CALL, "image": tiny_image(), "strength": 0.5, "num_inference_steps": 4}),
            ),
        ),
        presets=(
            ModelPreset(
                name="chroma",
                pipeline_class="diffusers.ChromaPipeline",
                hub_id="lodestones/Chroma1-HD",
                defaults={"num_inference_steps": 40, "guidance_scale": 3.0, "height": 1024, "width": 1024},
            ),
            ModelPreset(
                name="chroma-flash",
                pipeline_class="diffusers.ChromaPipeline",
                hub_id="lodestones/Chroma1-Flash",
                defaults={"num_inference_steps": 8, "guidance_scale": 1.0, "height": 1024, "width": 1024},
            ),
        ),
        notes=(
            "True CFG: the pipeline runs the transformer twice per step (cond, then uncond, each with its own prompt "
            "mask) without cache_context. Every block receives its own `temb` slice of the "
            "approximator output, and an `attention_mask` over [text, image] that masks padded prompt tokens; "
            "RoPE comes from `txt_ids`/`img_ids` inputs (computed outside the blocks)."
            " No spectral signal: the latent arrives packed into a token sequence (batch, tokens, channels): no grid "
            "to filter."
        ),
    )
)
