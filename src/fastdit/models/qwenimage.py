"""Qwen-Image and Qwen-Image-Edit: ``QwenImageTransformer2DModel``.

Blocks (diffusers 0.42.1): one list, ``transformer_blocks`` (60 dual-stream ``QwenImageTransformerBlock``), called by
keyword with ``(hidden_states, encoder_hidden_states, encoder_hidden_states_mask, temb, image_rotary_emb,
joint_attention_kwargs, modulate_index)``; each returns ``(encoder_hidden_states, hidden_states)`` (pattern 1).
Between blocks the forward only adds ControlNet residuals (when given). The editing pipelines append the input
image's latent tokens to the noisy latent tokens, so the image stream is longer than the generated image.
"""

from __future__ import annotations

from fastdit.models._lazy import LazyKwargs, tiny_image
from fastdit.models.base import BlockGroup, ForwardPattern, ModelAdapter, ModelPreset, StepInvariant, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, SplitInput, SplitOutput
from fastdit.parallel.plan_shapes import streams
from fastdit.parallel.tp_plan import TensorParallelPlan
from fastdit.parallel.tp_shapes import feed_forward, joint_attention, modulation, under

TRANSFORMER = "diffusers.models.transformers.transformer_qwenimage.QwenImageTransformer2DModel"

_LATENT_CHANNELS = 4


def tiny_transformer(seed: int = 0, *, num_layers: int = 3):
    """A 3-block ``QwenImageTransformer2DModel`` (2 heads x 16, text width 32) for 4-channel latents."""
    from diffusers import QwenImageTransformer2DModel

    from fastdit.testing.components.encoders import build

    return build(
        QwenImageTransformer2DModel,
        seed=seed,
        patch_size=2,
        in_channels=_LATENT_CHANNELS * 4,
        out_channels=_LATENT_CHANNELS,
        num_layers=num_layers,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        axes_dims_rope=(4, 6, 6),
    )


def tiny_qwen_image(seed: int = 0):
    """A complete tiny ``QwenImagePipeline`` (Qwen2.5-VL text encoder, VAE scale factor 8)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    from fastdit.testing.components.autoencoder_kl_qwenimage import autoencoder_kl_qwenimage
    from fastdit.testing.components.encoders import qwen2_5_vl_model

    text_encoder, tokenizer = qwen2_5_vl_model(seed=seed)
    return QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=autoencoder_kl_qwenimage(latent_channels=_LATENT_CHANNELS, seed=seed),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=tiny_transformer(seed),
    )


def tiny_qwen_image_edit(seed: int = 0):
    """A complete tiny ``QwenImageEditPipeline`` (Qwen2.5-VL sees the input image through a 56x56 processor).

    The pipeline always resizes the input image to ~1 MP before the VAE encode, so this VAE downsamples 32x with
    no residual blocks in the encoder: the input image becomes 16x16 latent tokens and the encode stays cheap.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageEditPipeline

    from fastdit.testing.components.autoencoder_kl_qwenimage import autoencoder_kl_qwenimage
    from fastdit.testing.components.encoders import qwen2_5_vl_model
    from fastdit.testing.components.qwen2_5_vl import qwen2_vl_processor

    text_encoder, tokenizer = qwen2_5_vl_model(seed=seed)
    return QwenImageEditPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=autoencoder_kl_qwenimage(
            latent_channels=_LATENT_CHANNELS, num_downsamples=5, base_dim=2, num_res_blocks=0, seed=seed
        ),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        processor=qwen2_vl_processor(tokenizer),
        transformer=tiny_transformer(seed),
    )


