"""LTX-2 (joint audio + video: T2V, I2V): ``LTX2VideoTransformer3DModel``.

Blocks (diffusers 0.42.1): one list ``transformer_blocks`` of ``LTX2VideoTransformerBlock``; the model calls each by
keyword (``hidden_states=..., audio_hidden_states=..., encoder_hidden_states=..., audio_encoder_hidden_states=...``,
timestep embeddings, rotary embeddings, masks, STG perturbation) and the block returns ``(hidden_states,
audio_hidden_states)``: the video and audio streams both change in every block (self-attention, text
cross-attention, audio<->video cross-attention) while the text streams pass through. In the adapter the audio stream
takes the encoder slot: pattern 0 with ``encoder_arg="audio_hidden_states"``.
"""

from __future__ import annotations

from fastdit.models._lazy import LazyKwargs, tiny_image
from fastdit.models.base import BlockGroup, ForwardPattern, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, SplitInput, SplitOutput
from fastdit.parallel.tp_plan import Colwise, LocalSlice, ShardedNorm, Style, TensorParallelPlan
from fastdit.parallel.tp_shapes import attention, feed_forward, under

TRANSFORMER = "diffusers.models.transformers.transformer_ltx2.LTX2VideoTransformer3DModel"

_LATENT = 4
_AUDIO_LATENT = 2
_TEXT_DIM = 32  # tiny Gemma 3 hidden size
_TEXT_LAYERS = 2
_CONNECTOR_DIM = 32  # 4 heads x 8 of the tiny text connectors: the transformer's cross-attention width


def tiny_transformer(seed: int = 0):
    """A 3-block ``LTX2VideoTransformer3DModel`` (patch 1, video 2x16 and audio 2x8 attention)."""
    from diffusers import LTX2VideoTransformer3DModel

    from fastdit.testing.components.encoders import build

    return build(
        LTX2VideoTransformer3DModel,
        seed=seed,
        in_channels=_LATENT,
        out_channels=_LATENT,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=2,
        attention_head_dim=16,
        cross_attention_dim=32,
        # (time, height, width) pixel strides of the tiny VAE: RoPE positions are in pixel units.
        vae_scale_factors=(8, 8, 8),
        audio_in_channels=_AUDIO_LATENT * 2,  # latent channels x mel bins after the audio VAE's compression
        audio_out_channels=_AUDIO_LATENT * 2,
        audio_num_attention_heads=2,
        audio_attention_head_dim=8,
        audio_cross_attention_dim=16,
        num_layers=3,
        caption_channels=_CONNECTOR_DIM,
        rope_double_precision=False,
        rope_type="split",
    )


def tiny_connectors(seed: int = 0):
    """``LTX2TextConnectors``: project all Gemma layers and refine them for the video and audio streams."""
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    from fastdit.testing.components.encoders import build

    return build(
        LTX2TextConnectors,
        seed=seed,
        caption_channels=_TEXT_DIM,
        text_proj_in_factor=_TEXT_LAYERS + 1,  # every hidden state, embeddings included
        video_connector_num_attention_heads=4,
        video_connector_attention_head_dim=8,
        video_connector_num_layers=1,
        video_connector_num_learnable_registers=None,
        audio_connector_num_attention_heads=4,
        audio_connector_attention_head_dim=8,
        audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None,
        connector_rope_base_seq_len=32,
        rope_double_precision=False,
        rope_type="split",
    )


def tiny_audio_vae(seed: int = 0):
    """An ``AutoencoderKLLTX2Audio`` over 8 mel bins (16 kHz, hop 160)."""
    from diffusers import AutoencoderKLLTX2Audio

    from fastdit.testing.components.encoders import build

    return build(
        AutoencoderKLLTX2Audio,
        seed=seed,
        base_channels=4,
        output_channels=2,
        ch_mult=(1,),
        num_res_blocks=1,
        attn_resolutions=None,
        in_channels=2,
        resolution=32,
        latent_channels=_AUDIO_LATENT,
        mid_block_add_attention=False,
        sample_rate=16000,
        mel_hop_length=160,
        mel_bins=8,
    )


def tiny_vocoder(seed: int = 0):
    """An ``LTX2Vocoder`` turning the audio VAE's stereo mel spectrogram into a waveform."""
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    from fastdit.testing.components.encoders import build

    return build(
        LTX2Vocoder,
        seed=seed,
        in_channels=2 * 8,  # output channels x mel bins of the audio VAE
        hidden_channels=32,
        out_channels=2,
        upsample_kernel_sizes=[4, 4],
        upsample_factors=[2, 2],
        resnet_kernel_sizes=[3],
        resnet_dilations=[[1, 3, 5]],
        output_sampling_rate=16000,
    )


