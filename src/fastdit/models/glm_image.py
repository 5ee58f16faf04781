"""GLM-Image (autoregressive prior + diffusion decoder): ``GlmImageTransformer2DModel``.

Blocks (diffusers 0.42.1): one list ``transformer_blocks`` of ``GlmImageTransformerBlock``, called positionally as
``block(hidden_states, encoder_hidden_states, temb, image_rotary_emb, attention_mask, attention_kwargs,
kv_cache=...)`` and returning ``(hidden_states, encoder_hidden_states)`` (pattern 0). Forward patchifies the latent,
adds the embedded prior tokens (image tokens the autoregressive stage generated, upsampled to the latent grid) to the
image tokens, projects the glyph text (ByT5 embeddings of the quoted text in the prompt) and builds the image RoPE
from the latent's shape (``rope``). Each block attends jointly over ``[text, image]``; nothing runs between blocks.

Image-to-image: before the denoising loop the pipeline runs the transformer once per condition image at timestep 0
with an empty text and ``kv_caches`` in ``"write"`` mode (every block stores its keys and values); then every
conditional call reads them (``"read"``: the cached keys are prepended) and the unconditional one ignores them
(``"skip"``). The write pass is declared an unstepped call: it computes every block and is no step of either branch.

The pipeline's first stage is ``GlmImageForConditionalGeneration`` (transformers 5) with its ``GlmImageProcessor``,
which generates the prior tokens. ``GlmImagePipeline`` skips that stage when the caller passes ``prior_token_ids``
(and, for image-to-image, ``prior_token_image_ids`` and ``source_image_grid_thw``): the tiny pipelines do, with
``processor`` and ``vision_language_encoder`` left ``None``, because the stage's processor needs a tokenizer with
GLM-Image's grid and image tokens and chat template, which no offline component builds yet. Everything the
transformer receives is what the pipeline passes after that stage.
"""

from __future__ import annotations

import torch

from fastdit.models._lazy import Deferred, LazyKwargs, tiny_image
from fastdit.models.base import BlockGroup, ForwardPattern, LatentLayout, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, SplitInput, SplitOutput
from fastdit.parallel.tp_plan import TensorParallelPlan
from fastdit.parallel.tp_shapes import attention, feed_forward, modulation, under

TRANSFORMER = "diffusers.models.transformers.transformer_glm_image.GlmImageTransformer2DModel"
_MODULE = "diffusers.models.transformers.transformer_glm_image"

_LATENT_CHANNELS = 4
_TEXT_DIM = 32
_CODEBOOK = 16
_SIZE = 32  # pixels; the tiny VAE's scale factor is 2 and the patch 2: an 8 x 8 token grid
_GRID = _SIZE // 4


def tiny_transformer(seed: int = 0):
    """A 3-block ``GlmImageTransformer2DModel`` (2 heads x 16, a 16-entry prior codebook)."""
    from diffusers import GlmImageTransformer2DModel

    from fastdit.testing.components.encoders import build

    return build(
        GlmImageTransformer2DModel,
        seed=seed,
        patch_size=2,
        in_channels=_LATENT_CHANNELS,
        out_channels=_LATENT_CHANNELS,
        num_layers=3,
        attention_head_dim=16,
        num_attention_heads=2,
        text_embed_dim=_TEXT_DIM,
        time_embed_dim=16,
        condition_dim=8,
        prior_vq_quantizer_codebook_size=_CODEBOOK,
    )


