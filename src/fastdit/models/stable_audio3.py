"""Stable Audio 3: ``StableAudio3DiTModel`` (text-to-audio, audio-to-audio and inpainting pipelines).

Blocks (diffusers 0.42.1): one list, ``transformer_blocks``, of ``StableAudio3DiTBlock``s (AdaLN-modulated
differential self-attention with RMS QK-norms and partial RoPE, differential cross-attention to the text and duration
tokens, an AdaLN-modulated SwiGLU feed-forward). Each is called with the tokens ``x`` positionally (its parameter is
``hidden_states``) and ``context``, ``global_modulation``, ``rope``, ``context_mask``, ``local_seq`` and
``num_memory_tokens`` by keyword, and returns the tokens alone: pattern 2 with ``encoder_arg="context"`` (the context
is only read). Forward prepends ``num_memory_tokens`` learnt tokens to the audio frames, so the blocks see
``[memory, frames]``; the inpainting pipeline's ``local_add_cond`` becomes ``local_seq``, one row per *frame*, which a
block adds after the memory tokens (``x[:, num_memory_tokens:] + to_local_embed(local_seq)``).
"""

from __future__ import annotations

from fastdit.models._lazy import LazyKwargs, tiny_waveform
from fastdit.models.base import BlockGroup, ForwardPattern, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, LeadingCount, SplitInput
from fastdit.parallel.tp_plan import Colwise, Rowwise, TensorParallelPlan
from fastdit.parallel.tp_shapes import under

TRANSFORMER = "diffusers.models.transformers.transformer_stable_audio3.StableAudio3DiTModel"
_MODULE = "diffusers.models.transformers.transformer_stable_audio3"

_TEXT_DIM = 32  # the text encoder's width = the duration token's = the DiT's cond_token_dim and global_cond_dim
_LATENT_DIM = 4


def tiny_transformer(seed: int = 0):
    """A 3-block ``StableAudio3DiTModel`` of width 32 (4 heads of 8) over 4-channel latents with 4 memory tokens.

    The model zero-initialises its 1x1 pre/post convolutions and the last layer of each block's local (inpainting)
    embedding, so a random model would ignore them; they get random weights here, so that the tests see a
    misplaced inpainting row.
    """
    import torch
    from diffusers import StableAudio3DiTModel

    from fastdit.testing.components.encoders import build

    model = build(
        StableAudio3DiTModel,
        seed=seed,
        io_channels=_LATENT_DIM,
        embed_dim=32,
        depth=3,
        num_heads=4,
        cond_token_dim=_TEXT_DIM,
        global_cond_dim=_TEXT_DIM,
        local_add_cond_dim=1 + _LATENT_DIM,
        timestep_features_dim=16,
        ff_mult=2.0,
        num_memory_tokens=4,
    )
    generator = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        zeroed = [model.preprocess_conv.weight, model.postprocess_conv.weight]
        for block in model.transformer_blocks:
            zeroed += [block.to_local_embed[-1].weight, block.to_local_embed[-1].bias]
        for param in zeroed:
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return model


def _components(seed: int) -> dict:
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.stable_audio_3.modeling_stable_audio_3 import StableAudio3DurationEmbedder

    from fastdit.testing.components.audio import autoencoder_same, t5gemma_encoder
    from fastdit.testing.components.encoders import build

    text_encoder, tokenizer = t5gemma_encoder(hidden_size=_TEXT_DIM, seed=seed + 1)
    return {
        "vae": autoencoder_same(latent_dim=_LATENT_DIM, seed=seed + 2),
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "duration_embedder": build(StableAudio3DurationEmbedder, seed=seed + 3, output_dim=_TEXT_DIM, fourier_dim=16),
        "transformer": tiny_transformer(seed),
        "scheduler": FlowMatchEulerDiscreteScheduler(),
    }


def tiny_stable_audio3(seed: int = 0):
    """A complete tiny ``StableAudio3Pipeline``: 8 s at 16 Hz, 128 stereo samples from 16 latent frames."""
    from diffusers import StableAudio3Pipeline

    return StableAudio3Pipeline(**_components(seed))


def tiny_stable_audio3_audio2audio(seed: int = 0):
    """A complete tiny ``StableAudio3AudioToAudioPipeline``."""
    from diffusers import StableAudio3AudioToAudioPipeline

    return StableAudio3AudioToAudioPipeline(**_components(seed))


def tiny_stable_audio3_inpaint(seed: int = 0):
    """A complete tiny ``StableAudio3InpaintPipeline``."""
    from diffusers import StableAudio3InpaintPipeline

    return StableAudio3InpaintPipeline(**_components(seed))


