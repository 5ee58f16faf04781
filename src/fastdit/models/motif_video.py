"""Motif-Video (T2V, I2V): ``MotifVideoTransformer3DModel``.

Blocks (diffusers 0.42.1): two lists, run in order. ``transformer_blocks`` (dual-stream ``MotifVideoTransformerBlock``)
and ``single_transformer_blocks`` (``MotifVideoSingleTransformerBlock``, which concatenates the streams for its
parallel attention + MLP and splits them again), both called positionally as ``block(hidden_states,
encoder_hidden_states, temb, attention_mask, image_rotary_emb, image_embed_seq_len)`` and both returning
``(hidden_states, encoder_hidden_states)`` (pattern 0). Joint attention runs over ``[video, text]`` with RoPE on the
video tokens only and a key-padding mask over the joint sequence (``(B, 1, 1, S_video + S_text)``, built in forward).
Image-to-video feeds SigLIP embeddings of the first frame (``image_embeds``), projected and prepended to the text
stream, plus the first frame's latents as extra input channels.

Optional parts of the architecture: per-block text cross-attention (``enable_text_cross_attention_*``) and "decoder"
single blocks (``num_decoder_layers``) that run at the end on a copy of the patch-embedded input, with the main stream
as their encoder stream; see the notes for what each supports.
"""

from __future__ import annotations

from fastdit.models._lazy import LazyKwargs, tiny_image
from fastdit.models.base import BlockGroup, ForwardPattern, LatentLayout, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, SplitInput, SplitOutput
from fastdit.parallel.tp_plan import Colwise, Rowwise, TensorParallelPlan
from fastdit.parallel.tp_shapes import feed_forward, joint_attention, modulation, under

TRANSFORMER = "diffusers.models.transformers.transformer_motif_video.MotifVideoTransformer3DModel"
_MODULE = "diffusers.models.transformers.transformer_motif_video"

_LATENT = 4
_TEXT_DIM = 32  # tiny T5Gemma 2 encoder width
_IMAGE_DIM = 16  # its SigLIP vision tower's width
_MAX_TEXT = 16


def tiny_transformer(seed: int = 0, *, image_embed_dim: int | None = None):
    """A ``MotifVideoTransformer3DModel`` of 2 heads x 16: one dual-stream and two single-stream blocks, all with the
    text cross-attention."""
    from diffusers import MotifVideoTransformer3DModel

    from fastdit.testing.components.encoders import build

    return build(
        MotifVideoTransformer3DModel,
        seed=seed,
        in_channels=2 * _LATENT + 1,  # noise + first-frame condition latents + condition mask
        out_channels=_LATENT,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=1,
        num_single_layers=2,
        mlp_ratio=2.0,
        patch_size=2,
        patch_size_t=1,
        text_embed_dim=_TEXT_DIM,
        image_embed_dim=image_embed_dim,
        rope_axes_dim=(4, 6, 6),
        # The optional text cross-attention on, so the cache, the splits and the plans meet it.
        enable_text_cross_attention_dual=True,
        enable_text_cross_attention_single=True,
    )


def _text_encoder(seed: int):
    """A two-layer ``T5Gemma2Encoder`` (with its one-layer SigLIP vision tower) and the tiny Gemma tokenizer."""
    import copy

    from transformers import SiglipVisionConfig, T5Gemma2Encoder, T5Gemma2EncoderConfig, T5Gemma2TextConfig

    from fastdit.testing.components.decoder_lm import decoder_lm_kwargs
    from fastdit.testing.components.encoders import build
    from fastdit.testing.components.gemma2 import gemma_tokenizer

    tokenizer = copy.deepcopy(gemma_tokenizer())
    # The full T5Gemma2Config would set dropout_rate on its text config; the encoder alone reads it from there.
    text = T5Gemma2TextConfig(**decoder_lm_kwargs(tokenizer, _TEXT_DIM, 2, sliding_window=64), dropout_rate=0.0)
    vision = SiglipVisionConfig(
        hidden_size=_IMAGE_DIM,
        intermediate_size=2 * _IMAGE_DIM,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
    )
    # Image special-token ids stay outside the tiny vocabulary, so text never matches them.
    config = T5Gemma2EncoderConfig(text_config=text, vision_config=vision, mm_tokens_per_image=16)
    return build(T5Gemma2Encoder, config, seed=seed), tokenizer