def tiny_glm_image(seed: int = 0):
    """A tiny ``GlmImagePipeline``: ByT5 glyph encoder, 4-channel KL VAE, no autoregressive stage (see the module)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, GlmImagePipeline

    from fastdit.testing.components.autoencoder_kl import autoencoder_kl
    from fastdit.testing.components.byt5 import byt5_encoder

    text_encoder, tokenizer = byt5_encoder(d_model=_TEXT_DIM, seed=seed)
    vae = autoencoder_kl(latent_channels=_LATENT_CHANNELS, num_levels=2, seed=seed)
    # The pipeline normalises latents with the VAE's per-channel statistics.
    vae.register_to_config(latents_mean=[0.0] * _LATENT_CHANNELS, latents_std=[1.0] * _LATENT_CHANNELS)
    return GlmImagePipeline(
        tokenizer=tokenizer,
        processor=None,
        text_encoder=text_encoder,
        vision_language_encoder=None,
        vae=vae,
        transformer=tiny_transformer(seed),
        # GLM-Image's scheduler: a time-shifted flow-matching schedule with dynamic shifting.
        scheduler=FlowMatchEulerDiscreteScheduler(
            base_shift=0.25, max_shift=0.75, base_image_seq_len=256, use_dynamic_shifting=True, time_shift_type="linear"
        ),
    )


def _prior_tokens(count: int, batch: bool) -> torch.Tensor:
    """Prior token ids as the autoregressive stage hands them over (upsampled to the latent grid), fixed."""
    ids = (torch.arange(count) * 5 + 3).remainder(_CODEBOOK)
    return ids[None] if batch else ids


def _source_grid() -> list[torch.Tensor]:
    return [torch.tensor([[1, _GRID, _GRID]])]  # per sample: one condition image's (t, h, w) on the latent grid


def _prior_image_tokens() -> list[torch.Tensor]:
    return [_prior_tokens(_GRID * _GRID, batch=False)]


def _condition_images() -> list:
    return [tiny_image(_SIZE).build()]


# The glyph text is the quoted part of the prompt; guidance_scale > 1: a conditional and an unconditional call per
# step (the negative glyph text is empty: one token).
_T2I = {
    "prompt": 'a sign that says "hello"',
    "prior_token_ids": Deferred(_prior_tokens, (_GRID * _GRID, True)),
    "guidance_scale": 1.5,
    "height": _SIZE,
    "width": _SIZE,
    "num_inference_steps": 2,
}
_I2I = {
    **_T2I,
    "image": Deferred(_condition_images),
    "prior_token_image_ids": Deferred(_prior_image_tokens),
    "source_image_grid_thw": Deferred(_source_grid),
}


def writes_kv_cache(kv_caches: object) -> bool:
    """Whether a call's ``kv_caches`` (a ``GlmImageKVCache``) is in write mode: the condition-image pass."""
    caches = getattr(kv_caches, "caches", None)
    return bool(caches) and getattr(caches[0], "mode", None) == "write"


def refuse_text_mask(mask: torch.Tensor) -> torch.Tensor:
    """Refuse the processor's text mask under context parallelism (the pipeline passes none).

    ``GlmImageAttnProcessor`` turns a ``(B, S_txt)`` text mask into ``m_i * m_j`` over the rank's local ``[text,
    image]`` tokens and passes it as a *float* mask, which attention adds to the scores (+1 for valid pairs, +0
    otherwise: padded tokens are biased, not hidden). The global square needs every rank's text mask, which a rank
    does not hold, and no key-padding mask adds the same biases.

    Raises:
        ValueError: always (on every rank alike: whether a mask is passed is the same everywhere).
    """
    raise ValueError(
        f"GLM-Image under context parallelism: attention_mask (a text mask, seen by attention as "
        f"{tuple(mask.shape)}) is not supported; the pipeline passes none: call the transformer without it"
    )


