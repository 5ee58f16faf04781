"""Kandinsky 6 (text/image to video and audio): ``Kandinsky6Transformer3DModel``.

Blocks (diffusers 0.42.1): two text lists, ``video_text_transformer_blocks`` and ``audio_text_transformer_blocks``
(``Kandinsky6TransformerEncoderBlock``, ``block(x, time_embed, rope, attn_mask)`` returning ``x``), refine the text
once per branch; then ``visual_transformer_blocks`` (``Kandinsky6FusedTransformerDecoderBlock``) denoise video and
audio together: ``block(vis, aud, text_v, text_a, (video_temb, audio_temb), vis_rope, aud_rope, attn_mask)`` returns
``(vis, aud)`` (pattern 0, hidden ``vis``, encoder ``aud``). Each fused block runs video and audio self-attention, their
cross-attention to their text branch, and the video-from-audio / audio-from-video cross-attention. Without
``audio_hidden_states`` (``sample_audio=False``) ``aud`` is ``None`` and the blocks run the video path only.

The adapter declares only the fused list: the text blocks see no latent (their output depends on the prompt and the
timestep alone), so a cache must not take its decision from them; they compute on every call.
"""

from __future__ import annotations

import copy

from fastdit.models._lazy import LazyKwargs, tiny_image
from fastdit.models.base import BlockGroup, ForwardPattern, LatentLayout, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, SplitInput
from fastdit.parallel.tp_plan import Style, TensorParallelPlan
from fastdit.parallel.tp_shapes import attention, feed_forward, modulation, under

TRANSFORMER = "diffusers.models.transformers.transformer_kandinsky6.Kandinsky6Transformer3DModel"
_MODULE = "diffusers.models.transformers.transformer_kandinsky6"

_LATENT = 4  # the tiny HunyuanVideo VAE's channels
_AUDIO_LATENT = 4  # the tiny MMAudio VAE's latent channels
_TEXT_DIM = 32  # tiny Qwen2.5-VL hidden size
_POOLED_DIM = 32  # tiny CLIP hidden size
_SIZE = 32
# The tiny audio front end: 1600 Hz, 32-sample hops (a latent frame is 64 samples): 5 video frames at 24 fps make
# ceil(5 / 24 * 1600 / 64) = 6 audio tokens.
_SAMPLE_RATE = 1600
_HOP = 32


def tiny_transformer(seed: int = 0):
    """A 1 + 1 text block, 3 fused block ``Kandinsky6Transformer3DModel`` with the released checkpoints' options."""
    from diffusers import Kandinsky6Transformer3DModel

    from fastdit.testing.components.encoders import build

    return build(
        Kandinsky6Transformer3DModel,
        seed=seed,
        in_visual_dim=_LATENT,
        out_visual_dim=_LATENT,
        in_text_dim=_TEXT_DIM,
        in_text_dim2=_POOLED_DIM,
        time_dim=16,
        patch_size=(1, 2, 2),
        model_dim=32,
        ff_dim=64,
        num_text_blocks=1,
        num_visual_blocks=3,
        axes_dims=(4, 6, 6),
        visual_cond=True,
        in_audio_dim=_AUDIO_LATENT,
        out_audio_dim=_AUDIO_LATENT,
        text_token_padding=True,
        ca_rope=True,
        cross_gates=True,
        fix_modulation=True,
        # Image to video appends the reference frame, marked by token type 1.
        visual_token_type_num_embeddings=2,
    )


def _audio(seed: int) -> dict:
    """A tiny ``MMAudioVAE`` and ``MMAudioVocoder`` (8 mel bins; the vocoder upsamples by the VAE's hop, 4 x 8)."""
    from diffusers import MMAudioVAE, MMAudioVocoder

    from fastdit.testing.components.encoders import build

    vae = build(
        MMAudioVAE,
        seed=seed,
        mel_bins=8,
        latent_channels=_AUDIO_LATENT,
        hidden_channels=8,
        channel_multipliers=(1, 2),
        layers_per_block=1,
        sample_rate=_SAMPLE_RATE,
        n_fft=64,
        hop_length=_HOP,
    )
    vocoder = build(
        MMAudioVocoder,
        seed=seed,
        num_mels=8,
        upsample_initial_channel=8,
        upsample_rates=(4, 8),
        upsample_kernel_sizes=(8, 16),
        resblock_kernel_sizes=(3,),
        resblock_dilation_sizes=((1,),),
    )
    return {"audio_vae": vae, "vocoder": vocoder}