def _components(seed: int, *, image: bool) -> dict:
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.guiders import ClassifierFreeGuidance
    from transformers import SiglipImageProcessorPil

    from fastdit.testing.components.autoencoder_kl_wan import autoencoder_kl_wan

    text_encoder, tokenizer = _text_encoder(seed + 1)
    tokenizer.model_max_length = _MAX_TEXT
    return {
        "transformer": tiny_transformer(seed, image_embed_dim=_IMAGE_DIM if image else None),
        "vae": autoencoder_kl_wan(latent_channels=_LATENT, seed=seed),
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=5.0),
        "guider": ClassifierFreeGuidance(guidance_scale=5.0),
        "feature_extractor": SiglipImageProcessorPil(size={"height": 32, "width": 32}) if image else None,
    }


def tiny_motif_video(seed: int = 0):
    """A complete tiny ``MotifVideoPipeline`` (text to video, CFG through a ``ClassifierFreeGuidance`` guider)."""
    from diffusers import MotifVideoPipeline

    return MotifVideoPipeline(**_components(seed, image=False))


def tiny_motif_video_i2v(seed: int = 0):
    """A complete tiny ``MotifVideoImage2VideoPipeline`` (first frame through the VAE and the SigLIP tower)."""
    from diffusers import MotifVideoImage2VideoPipeline

    return MotifVideoImage2VideoPipeline(**_components(seed, image=True))


# Context parallelism. The sequences are split where forward builds them, at the root: the patch embedder's video
# tokens, the text projector's tokens, the image embeddings (I2V) and the text mask, all on their token dim, and
# `rope`'s (cos, sin) tables like the video tokens. Forward then builds every rank's text stream as [image_r, text_r]
# and its key mask as [video_r, text_r] (all True, then the rank's text mask): a key-padding mask over exactly the
# rank's joint keys, which context-parallel attention all-gathers into the exchanged keys' order. Attention is the only
# place tokens meet and the text carries no positions, so a text stream whose global order interleaves the ranks' image
# embeddings and text is exact. The counts forward derives from the local shapes (the video length in the mask,
# image_embed_seq_len for the text cross-attention's slice of its keys and mask) are then the rank's own, which is what
# the blocks index their local tensors with. The decoder blocks' stream is a copy of the split patch embeddings, so it
# is split too. The video tokens are gathered after `proj_out`, before the unpatchify.
_TOKENS = SplitOutput(dim=1, expected_dims=3)
CP_PLAN = ContextParallelPlan(
    inputs={
        "": {
            "image_embeds": SplitInput(dim=1, expected_dims=3),
            "encoder_attention_mask": SplitInput(dim=1, expected_dims=2),
        }
    },
    outputs={
        "x_embedder": _TOKENS,
        "context_embedder": _TOKENS,
        "rope": (SplitOutput(dim=0, expected_dims=2, index=0), SplitOutput(dim=0, expected_dims=2, index=1)),
    },
    gather={"proj_out": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(modules=(_MODULE,)),
    notes=(
        "split at the root where forward builds the sequences (patch and text embedders, image embeddings, text "
        "mask), RoPE like the video tokens; the rank's local key mask is gathered in attention."
    ),
)

# Tensor parallelism, Megatron-style: joint attention by heads (QK-norms are per head), both streams' FFNs, the
# single blocks' q/k/v and MLP column-wise with `proj_out` over cat([attention, MLP]) row-wise per part, and the
# per-block AdaLN linears split with a gathered output. The optional text cross-attention: in a dual block it reads
# the block's (whole) attention output and splits by heads; in a single block it reads the attention output *before*
# any output projection (pre_only attention), i.e. the rank's heads' features, and its result is added to them. There
# its query projection is row-wise (the rank's features in, the whole query out after the sum), its key and value
# projections and its attention stay whole, and its output projection is column-wise (the rank's features out, to
# add to its own) — the cross-attention of a single block is computed whole on every rank.
_DUAL_CROSS = {
    "cross_attn.to_q": Colwise(),
    "cross_attn.to_k": Colwise(),
    "cross_attn.to_v": Colwise(),
    "cross_attn.to_out.0": Rowwise(),
}
_SINGLE_CROSS = {"cross_attn.to_q": Rowwise(), "cross_attn.to_out.0": Colwise()}
_DUAL = {
    **joint_attention("attn"),
    **feed_forward("ff"),
    **feed_forward("ff_context"),
    **modulation("norm1.linear", "norm1_context.linear"),
}
_SINGLE = {
    "attn.to_q": Colwise(),
    "attn.to_k": Colwise(),
    "attn.to_v": Colwise(),
    "proj_mlp": Colwise(),
    "proj_out": Rowwise(segments=("attn.inner_dim", "proj_mlp.out_features")),
    **modulation("norm.linear"),
}
TP_PLAN = TensorParallelPlan(
    layers={
        **under("transformer_blocks.*", {**_DUAL, **_DUAL_CROSS}),
        **under("single_transformer_blocks.*", {**_SINGLE, **_SINGLE_CROSS}),
    },
    divide=(
        "transformer_blocks.*.attn.heads",
        "single_transformer_blocks.*.attn.heads",
        "transformer_blocks.*.cross_attn.heads",
    ),
    optional=(
        *(f"transformer_blocks.*.{p}" for p in _DUAL_CROSS),
        *(f"single_transformer_blocks.*.{p}" for p in _SINGLE_CROSS),
        "transformer_blocks.*.cross_attn",
    ),
    notes=(
        "joint attention by heads, FFNs and the single blocks' MLP Megatron-split, AdaLN split with a gathered output; "
        "a single block's text cross-attention (on its head-split attention output) only has its projections split."
    ),
)

_CALL = {
    "prompt": "a cat walking",
    "negative_prompt": "blue",
    "num_inference_steps": 2,
    "height": 32,
    "width": 32,
    "num_frames": 5,
    "max_sequence_length": _MAX_TEXT,
}

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "transformer_blocks": (
        ("attn.to_q", "attn.to_k", "attn.to_v"),
        ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
        ("cross_attn.to_k", "cross_attn.to_v"),
    ),
    "single_transformer_blocks": (
        ("attn.to_q", "attn.to_k", "attn.to_v"),
        ("cross_attn.to_k", "cross_attn.to_v"),
    ),
}