# Context parallelism: forward patchifies the latent, adds the prior tokens and projects the glyph text, so both
# streams are split at the first block and the image RoPE (cos, sin) tables (S_img, head_dim) at the rope module's
# output (or at the root when a caller passes them). Each rank's joint sequence is [text shard, image shard]; without
# a mask the order of keys does not matter. The glyph text can be shorter than the ranks (the empty negative prompt
# is one token, the condition-image pass has none): it is split with empty shards allowed, every rank still holding
# image tokens. A text mask is refused (see refuse_text_mask).
# In the condition-image pass each rank stores its shard's keys and values in the KV cache and each later call
# prepends them to its own: the exchange gathers every cached key once. The output projection is gathered.
_TEXT = SplitInput(dim=1, expected_dims=3, allow_empty=True)
CP_PLAN = ContextParallelPlan(
    inputs={
        "": {"image_rotary_emb": SplitInput(dim=0, expected_dims=2)},
        "transformer_blocks.0": {"hidden_states": SplitInput(dim=1, expected_dims=3), "encoder_hidden_states": _TEXT},
        # Split like the text, so that the processor builds its mask over local tokens and attention refuses it.
        "transformer_blocks.*": {"attention_mask": SplitInput(dim=1, expected_dims=2, allow_empty=True)},
    },
    outputs={"rope": (SplitOutput(dim=0, expected_dims=2, index=0), SplitOutput(dim=0, expected_dims=2, index=1))},
    gather={"proj_out": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(modules=(_MODULE,), mask_transform=refuse_text_mask),
    notes="Both streams split at transformer_blocks.0 (the glyph text may leave ranks empty), image RoPE at the rope "
    "module's output; the KV cache of condition images holds each rank's shard; gathered "
    "after proj_out.",
)

# Tensor parallelism: attention by heads (to_q/to_k/to_v column-wise, to_out row-wise; the processor unflattens with
# attn.heads: divided; the QK LayerNorms are over head_dim, per head, whole; the KV cache then holds each rank's
# heads), the shared-stream FFN by hidden size, the per-block AdaLN linear (12 x dim) split with a gathered output.
# The glyph and prior projectors, the embedders, RoPE and the final norm stay whole.
TP_PLAN = TensorParallelPlan(
    layers=under("transformer_blocks.*", {**attention("attn1"), **feed_forward(), **modulation("norm1.linear")}),
    divide=("transformer_blocks.*.attn1.heads",),
    notes="Attention split by heads (the condition KV cache holds each rank's heads), the shared-stream FFN by hidden "
    "size, per-block AdaLN (12 x dim) split with a gathered output; glyph and prior projectors whole.",
)

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "transformer_blocks": (("attn1.to_q", "attn1.to_k", "attn1.to_v"),),
}

ADAPTER = register(
    ModelAdapter(
        family="glm_image",
        fused_projections=FUSED_PROJECTIONS,
        # hidden_states is (batch, channels, height, width). The prior tokens and the reference image's KV cache
        # arrive apart.
        latent=LatentLayout(),
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="transformer_blocks", pattern=ForwardPattern.P0),),
        unstepped_calls={"kv_caches": (writes_kv_cache,)},
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        # Two calls per step, cond then uncond, that announce no cache context; the pipeline combines them after both.
        cfg_pairs_by_timestep=True,
        tiny_pipelines=(
            TinyPipeline(name="t2i", build=tiny_glm_image, call_kwargs=LazyKwargs(_T2I)),
            TinyPipeline(name="i2i", build=tiny_glm_image, call_kwargs=LazyKwargs(_I2I)),
        ),
        presets=(
            ModelPreset(
                name="glm-image",
                pipeline_class="diffusers.GlmImagePipeline",
                hub_id="zai-org/GLM-Image",
                defaults={"num_inference_steps": 50, "guidance_scale": 1.5, "height": 1024, "width": 1024},
            ),
        ),
        notes=(
            "The autoregressive stage (GlmImageForConditionalGeneration + GlmImageProcessor, transformers 5) generates "
            "the prior image tokens the transformer embeds; the tiny pipelines pass prior_token_ids instead (the "
            "pipeline then skips that stage): no offline tokenizer with GLM-Image's grid tokens and chat template "
            "exists yet. Text is the glyph text only (ByT5), the empty negative prompt one token. Image-to-image "
            "runs a write pass per condition image (timestep 0, kv_caches in write mode) declared unstepped: cache "
            "and CFG parallelism compute it on every rank and count no step. CFG runs two unannounced calls per step "
            "(paired by timestep). Under context parallelism a text `attention_mask` (which the pipeline never passes) "
            "is refused: the processor builds an additive square over local tokens that no rank can globalise. "
            "No expert layers."
        ),
    )
)
