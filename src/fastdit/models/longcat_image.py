"""LongCat-Image and LongCat-Image-Edit: ``LongCatImageTransformer2DModel`` (a FLUX-style MMDiT on Qwen2.5-VL).

Blocks (diffusers 0.42.1): 19 dual-stream ``transformer_blocks`` then 38 single-stream ``single_transformer_blocks``;
both are called by keyword with ``(hidden_states, encoder_hidden_states, temb, image_rotary_emb)`` and return
``(encoder_hidden_states, hidden_states)`` (pattern 1). Nothing runs between blocks.
"""

from __future__ import annotations

from fastdit.models._lazy import LazyKwargs, tiny_image
from fastdit.models.base import BlockGroup, ForwardPattern, ModelAdapter, ModelPreset, StepInvariant, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan_shapes import mmdit_root_plan
from fastdit.parallel.tp_shapes import flux1_tp_plan

TRANSFORMER = "diffusers.models.transformers.transformer_longcat_image.LongCatImageTransformer2DModel"

# The pipelines hard-code 16 latent channels (packed 2x2 into 64 transformer channels).
_LATENT_CHANNELS = 16
_SCALING, _SHIFT = 0.3611, 0.1159


def tiny_transformer(seed: int = 0, *, num_layers: int = 1, num_single_layers: int = 2):
    """A 3-block ``LongCatImageTransformer2DModel`` (2 heads x 16, Qwen2.5-VL width 32)."""
    from diffusers import LongCatImageTransformer2DModel

    from fastdit.testing.components.encoders import build

    return build(
        LongCatImageTransformer2DModel,
        seed=seed,
        patch_size=1,
        in_channels=_LATENT_CHANNELS * 4,
        num_layers=num_layers,
        num_single_layers=num_single_layers,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=[4, 6, 6],
    )


def tiny_edit_vae(seed: int = 0):
    """A narrow ``AutoencoderKL`` (2 channels a level) with scale factor 32 and no encoder resnets, cheap at 1 MP.

    LongCat-Image-Edit always works at ~1 MP (the output size follows the input's aspect ratio), so the VAE must be
    cheap at full resolution and downsample far enough that the transformer sees few tokens.
    """
    from fastdit.testing.components.autoencoder_kl import autoencoder_kl

    return autoencoder_kl(
        latent_channels=_LATENT_CHANNELS,
        num_levels=6,
        scaling_factor=_SCALING,
        shift_factor=_SHIFT,
        use_quant_conv=False,
        width=2,
        layers_per_block=0,
        seed=seed,
    )


def _components(seed: int, vae) -> dict:
    from diffusers import FlowMatchEulerDiscreteScheduler

    from fastdit.testing.components.encoders import qwen2_5_vl_model
    from fastdit.testing.components.qwen2_5_vl import qwen2_vl_processor

    text_encoder, tokenizer = qwen2_5_vl_model(seed=seed)
    return {
        "scheduler": FlowMatchEulerDiscreteScheduler(),
        "vae": vae,
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "text_processor": qwen2_vl_processor(tokenizer),
        "transformer": tiny_transformer(seed),
    }


def tiny_longcat_image(seed: int = 0):
    """A complete tiny ``LongCatImagePipeline`` (Qwen2.5-VL text encoder, 16-channel KL VAE with scale factor 2)."""
    from diffusers import LongCatImagePipeline

    from fastdit.testing.components.autoencoder_kl import autoencoder_kl

    vae = autoencoder_kl(latent_channels=_LATENT_CHANNELS, scaling_factor=_SCALING, shift_factor=_SHIFT, seed=seed)
    return LongCatImagePipeline(**_components(seed, vae))


def tiny_longcat_image_edit(seed: int = 0):
    """A complete tiny ``LongCatImageEditPipeline`` (the input image is VAE-encoded and appended as tokens)."""
    from diffusers import LongCatImageEditPipeline

    return LongCatImageEditPipeline(**_components(seed, tiny_edit_vae(seed)))


# guidance_scale > 1 turns on CFG: two transformer calls per step ("cond" then "uncond"). The prompt rewrite runs
# text generation with the VL model; it is off so the run stays short and independent of sampling.
_CALL = {
    "prompt": "a cat holding a sign",
    "negative_prompt": "blue",
    "guidance_scale": 4.5,
    "num_inference_steps": 2,
}

# The pipelines pass the same position ids and prompt embeddings at every step (the uncond call its own, also fixed):
# the rotary table (computed in forward from cat(txt_ids, img_ids)) and the text projection repeat. Both are keyed on
# the transformer's arguments, which context parallelism splits beneath the lookup (a new shard every call).
STEP_INVARIANT = (
    StepInvariant("pos_embed", inputs=("txt_ids", "img_ids")),
    StepInvariant("context_embedder", inputs=("encoder_hidden_states",)),
)

# Context parallelism: as for Flux, the forward is "embed, loop over blocks, project out" (the single blocks concatenate
# and split [text, image] themselves, by the local text length), so the root inputs are split. RoPE is computed inside
# forward from cat(txt_ids, img_ids) (2-D ids); splitting the ids on their sequence dim like the streams gives every
# rank the rotary embedding of exactly its tokens. Edit's input-image tokens are in hidden_states and img_ids already.
CP_PLAN = mmdit_root_plan(
    "diffusers.models.transformers.transformer_longcat_image",
    notes="RoPE from img_ids/txt_ids, split on their sequence dim with the streams: no RoPE patch needed.",
)

# Tensor parallelism: FLUX.1's split. The processor reshapes with ``attn.heads`` (divided); the QK-norms are per head
# (replicated). The per-block AdaLN linears (dim -> 6·dim per stream and dual block, dim -> 3·dim per single block) are
# split with a gathered output, as for FLUX.1; embedders and the output layers stay whole. The single block's proj_out
# reads cat([attn_out, mlp_hidden]): each stream is split on its own.
TP_PLAN = flux1_tp_plan(
    notes="FLUX.1's split plus per-block AdaLN modulation split with a gathered output; embedders, output layers "
    "and QK-norms (per head) replicated.",
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
        family="longcat_image",
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
                name="longcat-image",
                build=tiny_longcat_image,
                call_kwargs={**_CALL, "height": 32, "width": 32, "enable_prompt_rewrite": False},
            ),
            # The edit pipeline takes no height/width: its output is the input's aspect ratio at ~1 MP (1024x1024).
            TinyPipeline(
                name="edit", build=tiny_longcat_image_edit, call_kwargs=LazyKwargs({**_CALL, "image": tiny_image()})
            ),
        ),
        presets=(
            ModelPreset(
                name="longcat-image",
                pipeline_class="diffusers.LongCatImagePipeline",
                hub_id="meituan-longcat/LongCat-Image",
                defaults={"num_inference_steps": 50, "guidance_scale": 4.5, "height": 1024, "width": 1024},
            ),
            ModelPreset(
                name="longcat-image-edit",
                pipeline_class="diffusers.LongCatImageEditPipeline",
                hub_id="meituan-longcat/LongCat-Image-Edit",
                defaults={"num_inference_steps": 50, "guidance_scale": 4.5},
            ),
        ),
        notes=(
            "FLUX-like layout (img_ids/txt_ids, RoPE from the concatenated ids). The text stream is always padded to "
            "512 tokens and no attention mask reaches the transformer. Edit appends the input image's tokens to the "
            "image stream and fixes the output at ~1 MP. CFG runs two transformer calls per step (cond/uncond)."
            " No spectral signal: the latent arrives packed into a token sequence (batch, tokens, channels): no grid "
            "to filter."
        ),
    )
)