# Context parallelism: the root forward derives RoPE from the full text length and img_shapes, so the sequence is split
# at the first block instead (the blocks see the split streams; the loop between blocks is token-wise). ``pos_embed``
# returns (image, text) rotary tables for the full sequence: both are split like their streams. Every block gets the
# text padding mask, split with the text; the processor then builds a mask over its local [text, image] keys, which
# context-parallel attention all-gathers into the order of the exchanged keys. ``modulate_index`` (zero_cond_t edit
# checkpoints) is per image token.
CP_PLAN = ContextParallelPlan(
    inputs={
        "transformer_blocks.0": streams(),
        "transformer_blocks.*": {
            "encoder_hidden_states_mask": SplitInput(dim=1, expected_dims=2),
            "modulate_index": SplitInput(dim=1, expected_dims=2),
        },
    },
    outputs={"pos_embed": (SplitOutput(dim=0, expected_dims=2, index=0), SplitOutput(dim=0, expected_dims=2, index=1))},
    gather={"proj_out": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(modules=("diffusers.models.transformers.transformer_qwenimage",)),
    notes="RoPE tables from pos_embed split like the streams; the split text mask is gathered inside attention.",
)

# A negative prompt turns on true CFG: two transformer calls per step ("cond" then "uncond" cache contexts).
_CALL = {
    "prompt": "a cat holding a sign",
    "negative_prompt": "blue",
    "true_cfg_scale": 4.0,
    "num_inference_steps": 2,
    "max_sequence_length": 16,
}

# Tensor parallelism: diffusers' `_tp_plan` (joint attention, image and text FFNs) plus the per-block AdaLN modulation
# (`img_mod.1`, `txt_mod.1`: dim → 6·dim each, ~1/3 of Qwen-Image's weights) split with a gathered output, which
# diffusers keeps whole — the reason a TP-2 Qwen-Image elsewhere is barely smaller than one GPU. The processor takes
# head_dim as inner_dim // heads, so both are divided (their ratio stays the head size).
TP_PLAN = TensorParallelPlan(
    layers=under(
        "transformer_blocks.*",
        {
            **joint_attention("attn"),
            **feed_forward("img_mlp"),
            **feed_forward("txt_mlp"),
            **modulation("img_mod.1", "txt_mod.1"),
        },
    ),
    divide=("transformer_blocks.*.attn.heads", "transformer_blocks.*.attn.inner_dim"),
    notes="diffusers' plan plus per-block modulation split with a gathered output (~1/3 of the weights).",
)

# The pipelines pass the same prompt embeddings and img_shapes at every step (one prompt tensor per CFG branch, made
# before the loop). The text stream is txt_in(txt_norm(encoder_hidden_states)): both keyed on the transformer's
# argument (txt_in's input is the norm's output, a function of it). `pos_embed` takes only img_shapes, the text
# length (an int) and the device, compared by value.
STEP_INVARIANT = (
    StepInvariant("txt_norm", inputs=("encoder_hidden_states",)),
    StepInvariant("txt_in", inputs=("encoder_hidden_states",)),
    StepInvariant("pos_embed"),
)

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "transformer_blocks": (
        ("attn.to_q", "attn.to_k", "attn.to_v"),
        ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    ),
}

ADAPTER = register(
    ModelAdapter(
        family="qwenimage",
        fused_projections=FUSED_PROJECTIONS,
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="transformer_blocks", pattern=ForwardPattern.P1),),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        step_invariant=STEP_INVARIANT,
        tiny_pipelines=(
            TinyPipeline(name="qwen-image", build=tiny_qwen_image, call_kwargs={**_CALL, "height": 32, "width": 32}),
            TinyPipeline(
                name="edit",
                build=tiny_qwen_image_edit,
                # Output size is free (multiple of 64 here); the input image is resized to ~1 MP regardless.
                call_kwargs=LazyKwargs({**_CALL, "image": tiny_image(), "height": 128, "width": 128}),
            ),
        ),
        presets=(
            ModelPreset(
                name="qwen-image",
                pipeline_class="diffusers.QwenImagePipeline",
                hub_id="Qwen/Qwen-Image",
                defaults={"num_inference_steps": 50, "true_cfg_scale": 4.0, "height": 1328, "width": 1328},
            ),
            ModelPreset(
                name="qwen-image-edit",
                pipeline_class="diffusers.QwenImageEditPipeline",
                hub_id="Qwen/Qwen-Image-Edit",
                defaults={"num_inference_steps": 50, "true_cfg_scale": 4.0},
            ),
            ModelPreset(
                name="qwen-image-edit-plus",
                pipeline_class="diffusers.QwenImageEditPlusPipeline",
                hub_id="Qwen/Qwen-Image-Edit-2509",
                defaults={"num_inference_steps": 40, "true_cfg_scale": 4.0},
            ),
        ),
        notes=(
            "Blocks take a text padding mask (encoder_hidden_states_mask) used inside joint attention: under context "
            "parallelism it must be reordered with the text tokens. RoPE is built per forward from img_shapes and the "
            "text length; true CFG runs two transformer calls per step (cond/uncond). Edit pipelines append the "
            "input image's tokens to the image stream, and Edit-2511-style checkpoints (zero_cond_t) double the "
            "timestep batch and pass a per-token modulate_index."
            " No spectral signal: the latent arrives packed into a token sequence (batch, tokens, channels): no grid "
            "to filter."
        ),
    )
)