ADAPTER = register(
    ModelAdapter(
        family="motif_video",
        fused_projections=FUSED_PROJECTIONS,
        # hidden_states is (batch, channels, frames, height, width). Its image-to-video models append their conditioning
        # channels (the first frame's latents, with a mask for some), which stay put from step to step: the filter over
        # all channels still follows the noisy ones, diluted.
        latent=LatentLayout(),
        transformer_classes=(TRANSFORMER,),
        block_groups=(
            BlockGroup(path="transformer_blocks", pattern=ForwardPattern.P0),
            BlockGroup(path="single_transformer_blocks", pattern=ForwardPattern.P0),
        ),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        tiny_pipelines=(
            TinyPipeline(name="t2v", build=tiny_motif_video, call_kwargs=_CALL),
            TinyPipeline(
                name="i2v", build=tiny_motif_video_i2v, call_kwargs=LazyKwargs({**_CALL, "image": tiny_image()})
            ),
        ),
        presets=(
            ModelPreset(
                name="motif-video",
                pipeline_class="diffusers.MotifVideoPipeline",
                hub_id="Motif-Technologies/Motif-Video-2B",
                defaults={"num_inference_steps": 50, "height": 736, "width": 1280, "num_frames": 121},
            ),
            ModelPreset(
                name="motif-video-i2v",
                pipeline_class="diffusers.MotifVideoImage2VideoPipeline",
                hub_id="Motif-Technologies/Motif-Video-2B",
                defaults={"num_inference_steps": 50, "height": 736, "width": 1280, "num_frames": 121},
            ),
        ),
        notes=(
            "Dual-stream then single-stream blocks over [video, text] with a joint key-padding mask; I2V prepends the "
            "first frame's SigLIP embeddings to the text stream and adds its latents as input channels. CFG runs "
            "through the pipeline's guider (cond / uncond cache contexts). The optional text cross-attention is "
            "covered by every plan (the tiny model has it). Decoder blocks (num_decoder_layers > 0: the last single "
            "blocks run on a copy of the patch embeddings, the main stream becoming their encoder stream) are exact "
            "under context and tensor parallelism; a cache segment spanning the swap replays its cached residual "
            "onto the main stream it entered with, as for any segment (its stale text output is dropped by forward)."
        ),
    )
)