def _components(seed: int) -> dict:
    from diffusers import FlowMatchEulerDiscreteScheduler

    from fastdit.testing.components.autoencoder_kl_ltx import autoencoder_kl_ltx2_video
    from fastdit.testing.components.gemma3 import gemma3_model

    text_encoder, tokenizer = gemma3_model(hidden_size=_TEXT_DIM, num_layers=_TEXT_LAYERS, seed=seed)
    return {
        "transformer": tiny_transformer(seed),
        "vae": autoencoder_kl_ltx2_video(latent_channels=_LATENT, seed=seed),
        "audio_vae": tiny_audio_vae(seed),
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "connectors": tiny_connectors(seed),
        "vocoder": tiny_vocoder(seed),
        "scheduler": FlowMatchEulerDiscreteScheduler(),
    }


def tiny_ltx2(seed: int = 0):
    """A complete tiny ``LTX2Pipeline`` (text to video with audio)."""
    from diffusers import LTX2Pipeline

    return LTX2Pipeline(**_components(seed))


def tiny_ltx2_i2v(seed: int = 0):
    """A complete tiny ``LTX2ImageToVideoPipeline`` (the first latent frame is the encoded image)."""
    from diffusers import LTX2ImageToVideoPipeline

    return LTX2ImageToVideoPipeline(**_components(seed))


# The rotary tables of the LTX-2 RoPE modules are (B, S, D) with rope_type "interleaved" and (B, H, S, D / H) with
# "split": the sequence dim depends on the type, and each spec only applies to tensors of its rank.
_ROPE_SPLIT = tuple(
    SplitOutput(dim=dim, expected_dims=ndim, index=index) for index in (0, 1) for dim, ndim in ((1, 3), (2, 4))
)

# Context parallelism: forward is "project in, blocks, project out" for both streams, so the root inputs are split:
# the video and the audio tokens each over all ranks (dim 1). Every attention is routed through context-parallel
# attention (the processors carry the parallel config), and each one's keys and values are one split stream: video
# and audio self-attention, video->text and audio->text cross-attention, and the audio<->video cross-attentions.
# So the two text streams and their padding masks are split as well (the processors build a key mask over the local
# text, which attention all-gathers). The four RoPE modules compute tables for the whole video / audio sequence
# (from the coordinates the pipeline passes, or from num_frames/height/width): all are split like their stream. The
# video timestep may be per token (B, S_video) in I2V, as may the audio timestep; per-sample ones are 1-D and pass
# whole, as do sigma and the perturbation mask. Both output projections are gathered.
CP_PLAN = ContextParallelPlan(
    inputs={
        "": {
            "hidden_states": SplitInput(dim=1, expected_dims=3),
            "audio_hidden_states": SplitInput(dim=1, expected_dims=3),
            "encoder_hidden_states": SplitInput(dim=1, expected_dims=3),
            "audio_encoder_hidden_states": SplitInput(dim=1, expected_dims=3),
            "encoder_attention_mask": SplitInput(dim=1, expected_dims=2),
            "audio_encoder_attention_mask": SplitInput(dim=1, expected_dims=2),
            "timestep": SplitInput(dim=1, expected_dims=2),
            "audio_timestep": SplitInput(dim=1, expected_dims=2),
            "video_keyframes_mask": SplitInput(dim=1, expected_dims=3),
        }
    },
    outputs={
        "rope": _ROPE_SPLIT,
        "audio_rope": _ROPE_SPLIT,
        "cross_attn_rope": _ROPE_SPLIT,
        "cross_attn_audio_rope": _ROPE_SPLIT,
    },
    gather={
        "proj_out": GatherOutput(dim=1, expected_dims=3),
        "audio_proj_out": GatherOutput(dim=1, expected_dims=3),
    },
    attention=AttentionRouting(modules=("diffusers.models.transformers.transformer_ltx2",)),
    notes=(
        "Root split of video, audio, both texts and text masks, per-token timesteps; the four RoPE modules' tables "
        "split like their stream; video_self_attention_mask (a global (B, S, S) mask) is not supported."
    ),
)