# Context parallelism: [memory, frames] exists only inside forward, so the tokens are split at the first block. The
# RoPE table (seq, rot_dim) is built over the whole sequence and passed to every block: split alike (the processor
# applies the last `seq` rows of what it gets, so a rank's table must be its own rows). The memory-token count is
# narrowed to the memory tokens a rank holds (LeadingCount), and the inpainting rows, which line up with the frames
# after the memory tokens, are cut to the frames inside a rank's shard (tail_of): a block's
# `x[:, m:] + local` then adds each frame's own row. The output is gathered after the last block, before forward
# drops the memory tokens. Cross-attention (to the replicated context) is local.
CP_PLAN = ContextParallelPlan(
    inputs={
        "transformer_blocks.0": {"hidden_states": SplitInput(dim=1, expected_dims=3)},
        "transformer_blocks.*": {
            "rope": SplitInput(dim=0, expected_dims=2),
            "num_memory_tokens": LeadingCount(of="hidden_states"),
            "local_seq": SplitInput(dim=1, expected_dims=3, tail_of="hidden_states"),
        },
    },
    gather={"transformer_blocks.-1": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(modules=(_MODULE,), local=("transformer_blocks.*.cross_attn",)),
    notes="[memory, frames] split at transformer_blocks.0, RoPE rows at every block, the memory count narrowed "
    "(LeadingCount), the inpainting rows cut to the rank's frames (SplitInput.tail_of); gathered after the last "
    "block; cross-attention local.",
)

# Tensor parallelism: the differential attention's fused projections split per part ([q1|q2|k1|k2|v] of the
# self-attention, [q1|q2] and [k1|k2|v] of the cross-attention), so a rank's chunk(5) / chunk(2) / chunk(3) find its
# own heads; the output projections row-wise; the SwiGLU [hidden | gate] per half, down row-wise. QK-norms are per
# head (replicated). The AdaLN table (to_scale_shift_gate, added to the shared global modulation) and the
# conditioning MLPs act on the whole width: replicated.
TP_PLAN = TensorParallelPlan(
    layers=under(
        "transformer_blocks.*",
        {
            "self_attn.to_qkv": Colwise(segments=(1, 1, 1, 1, 1)),
            "self_attn.to_out": Rowwise(),
            "cross_attn.to_q": Colwise(segments=(1, 1)),
            "cross_attn.to_kv": Colwise(segments=(1, 1, 1)),
            "cross_attn.to_out": Rowwise(),
            "ff.proj_in": Colwise(segments=(1, 1)),
            "ff.proj_out": Rowwise(),
        },
    ),
    divide=("transformer_blocks.*.self_attn.heads", "transformer_blocks.*.cross_attn.heads"),
    notes="Differential self/cross-attention by heads (fused parts split each), SwiGLU FFN per half; AdaLN and the "
    "conditioning MLPs replicated. Written for differential attention (the model's default).",
)

# The tiny SAME decoder's output hardly depends on its latents (random weights): comparisons read the latents.
_CALL = {"prompt": "a calm piano melody", "duration": 8.0, "num_inference_steps": 2, "output_type": "latent"}

ADAPTER = register(
    ModelAdapter(
        family="stable_audio3",
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="transformer_blocks", pattern=ForwardPattern.P2, encoder_arg="context"),),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        tiny_pipelines=(
            TinyPipeline(
                name="t2a",
                build=tiny_stable_audio3,
                call_kwargs={**_CALL, "negative_prompt": "noise", "guidance_scale": 4.0},
            ),
            TinyPipeline(
                name="audio2audio",
                build=tiny_stable_audio3_audio2audio,
                # The schedule's first two timesteps rise for most init_noise_level < 1 (see the notes); with
                # logsnr_min=-2 it falls at 0.6, so the run is one run of 2 (or 3) steps for the cache.
                call_kwargs=LazyKwargs(
                    {**_CALL, "audio": tiny_waveform(), "init_noise_level": 0.6, "logsnr_min": -2.0}
                ),
            ),
            TinyPipeline(
                name="inpaint",
                build=tiny_stable_audio3_inpaint,
                call_kwargs=LazyKwargs(
                    {**_CALL, "audio": tiny_waveform(), "mask_start_seconds": 2.0, "mask_end_seconds": 5.0}
                ),
            ),
        ),
        presets=(
            ModelPreset(
                name="stable-audio-3",
                pipeline_class="diffusers.StableAudio3Pipeline",
                hub_id="stabilityai/stable-audio-3-medium",
                defaults={"duration": 10.0},
            ),
        ),
        notes=(
            "Audio: outputs are (channels, samples) waveforms, compared by waveform PSNR / SNR and log-spectrogram "
            "SSIM. The blocks see [memory tokens, latent frames]; inpainting adds a per-frame local conditioning "
            "after the memory tokens in every block. CFG is batched (text-to-audio only: the audio-to-audio and "
            "inpainting pipelines take no guidance scale). The TP plan assumes differential attention "
            "(`use_differential_attention=True`, the released configuration). Audio-to-audio with "
            "`init_noise_level` < 1: the pipeline's schedule forces its first sigma to the noise level, so for most "
            "levels the second timestep is higher than the first (kept for parity with the reference code); step "
            "caching reads a timestep moving back as a new run, so it starts over at the third call."
            " No spectral signal: the latent is a sequence of audio frames; the filter's power-law prior is one of "
            "images and videos and has not been checked on audio latents."
        ),
    )
)