def tiny_kandinsky6(seed: int = 0, *, audio: bool = True):
    """A complete tiny ``Kandinsky6TI2VAPipeline`` (Qwen2.5-VL + CLIP text, HunyuanVideo VAE, MMAudio VAE + vocoder)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Kandinsky6TI2VAPipeline

    from fastdit.testing.components.autoencoder_kl_hunyuan_video import autoencoder_kl_hunyuan_video
    from fastdit.testing.components.encoders import clip_text_model, qwen2_5_vl_model
    from fastdit.testing.components.qwen2_5_vl import qwen2_vl_processor

    text_encoder, tokenizer = qwen2_5_vl_model(hidden_size=_TEXT_DIM, seed=seed)
    text_encoder_2, tokenizer_2 = clip_text_model(hidden_size=_POOLED_DIM, seed=seed + 1)
    return Kandinsky6TI2VAPipeline(
        transformer=tiny_transformer(seed),
        vae=autoencoder_kl_hunyuan_video(latent_channels=_LATENT, seed=seed),
        text_encoder=text_encoder,
        # The pipeline tokenizes through a Qwen2-VL processor (text only here).
        tokenizer=qwen2_vl_processor(copy.deepcopy(tokenizer)),
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        **(_audio(seed) if audio else {}),
    )


def tiny_kandinsky6_video(seed: int = 0):
    """The tiny pipeline without its audio VAE and vocoder (video only, ``sample_audio=False``)."""
    return tiny_kandinsky6(seed, audio=False)


_CALL = {
    "prompt": "a cat holding a sign",
    "negative_prompt": "blue",
    "height": _SIZE,
    "width": _SIZE,
    "num_frames": 5,
    "num_inference_steps": 2,
    "guidance_scale": 5.0,
    "max_sequence_length": 16,
}
_VIDEO_ONLY = {**_CALL, "sample_audio": False}

# Context parallelism: the video tokens are flattened from the patch grid and the audio tokens embedded inside forward,
# so both streams are split at the first fused block; forward passes the same RoPE tables, (S, 1, D/2, 2, 2) with the
# tokens on dim 0, to every block, so each block splits them like its streams. The last fused block's output, both
# streams, is gathered before forward reshapes the video tokens to the (T, H, W) grid. The text is replicated: its
# encoder blocks run on the whole text before the split, and the cross-attention of each stream to its text attends
# from local tokens to the whole text (local attention, with the text padding mask). Video and audio self-attention
# and the two cross-modal attentions (video queries to audio keys and back, both split) are context-parallel: Ulysses
# and ring attention take query and key sequences of different lengths.
_TOKENS = SplitInput(dim=1, expected_dims=3)
_ROPE = SplitInput(dim=0, expected_dims=5)
CP_PLAN = ContextParallelPlan(
    inputs={
        "visual_transformer_blocks.0": {"vis": _TOKENS, "aud": _TOKENS},
        "visual_transformer_blocks.*": {"vis_rope": _ROPE, "aud_rope": _ROPE},
    },
    gather={"visual_transformer_blocks.-1": GatherOutput(dim=1, expected_dims=3, index=(0, 1))},
    attention=AttentionRouting(
        modules=(_MODULE,),
        local=(
            "video_text_transformer_blocks",
            "audio_text_transformer_blocks",
            "visual_transformer_blocks.*.video_dec_block.cross_attention",
            "visual_transformer_blocks.*.audio_dec_block.cross_attention",
        ),
    ),
    notes=(
        "video and audio tokens split at the first fused block, their RoPE tables at every fused block; both "
        "gathered at the last; text replicated (its blocks and the cross-attention to it local); the cross-modal "
        "attention context-parallel on both split streams."
    ),
)


def _attention(path: str) -> dict[str, Style]:
    return attention(path, qkv=("to_query", "to_key", "to_value"), out="out_layer")


def _decoder(prefix: str) -> dict[str, Style]:
    """One modality's half of a fused block: self- and text cross-attention, FFN, its AdaLN modulation."""
    return {
        **_attention(f"{prefix}.self_attention"),
        **_attention(f"{prefix}.cross_attention"),
        **feed_forward(f"{prefix}.feed_forward"),
        **modulation(f"{prefix}.visual_modulation.out_layer"),
    }