# Tensor parallelism. Both processors (LTX2AudioVideoAttnProcessor, and LTX2PerturbedAttnProcessor with STG)
# apply the QK-norms and RoPE to the flattened q/k before unflattening q/k/v with ``attn.heads`` (divided; the
# masks are repeated by it too, and the STG path passes the local value through). The QK-norms are RMSNorms over the
# whole inner dim ("rms_norm_across_heads"): ShardedNorms. The optional per-head output gate (to_gate_logits,
# LTX-2.3: query_dim -> heads) is split like the heads. Every attention of a block splits by heads: video and audio
# self-attention, their text cross-attentions, and audio->video / video->audio (which use the audio head count).
# The four RoPE modules (video, audio, and the two cross-modal ones) compute "split" tables (B, heads, S, d / 2)
# for all heads, which apply_split_rotary_emb regroups the local q/k features by: each rank keeps its heads (dim 1).
# The cross-modal tables group the audio width by the video head count, so their slices are still the contiguous
# features of the rank's audio heads. Both GELU FFNs split (up column-wise, down row-wise). Modulation is shared
# root AdaLN-single projections plus small per-block tables: replicated, like the embedders, caption projections
# and output layers. rope_type="interleaved" tables are (B, S, inner_dim) in head-major feature order: the slice
# picks the dim by the table's layout (dim -1 for 3-dim tables, the head dim 1 for 4-dim ones).
_ATTENTIONS = ("attn1", "audio_attn1", "attn2", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn")
_ROPES = ("rope", "audio_rope", "cross_attn_rope", "cross_attn_audio_rope")


def _ltx2_block() -> dict[str, Style]:
    layers: dict[str, Style] = {}
    for attn in _ATTENTIONS:
        layers.update(attention(attn))
        layers.update({f"{attn}.norm_q": ShardedNorm(), f"{attn}.norm_k": ShardedNorm()})
        layers[f"{attn}.to_gate_logits"] = Colwise()
    return {**layers, **feed_forward("ff"), **feed_forward("audio_ff")}


TP_PLAN = TensorParallelPlan(
    layers={**{rope: LocalSlice(dim={3: -1, 4: 1}) for rope in _ROPES}, **under("transformer_blocks.*", _ltx2_block())},
    divide=tuple(f"transformer_blocks.*.{attn}.heads" for attn in _ATTENTIONS),
    optional=tuple(f"transformer_blocks.*.{attn}.to_gate_logits" for attn in _ATTENTIONS),
    notes="Every video/audio/cross-modal attention split by heads (QK-norms across heads sharded, per-head gates "
    "split, split-RoPE tables sliced by head), both GELU FFNs split; shared AdaLN and per-block tables replicated; "
    "split and interleaved RoPE tables sliced by their layout.",
)

_CALL = {
    "prompt": "a cat holding a sign",
    "negative_prompt": "blue",
    "height": 32,
    "width": 32,
    "num_frames": 9,
    "frame_rate": 25.0,
    "num_inference_steps": 2,
    "guidance_scale": 3.0,
    # Spatio-temporal guidance on the middle block, as the real models use it on one deep block.
    "stg_scale": 1.0,
    "spatio_temporal_guidance_blocks": [1],
    "max_sequence_length": 16,
}

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "transformer_blocks": (
        ("attn1.to_q", "attn1.to_k", "attn1.to_v"),
        ("audio_attn1.to_q", "audio_attn1.to_k", "audio_attn1.to_v"),
        ("attn2.to_k", "attn2.to_v"),
        ("audio_attn2.to_k", "audio_attn2.to_v"),
        ("audio_to_video_attn.to_k", "audio_to_video_attn.to_v"),
        ("video_to_audio_attn.to_k", "video_to_audio_attn.to_v"),
    ),
}

ADAPTER = register(
    ModelAdapter(
        family="ltx2",
        fused_projections=FUSED_PROJECTIONS,
        transformer_classes=(TRANSFORMER,),
        block_groups=(
            BlockGroup(path="transformer_blocks", pattern=ForwardPattern.P0, encoder_arg="audio_hidden_states"),
        ),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        tiny_pipelines=(
            TinyPipeline(name="t2v", build=tiny_ltx2, call_kwargs=_CALL),
            # Per-token timesteps with conditioning tokens at 0: the cache follows the largest entry.
            # (image_crf=0: the default H.264 re-compression of the condition image needs PyAV.)
            TinyPipeline(
                name="i2v",
                build=tiny_ltx2_i2v,
                call_kwargs=LazyKwargs({**_CALL, "image": tiny_image(), "image_crf": 0}),
            ),
        ),
        presets=(
            ModelPreset(
                name="ltx2",
                pipeline_class="diffusers.LTX2Pipeline",
                hub_id="Lightricks/LTX-2",
                defaults={
                    "num_inference_steps": 40,
                    "guidance_scale": 4.0,
                    "height": 512,
                    "width": 768,
                    "num_frames": 121,
                    "frame_rate": 24.0,
                },
            ),
            ModelPreset(
                name="ltx2-i2v",
                pipeline_class="diffusers.LTX2ImageToVideoPipeline",
                hub_id="Lightricks/LTX-2",
                defaults={
                    "num_inference_steps": 40,
                    "guidance_scale": 4.0,
                    "height": 512,
                    "width": 768,
                    "num_frames": 121,
                    "frame_rate": 24.0,
                },
            ),
        ),
        notes=(
            "Two token streams (video, audio) with their own RoPE, timesteps and text; the adapter caches both "
            "(audio in the encoder slot). Each step runs up to three calls, each in its own cache_context: "
            "cond_uncond (batched CFG), uncond_stg (attention skipped in the STG blocks) and uncond_modality "
            "(audio-video cross-attention off). I2V passes a per-token timestep whose first-frame tokens are 0: "
            "read the step from the largest value. The default I2V image re-compression needs PyAV (`av`)."
            " No spectral signal: the latent arrives packed into a token sequence (batch, tokens, channels): no grid "
            "to filter."
        ),
    )
)
