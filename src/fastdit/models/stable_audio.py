"""Stable Audio Open: ``StableAudioDiTModel`` (text-to-audio, ``StableAudioPipeline``).

Blocks (diffusers 0.42.1): one list, ``transformer_blocks``, of ``StableAudioDiTBlock``s (self-attention with partial
RoPE, cross-attention to the T5 prompt and the duration tokens with grouped key/value heads, a SwiGLU feed-forward).
Each is called by keyword with ``hidden_states``, ``attention_mask``, ``encoder_hidden_states``,
``encoder_attention_mask`` and ``rotary_embedding``, and returns the hidden states alone: the prompt is only read,
pattern 2. The sequence the blocks see is ``[global token, audio latent frames...]``: forward projects the latents,
prepends the duration-and-timestep token, and the pipeline passes a RoPE table over that whole sequence.
"""

from __future__ import annotations

from fastdit.models.base import BlockGroup, ForwardPattern, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, SplitInput
from fastdit.parallel.tp_plan import TensorParallelPlan
from fastdit.parallel.tp_shapes import attention, feed_forward, under

TRANSFORMER = "diffusers.models.transformers.stable_audio_transformer.StableAudioDiTModel"

_TEXT_DIM = 32
_COND_DIM = 16  # the projection model's width: cross-attention input, and half the global (start|end) input


def tiny_transformer(seed: int = 0):
    """A 3-block ``StableAudioDiTModel``: 4 query heads of 8 over 2 key/value heads (GQA, as the real model's 24/12),
    16 latent frames of 4 channels."""
    from diffusers import StableAudioDiTModel

    from fastdit.testing.components.encoders import build

    return build(
        StableAudioDiTModel,
        seed=seed,
        sample_size=16,
        in_channels=4,
        num_layers=3,
        attention_head_dim=8,
        num_attention_heads=4,
        num_key_value_attention_heads=2,
        out_channels=4,
        cross_attention_dim=16,
        time_proj_dim=16,
        global_states_input_dim=2 * _COND_DIM,
        cross_attention_input_dim=_COND_DIM,
    )


def tiny_stable_audio(seed: int = 0):
    """A complete tiny ``StableAudioPipeline``: 16 latent frames decode to 128 stereo samples (8 s at 16 Hz)."""
    from diffusers import EDMDPMSolverMultistepScheduler, StableAudioPipeline
    from diffusers.pipelines.stable_audio.modeling_stable_audio import StableAudioProjectionModel

    from fastdit.testing.components.audio import autoencoder_oobleck
    from fastdit.testing.components.encoders import build, t5_encoder

    text_encoder, tokenizer = t5_encoder(d_model=_TEXT_DIM, seed=seed + 1)
    projection = build(
        StableAudioProjectionModel,
        seed=seed + 2,
        text_encoder_dim=_TEXT_DIM,
        conditioning_dim=_COND_DIM,
        min_value=0,
        max_value=512,
    )
    scheduler = EDMDPMSolverMultistepScheduler(
        solver_order=2, prediction_type="v_prediction", sigma_data=1.0, sigma_schedule="exponential"
    )
    return StableAudioPipeline(
        vae=autoencoder_oobleck(latent_channels=4, seed=seed + 3),
        text_encoder=text_encoder,
        projection_model=projection,
        tokenizer=tokenizer,
        transformer=tiny_transformer(seed),
        scheduler=scheduler,
    )


# The sequence [global token, audio frames] exists only inside forward, so it is split at the first block; the RoPE
# table (a (cos, sin) pair over that whole sequence, built by the pipeline) is split alike at every block, and so is
# the optional self-attention padding mask (B, 1 + frames): the processor then builds a key-padding mask over the
# local keys, which context-parallel attention gathers (a whole mask would be padded to the local length). The
# cross-attention (attn2) reads the replicated prompt and stays local; StableAudioAttnProcessor2_0 calls
# F.scaled_dot_product_attention itself (after repeating the grouped key/value heads), so its module's F is routed.
# The output is gathered after proj_out, before forward drops the global token.
_TOKENS = SplitInput(dim=1, expected_dims=3)
CP_PLAN = ContextParallelPlan(
    inputs={
        "transformer_blocks.0": {"hidden_states": _TOKENS},
        "transformer_blocks.*": {
            "rotary_embedding": SplitInput(dim=0, expected_dims=2),
            "attention_mask": SplitInput(dim=1, expected_dims=2),
        },
    },
    gather={"proj_out": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(
        sdpa_modules=("diffusers.models.attention_processor",), local=("transformer_blocks.*.attn2",)
    ),
    notes="[global token, audio frames] split at transformer_blocks.0, the RoPE pair and the padding mask at every "
    "block; cross-attention to the prompt is local; gathered after proj_out.",
)

# Tensor parallelism: self- and cross-attention by heads (the processor reshapes with attn.heads, divided, and derives
# the key/value heads from the local key width, so grouped heads split alike: rank r's query heads use rank r's
# key/value heads); the SwiGLU feed-forward's [hidden | gate] projection split per half, its down projection row-wise.
# The timestep, global and cross-attention projections, proj_in/proj_out and the 1x1 convolutions are replicated.
TP_PLAN = TensorParallelPlan(
    layers=under(
        "transformer_blocks.*", {**attention("attn1"), **attention("attn2"), **feed_forward("ff", gated=True)}
    ),
    divide=("transformer_blocks.*.attn1.heads", "transformer_blocks.*.attn2.heads"),
    notes="Self- and cross-attention by heads (grouped key/value heads split alike), SwiGLU FFN per half; the "
    "conditioning projections and the 1x1 convolutions replicated.",
)

_CALL = {
    "prompt": "a hammer hitting a wooden surface",
    "negative_prompt": "low quality",
    "audio_end_in_s": 8.0,
    "num_inference_steps": 2,
    "guidance_scale": 7.0,
}

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "transformer_blocks": (
        ("attn1.to_q", "attn1.to_k", "attn1.to_v"),
        ("attn2.to_k", "attn2.to_v"),
    ),
}

ADAPTER = register(
    ModelAdapter(
        family="stable_audio",
        fused_projections=FUSED_PROJECTIONS,
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="transformer_blocks", pattern=ForwardPattern.P2),),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        tiny_pipelines=(TinyPipeline(name="t2a", build=tiny_stable_audio, call_kwargs=_CALL),),
        presets=(
            ModelPreset(
                name="stable-audio-open",
                pipeline_class="diffusers.StableAudioPipeline",
                hub_id="stabilityai/stable-audio-open-1.0",
                defaults={"num_inference_steps": 100, "guidance_scale": 7.0, "audio_end_in_s": 10.0},
            ),
        ),
        notes=(
            "Audio: outputs are (channels, samples) waveforms, compared by waveform PSNR / SNR and log-spectrogram "
            "SSIM. The blocks see [global token, latent frames]; the global token carries the timestep and the "
            "duration, the RoPE pair comes from the pipeline. CFG is batched. The self-attention `attention_mask` "
            "(a padding mask over the latent frames, which the pipeline never passes) is split with the tokens."
            " No spectral signal: the latent is a sequence of audio frames; the filter's power-law prior is one of "
            "images and videos and has not been checked on audio latents."
        ),
    )
)