_TEXT = ("video_text_transformer_blocks", "audio_text_transformer_blocks")
_FUSED_ATTENTION = (
    "video_dec_block.self_attention",
    "video_dec_block.cross_attention",
    "audio_dec_block.self_attention",
    "audio_dec_block.cross_attention",
    "va_cross_attention",
    "av_cross_attention",
)

# Tensor parallelism: every attention (text blocks; per fused block video and audio self- and text cross-attention
# and the two cross-modal ones) by heads: to_query/to_key/to_value column-wise, out_layer row-wise, num_heads divided
# (the processor reshapes with it). The QK-norms are RMSNorms over head_dim and the RoPE tables broadcast over the
# heads: per head, whole. FFNs (GELU, not gated) split; every AdaLN modulation split with a gathered output (its
# vector is chunked on the feature dim). Embeddings and both output layers (one global modulation each) stay whole.
TP_PLAN = TensorParallelPlan(
    layers={
        **{
            path: style
            for blocks in _TEXT
            for path, style in under(
                f"{blocks}.*",
                {**_attention("attn"), **feed_forward("feed_forward"), **modulation("text_modulation.out_layer")},
            ).items()
        },
        **under(
            "visual_transformer_blocks.*",
            {
                **_decoder("video_dec_block"),
                **_decoder("audio_dec_block"),
                **_attention("va_cross_attention"),
                **_attention("av_cross_attention"),
                **modulation("va_modulation.out_layer", "av_modulation.out_layer"),
            },
        ),
    },
    divide=(
        *(f"{blocks}.*.attn.num_heads" for blocks in _TEXT),
        *(f"visual_transformer_blocks.*.{attn}.num_heads" for attn in _FUSED_ATTENTION),
    ),
    notes="Every attention by heads (QK-norms and RoPE per head whole), FFNs split, per-block AdaLN modulations split "
    "with a gathered output; embeddings and the video and audio output layers whole.",
)

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "visual_transformer_blocks": (
        (
            "video_dec_block.self_attention.to_query",
            "video_dec_block.self_attention.to_key",
            "video_dec_block.self_attention.to_value",
        ),
        ("video_dec_block.cross_attention.to_key", "video_dec_block.cross_attention.to_value"),
        # The audio stream's groups: called whole in the audio variants, not at all without audio.
        (
            "audio_dec_block.self_attention.to_query",
            "audio_dec_block.self_attention.to_key",
            "audio_dec_block.self_attention.to_value",
        ),
        ("audio_dec_block.cross_attention.to_key", "audio_dec_block.cross_attention.to_value"),
    ),
}

ADAPTER = register(
    ModelAdapter(
        family="kandinsky6",
        fused_projections=FUSED_PROJECTIONS,
        # hidden_states is (batch, frames, height, width, channels) with the conditioning latents and mask appended
        # (they stay put: they dilute the signal); the audio latent arrives apart and is not read.
        latent=LatentLayout(channel_dim=-1),
        transformer_classes=(TRANSFORMER,),
        block_groups=(
            BlockGroup(
                path="visual_transformer_blocks", pattern=ForwardPattern.P0, hidden_arg="vis", encoder_arg="aud"
            ),
        ),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        tiny_pipelines=(
            TinyPipeline(name="t2va", build=tiny_kandinsky6, call_kwargs=_CALL),
            TinyPipeline(
                name="i2va", build=tiny_kandinsky6, call_kwargs=LazyKwargs({**_CALL, "image": tiny_image(_SIZE)})
            ),
            TinyPipeline(name="t2v", build=tiny_kandinsky6_video, call_kwargs=_VIDEO_ONLY),
        ),
        presets=(
            ModelPreset(
                name="kandinsky6-pro-distill",
                pipeline_class="diffusers.Kandinsky6TI2VAPipeline",
                hub_id="kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers",
                # The distilled checkpoint samples without CFG.
                defaults={
                    "num_inference_steps": 16,
                    "guidance_scale": 1.0,
                    "height": 480,
                    "width": 864,
                    "num_frames": 121,
                },
            ),
        ),
        notes=(
            "Only visual_transformer_blocks (the fused video/audio blocks, pattern 0 with the audio tokens as the "
            "second stream) are declared: the two text lists (pattern 3, hidden_arg 'x') run first on the text "
            "alone and always compute. Without audio (`sample_audio=False`) the second stream is None and the "
            "blocks run their video path only. Image to video appends the reference frame's latents as an extra "
            "frame (token type 1, temporal RoPE position 0)."
        ),
    )
)
