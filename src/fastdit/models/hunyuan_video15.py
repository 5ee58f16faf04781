"""HunyuanVideo 1.5 (T2V, I2V): ``HunyuanVideo15Transformer3DModel``.

Blocks (diffusers 0.42.1): one list ``transformer_blocks`` of dual-stream ``HunyuanVideo15TransformerBlock``; the model
calls each positionally as ``block(hidden_states, encoder_hidden_states, temb, encoder_attention_mask,
image_rotary_emb)`` and the block returns ``(hidden_states, encoder_hidden_states)`` (pattern 0). The encoder stream
is the concatenation of SigLIP image tokens, ByT5 glyph-text tokens and Qwen2.5-VL text tokens, valid ones first.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from fastdit.models._lazy import LazyKwargs, tiny_image
from fastdit.models.base import BlockGroup, ForwardPattern, LatentLayout, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, SplitInput, SplitOutput
from fastdit.parallel.plan_shapes import streams
from fastdit.parallel.tp_plan import TensorParallelPlan
from fastdit.parallel.tp_shapes import feed_forward, joint_attention, modulation, under

if TYPE_CHECKING:
    import torch

TRANSFORMER = "diffusers.models.transformers.transformer_hunyuan_video15.HunyuanVideo15Transformer3DModel"

_LATENT = 4
_TEXT_DIM = 32  # tiny Qwen2.5-VL hidden size
_GLYPH_DIM = 32  # tiny ByT5 d_model
_IMAGE_DIM = 16  # tiny SigLIP hidden size
_SIZE = 32  # pixels; also the transformer's target_size, from which I2V derives the output size

# A chat template in Qwen2.5's format (the tiny Qwen2 tokenizer ships none).
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_SYSTEM = "Describe the video."


def tiny_transformer(seed: int = 0, *, task_type: str = "t2v"):
    """A 3-block ``HunyuanVideo15Transformer3DModel`` (patch 1: one token per latent pixel, as the real model)."""
    from diffusers import HunyuanVideo15Transformer3DModel

    from fastdit.testing.components.encoders import build

    return build(
        HunyuanVideo15Transformer3DModel,
        seed=seed,
        in_channels=2 * _LATENT + 1,  # noise + condition latents + condition mask
        out_channels=_LATENT,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=3,
        num_refiner_layers=1,
        mlp_ratio=2.0,
        patch_size=1,
        patch_size_t=1,
        text_embed_dim=_TEXT_DIM,
        text_embed_2_dim=_GLYPH_DIM,
        image_embed_dim=_IMAGE_DIM,
        rope_axes_dim=(4, 6, 6),
        target_size=_SIZE,
        task_type=task_type,
    )


def tiny_vae(seed: int = 0):
    """An ``AutoencoderKLHunyuanVideo15`` with 8 channels per level (spatial factor 16, temporal factor 4)."""
    from diffusers import AutoencoderKLHunyuanVideo15

    from fastdit.testing.components.encoders import build

    return build(
        AutoencoderKLHunyuanVideo15,
        seed=seed,
        latent_channels=_LATENT,
        block_out_channels=(8, 8, 8, 8, 8),
        layers_per_block=1,
        spatial_compression_ratio=16,
        temporal_compression_ratio=4,
        downsample_match_channel=False,
        upsample_match_channel=False,
    )


def _text_encoder(seed: int):
    # The pipelines take the text half of Qwen2.5-VL; the chat template is set on a copy of the shared tokenizer.
    from fastdit.testing.components.encoders import qwen2_5_vl_model

    model, tokenizer = qwen2_5_vl_model(hidden_size=_TEXT_DIM, seed=seed)
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = _CHAT_TEMPLATE
    return model.model.language_model, tokenizer


def _components(seed: int, task_type: str) -> dict:
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.guiders import ClassifierFreeGuidance

    from fastdit.testing.components.byt5 import byt5_encoder

    text_encoder, tokenizer = _text_encoder(seed)
    text_encoder_2, tokenizer_2 = byt5_encoder(d_model=_GLYPH_DIM, seed=seed + 1)
    return {
        "transformer": tiny_transformer(seed, task_type=task_type),
        "vae": tiny_vae(seed),
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "text_encoder_2": text_encoder_2,
        "tokenizer_2": tokenizer_2,
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=7.0),
        "guider": ClassifierFreeGuidance(guidance_scale=6.0),
    }


def _shrink(pipe):
    """Shorten the token budgets the pipelines fix in ``__init__`` (1,108 text, 256 glyph, 729 image tokens)."""
    from fastdit.testing.components.siglip import NUM_IMAGE_TOKENS

    tokenizer = pipe.tokenizer
    chat = [[{"role": "system", "content": _SYSTEM}, {"role": "user", "content": "\x00"}]]
    prefix = tokenizer.apply_chat_template(chat, tokenize=False)[0].split("\x00")[0]
    pipe.system_message = _SYSTEM
    # Tokens before the user prompt: the pipeline crops them from the text encoder's output.
    pipe.prompt_template_encode_start_idx = len(tokenizer(prefix).input_ids)
    pipe.tokenizer_max_length = 16
    pipe.tokenizer_2_max_length = 8
    pipe.vision_num_semantic_tokens = NUM_IMAGE_TOKENS
    return pipe


def tiny_hunyuan_video15(seed: int = 0):
    """A complete tiny ``HunyuanVideo15Pipeline`` (text to video, CFG through a ``ClassifierFreeGuidance`` guider).

    The short token budgets are instance attributes: a ``save_pretrained`` round trip restores the real ones.
    """
    from diffusers import HunyuanVideo15Pipeline

    return _shrink(HunyuanVideo15Pipeline(**_components(seed, "t2v")))


def tiny_hunyuan_video15_i2v(seed: int = 0):
    """A complete tiny ``HunyuanVideo15ImageToVideoPipeline`` (SigLIP image tokens + first-frame latents)."""
    from diffusers import HunyuanVideo15ImageToVideoPipeline

    from fastdit.testing.components.siglip import siglip_vision_model

    image_encoder, feature_extractor = siglip_vision_model(hidden_size=_IMAGE_DIM, seed=seed)
    return _shrink(
        HunyuanVideo15ImageToVideoPipeline(
            image_encoder=image_encoder, feature_extractor=feature_extractor, **_components(seed, "i2v")
        )
    )


def key_padding_from_square(mask: torch.Tensor) -> torch.Tensor:
    """The key-padding mask ``(B, 1, 1, S)`` behind the block processor's square ``(B, 1, S, S)`` mask.

    ``HunyuanVideo15AttnProcessor2_0`` (diffusers 0.42.1) left-pads the encoder padding vector with ``True`` for the
    latent tokens to ``m`` over its ``S`` tokens and builds ``m_i & m_j``; ``m`` is the square's diagonal. Under
    context parallelism ``S`` is the rank's local ``[latent, encoder]`` shard, and only a key-padding mask over local
    keys can be gathered into the global order. Dropping the query factor changes only the rows of padded encoder
    tokens (they attend to the valid keys instead of to nothing), and no valid token ever reads a padded one: every
    block masks them as keys, and the output comes from the latent tokens alone.

    Args:
        mask: The processor's mask (a mask that is not square passes unchanged).

    Returns:
        The equivalent key-padding mask.
    """
    if mask.ndim == 4 and mask.shape[-1] == mask.shape[-2]:
        return mask.diagonal(dim1=-2, dim2=-1).unsqueeze(-2)
    return mask


# Context parallelism: forward builds both streams (patch embedding; the token refiner, then valid encoder tokens
# packed first), so the latent and encoder tokens are split at the first block and flow through every block as
# shards. `rope`'s (cos, sin) tables (S_latent, D) are computed from the whole latent grid before the split and split
# on dim 0 like the latent tokens. Each block receives the encoder padding vector, from which the processor builds a
# square mask over its own tokens: the vector is split like the encoder tokens at every block, and the square is
# reduced to its key-padding diagonal (key_padding_from_square), which attention gathers in the ranks' order. The
# token refiner in context_embedder (AttnProcessor2_0, direct SDPA) sees only the replicated text: local. Gathered at
# proj_out, before the unpatchify reshape.
CP_PLAN = ContextParallelPlan(
    inputs={
        "transformer_blocks.0": streams(),
        "transformer_blocks.*": {"attention_mask": SplitInput(dim=1, expected_dims=2)},
    },
    outputs={"rope": (SplitOutput(dim=0, expected_dims=2, index=0), SplitOutput(dim=0, expected_dims=2, index=1))},
    gather={"proj_out": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(
        modules=("diffusers.models.transformers.transformer_hunyuan_video15",),
        local=("context_embedder",),
        mask_transform=key_padding_from_square,
    ),
    notes=(
        "Latent and encoder tokens split at transformer_blocks.0, the encoder padding vector at every block (the "
        "processor's square mask reduced to its key-padding diagonal); RoPE tables from `rope` split on dim 0; the "
        "text token refiner in context_embedder runs locally on the replicated text."
    ),
)

# Tensor parallelism: every block is dual-stream. Joint attention (video and text q/k/v column-wise, both outputs
# row-wise) and both FFNs are split; the processor reshapes with unflatten(2, (attn.heads, -1)), so `heads` is divided
# (the mask it builds has no head dim). QK-norms are RMSNorm over head_dim (per head): replicated. AdaLN modulation
# (norm1 / norm1_context, dim -> 6 dim each) is per block and large: split with a gathered output. Replicated: the text
# token refiner in context_embedder, the ByT5 and image projections, time_embed, norm_out, proj_out.
TP_PLAN = TensorParallelPlan(
    layers=under(
        "transformer_blocks.*",
        {
            **joint_attention("attn"),
            **feed_forward("ff"),
            **feed_forward("ff_context"),
            **modulation("norm1.linear", "norm1_context.linear"),
        },
    ),
    divide=("transformer_blocks.*.attn.heads",),
    notes="Joint attention and both FFNs split; per-block AdaLN modulation split with a gathered output; QK-norms per "
    "head, the text token refiner and the ByT5 / image projections replicated.",
)

# The quoted words are glyph text: they reach the ByT5 encoder.
_CALL = {"prompt": 'a cat holding a sign "hi"', "num_frames": 5, "num_inference_steps": 2}

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "transformer_blocks": (
        ("attn.to_q", "attn.to_k", "attn.to_v"),
        ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    ),
}

ADAPTER = register(
    ModelAdapter(
        family="hunyuan_video15",
        fused_projections=FUSED_PROJECTIONS,
        # hidden_states is (batch, channels, frames, height, width). The conditioning latents and their mask are
        # appended as channels (zeros for text-to-video) and stay put from step to step: they dilute the signal.
        latent=LatentLayout(),
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="transformer_blocks", pattern=ForwardPattern.P0),),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        tiny_pipelines=(
            TinyPipeline(
                name="t2v", build=tiny_hunyuan_video15, call_kwargs={**_CALL, "height": _SIZE, "width": _SIZE}
            ),
            # I2V takes its size from the image and the transformer's target_size.
            TinyPipeline(
                name="i2v",
                build=tiny_hunyuan_video15_i2v,
                call_kwargs=LazyKwargs({**_CALL, "image": tiny_image(_SIZE)}),
            ),
        ),
        presets=(
            ModelPreset(
                name="hunyuan-video-1.5",
                pipeline_class="diffusers.HunyuanVideo15Pipeline",
                hub_id="hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v",
                defaults={"num_inference_steps": 50, "height": 480, "width": 848, "num_frames": 121},
            ),
            ModelPreset(
                name="hunyuan-video-1.5-i2v",
                pipeline_class="diffusers.HunyuanVideo15ImageToVideoPipeline",
                hub_id="hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_i2v",
                defaults={"num_inference_steps": 50, "num_frames": 121},
            ),
        ),
        notes=(
            "The encoder stream (image, glyph and text tokens, valid ones packed first) carries a key-padding mask "
            "passed to every block; RoPE comes from the latent shape. CFG runs through a diffusers guider: one "
            "transformer call per branch inside cache_context. T2V feeds all-zero image tokens, masked out. "
            "Under context parallelism the block processor's square (B, 1, S, S) mask over the rank's local "
            "tokens is reduced to its key-padding diagonal: padded encoder tokens then attend instead of yielding "
            "zeros, and no valid token reads them, so outputs are unchanged."
        ),
    )
)
