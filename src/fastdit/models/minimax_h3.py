"""MiniMax-H3 (joint video + audio from one packed sequence): ``MiniMaxH3Transformer3DModel``.

Blocks (diffusers 0.42.1): one list ``transformer_blocks`` of ``MiniMaxH3TransformerBlock``, called positionally as
``block(hidden_states, temb, adaln_indices, rotary_emb)`` and returning ``hidden_states`` (pattern 3). Forward
projects the text (refined by ``token_refiner``, its own small block list), video and audio rows and scatters them into
one packed sequence with sequence-wide indices; every block runs full self-attention over it, modulated per row by
AdaLN parameters selected with ``adaln_indices`` (timestep index x 3 + modality tag). ``timestep`` holds the distinct
noise levels of the packed rows (target rows, clean conditioning rows). There is no cross-attention, no mask, no
expert layer; the checkpoint is guidance-distilled (one forward per step, no CFG).

diffusers 0.42.1 serves this model through ``MiniMaxH3ModularPipeline`` only (a ModularPipeline: Qwen3-VL prompt
encoding, the row-layout builder and two schedulers in blocks), which fastdit drives through
:mod:`fastdit.modular`. The tiny pipeline (:func:`tiny_pipeline`) is that pipeline's text-to-video+audio workflow
(``t2va``; ``fl2va`` with a first keyframe) with every component built from a small config. Its geometry is the
checkpoint's: 5 to 15 seconds at 24 fps (``num_frames = 17 n + 5``, at least 124), 40 audio latents a second in two
stereo blocks of rows, the conditioning read at the text encoder's hidden state 50 (so the tiny Qwen3-VL has 51
layers, 16 wide). The tests of the bare transformer drive the packed layout :func:`example` builds through the
sampler loop :func:`tiny_denoise`.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from fastdit.models._lazy import LazyKwargs, tiny_image
from fastdit.models.base import BlockGroup, ForwardPattern, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, SplitInput, SplitOutput
from fastdit.parallel.tp_plan import Style, TensorParallelPlan
from fastdit.parallel.tp_shapes import attention, feed_forward, modulation, under

TRANSFORMER = "diffusers.models.transformers.transformer_minimax_h3.MiniMaxH3Transformer3DModel"
_MODULE = "diffusers.models.transformers.transformer_minimax_h3"

_VIDEO, _TEXT, _AUDIO = 0, 1, 2  # the modality tags of the packed rows
_VIDEO_CHANNELS = 4
_AUDIO_CHANNELS = 4
_TEXT_DIM = 16


def tiny_transformer(seed: int = 0):
    """A 3-block (+ 1 refiner block) ``MiniMaxH3Transformer3DModel``: 2 heads of 16, wider than the 24-wide stream."""
    from diffusers import MiniMaxH3Transformer3DModel

    from fastdit.testing.components.encoders import build

    return build(
        MiniMaxH3Transformer3DModel,
        seed=seed,
        num_attention_heads=2,
        attention_head_dim=16,
        hidden_size=24,
        num_layers=3,
        num_refiner_layers=1,
        ffn_dim=32,
        in_channels=_VIDEO_CHANNELS,
        audio_in_channels=_AUDIO_CHANNELS,
        patch_size=(1, 2, 2),
        text_dim=_TEXT_DIM,
        freq_dim=16,
        time_embed_hidden_dim=16,
        time_embed_dim=16,
        rope_freq_dim=2,
    )


def tiny_pipeline() -> Any:
    """``MiniMaxH3ModularPipeline`` (its ``t2va`` workflow) with tiny components: a 51-layer Qwen3-VL 16 wide, a video
    VAE compressing 4x in space and time (4 latent channels, a one-layer ViT decoder), a one-stage audio VAE (4 latent
    channels), the 3-block transformer of :func:`tiny_transformer`. ``transformer_ref`` (the ``ref2va`` partition)
    is left out."""
    from diffusers import (
        AutoencoderKLMiniMaxH3,
        AutoencoderKLMiniMaxH3Audio,
        MiniMaxH3ModularPipeline,
        MiniMaxH3Scheduler,
    )
    from transformers import Qwen3VLForConditionalGeneration

    from fastdit.testing.components.encoders import build
    from fastdit.testing.components.qwen3_vl import qwen3_vl_model, qwen3_vl_processor

    text_model, tokenizer = qwen3_vl_model(hidden_size=_TEXT_DIM, num_layers=51)
    vae = build(
        AutoencoderKLMiniMaxH3,
        seed=2,
        latent_channels=_VIDEO_CHANNELS,
        block_out_channels=(8, 8),
        layers_per_block=1,
        spatial_downsample_factors=(2, 2),
        temporal_downsample_factors=(2, 2),
        norm_num_groups=4,
        decoder_num_layers=1,
        decoder_num_attention_heads=2,
        decoder_attention_head_dim=8,
        decoder_num_register_tokens=1,
        decoder_ffn_mult=1,
        latents_mean=(0.0,) * _VIDEO_CHANNELS,
        latents_std=(1.0,) * _VIDEO_CHANNELS,
    )
    audio_vae = build(
        AutoencoderKLMiniMaxH3Audio,
        seed=3,
        encoder_dim=4,
        encoder_rates=(2,),
        latent_dim=8,
        latent_channels=_AUDIO_CHANNELS,
        num_attention_heads=1,
        decoder_dim=8,
        decoder_rates=(2,),
        decoder_kernel_sizes=(4,),
        resblock_kernel_sizes=(3,),
        resblock_dilation_sizes=((1,),),
        sampling_rate=800,
        latents_mean=[0.0] * _AUDIO_CHANNELS,
        latents_std=[1.0] * _AUDIO_CHANNELS,
    )
    pipe = MiniMaxH3ModularPipeline()
    pipe.update_components(
        text_encoder=build(Qwen3VLForConditionalGeneration, text_model.config, seed=1),
        tokenizer=tokenizer,
        processor=qwen3_vl_processor(tokenizer),
        vae=vae,
        audio_vae=audio_vae,
        scheduler=MiniMaxH3Scheduler(shift=12.0),
        audio_scheduler=MiniMaxH3Scheduler(shift=3.0),
        transformer=tiny_transformer(),
    )
    return pipe


def packed_layout(
    text: int = 3, frames: int = 2, rows: int = 2, cols: int = 2, audio: int = 3, cond_frames: int = 1
) -> dict[str, torch.Tensor]:
    """The structural arguments of one packed sequence: ``[text | video frames | audio]`` rows.

    The first ``cond_frames`` video frames are clean conditioning rows (a first keyframe: timestep index 1, value
    0.999, as the pipeline pins them);
    the other video rows and the audio rows are denoised (timestep index 0). Positions: text on the time axis
    before the video, video on its (t, h, w) grid, audio on the time axis of the video frames.
    """
    video = frames * rows * cols
    total = text + video + audio
    t, h, w = torch.meshgrid(torch.arange(frames), torch.arange(rows), torch.arange(cols), indexing="ij")
    video_pos = torch.stack([t.flatten() + text, h.flatten(), w.flatten()], dim=-1)
    text_pos = torch.stack(
        [torch.arange(text), torch.zeros(text, dtype=torch.long), torch.zeros(text, dtype=torch.long)], -1
    )
    audio_pos = torch.stack(
        [torch.arange(audio) + text, torch.zeros(audio, dtype=torch.long), torch.zeros(audio, dtype=torch.long)], -1
    )
    tags = torch.tensor([_TEXT] * text + [_VIDEO] * video + [_AUDIO] * audio)
    timestep_indices = torch.zeros(total, dtype=torch.long)
    timestep_indices[text : text + cond_frames * rows * cols] = 1
    return {
        "timestep_indices": timestep_indices,
        "token_tags": tags,
        "position_ids": torch.cat([text_pos, video_pos, audio_pos]),
        "text_indices": torch.arange(text),
        "video_indices": torch.arange(text, text + video),
        "audio_indices": torch.arange(text + video, total),
    }


def example(seed: int = 0) -> tuple[torch.nn.Module, dict[str, Any]]:
    """A tiny transformer and the keyword arguments of one call (for ``fastdit inspect --example``)."""
    layout = packed_layout()
    generator = torch.Generator().manual_seed(seed + 1)
    inputs = {
        "hidden_states": torch.randn(1, len(layout["video_indices"]), _VIDEO_CHANNELS * 4, generator=generator),
        "audio_hidden_states": torch.randn(1, len(layout["audio_indices"]), _AUDIO_CHANNELS, generator=generator),
        "encoder_hidden_states": torch.randn(1, len(layout["text_indices"]), _TEXT_DIM, generator=generator),
        "timestep": torch.tensor([0.0, 0.999]),
    }
    return tiny_transformer(seed), {**inputs, **layout, "return_dict": False}


def tiny_denoise(transformer: torch.nn.Module, steps: int = 3, seed: int = 0) -> torch.Tensor:
    """An Euler flow sampler over ``steps`` noise levels, as the modular pipeline's loop calls the transformer.

    Returns the final video and audio rows, concatenated on the channel-flattened row dim (for comparisons).
    """
    _, kwargs = example(seed)
    video, audio = kwargs["hidden_states"], kwargs["audio_hidden_states"]
    sigmas = torch.linspace(1.0, 0.0, steps + 1)
    with torch.no_grad():
        for sigma, following in itertools.pairwise(sigmas):
            call = {**kwargs, "hidden_states": video, "audio_hidden_states": audio}
            # As the pipeline passes it: the flow time 1 - sigma of the target rows, rising from 0, and the keyframe
            # rows pinned at 0.999, just short of clean.
            call["timestep"] = torch.stack([1.0 - sigma, torch.tensor(0.999)])
            video_velocity, audio_velocity = transformer(**call)
            video = video + (following - sigma) * video_velocity
            audio = audio + (following - sigma) * audio_velocity
    return torch.cat([video.flatten(1), audio.flatten(1)], dim=1)


# Context parallelism: the rows of the three modalities are scattered into the packed buffer with sequence-wide
# indices, which address the whole sequence, so the split happens at the first block. Everything indexed per row of
# the packed sequence is split with it: the (cos, sin) tables `rope` returns (S, rotary_dim), `adaln_indices` (a loop
# constant passed to every block), and `timestep_indices` at `norm_out`; the output heads gather the rows back,
# because forward then selects the video and audio rows with sequence-wide indices. The text refiner runs on the whole
# text before the split: local attention. The same layout as the model's own `_cp_plan`, in fastdit's vocabulary (and
# uneven shards: the packed length need not divide the degree).
_ROWS = SplitInput(dim=0, expected_dims=1)
CP_PLAN = ContextParallelPlan(
    inputs={
        "transformer_blocks.0": {"hidden_states": SplitInput(dim=1, expected_dims=3)},
        "transformer_blocks.*": {"adaln_indices": _ROWS},
        "norm_out": {"timestep_indices": _ROWS},
    },
    outputs={"rope": (SplitOutput(dim=0, expected_dims=2, index=0), SplitOutput(dim=0, expected_dims=2, index=1))},
    gather={"proj_out": GatherOutput(dim=1, expected_dims=3), "audio_proj_out": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(modules=(_MODULE,), local=("token_refiner",)),
    notes=(
        "packed rows split at transformer_blocks.0 with the RoPE tables, the per-row AdaLN indices and norm_out's "
        "timestep indices; both output heads gathered; the text refiner local."
    ),
)


def _block(prefix: str, *, adaln: bool) -> dict[str, Style]:
    layers = {**attention("attn"), **feed_forward("ff", gated=True)}
    if adaln:
        layers.update(modulation("adaln_proj.linear"))
    return under(prefix, layers)


# Tensor parallelism: attention by heads (to_q/to_k/to_v column-wise, to_out.0 row-wise; the QK-norms are over
# head_dim, per head, whole; heads divided, since the processor unflattens with them), the SwiGLU FFN's fused
# [hidden | gate] projection split per half; the per-block AdaLN projection (3 modalities x 6 parameters) split with a
# gathered output. Refiner blocks alike, without AdaLN. Projections in and out, the time MLP and norm_out whole.
TP_PLAN = TensorParallelPlan(
    layers={**_block("transformer_blocks.*", adaln=True), **_block("token_refiner.refiner_blocks.*", adaln=False)},
    divide=("transformer_blocks.*.attn.heads", "token_refiner.refiner_blocks.*.attn.heads"),
    notes="Attention by heads, SwiGLU FFN split per half, per-block AdaLN projection split with a gathered output; the "
    "refiner alike; input/output projections and norm_out whole. No expert layers.",
)

# 124 = 17 * 7 + 5 frames: the shortest clip the checkpoint's 5-second floor allows.
_T2VA = {"prompt": "a cat", "height": 8, "width": 8, "num_frames": 124, "num_inference_steps": 3}

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "transformer_blocks": (("attn.to_q", "attn.to_k", "attn.to_v"),),
}

ADAPTER = register(
    ModelAdapter(
        family="minimax_h3",
        fused_projections=FUSED_PROJECTIONS,
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="transformer_blocks", pattern=ForwardPattern.P3),),
        # `timestep` holds the sorted distinct noise levels of the rows: the generated video rows rise from 0 (the
        # smallest: the audio rows' shift is smaller), the keyframe rows stay pinned at 0.999, near clean on this
        # rising schedule, and the largest entry would read the same value every step.
        timestep_reduce="min",
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        cfg_parallel=False,
        tiny_pipelines=(
            TinyPipeline(
                name="t2va",
                build=tiny_pipeline,
                call_kwargs=_T2VA,
            ),
            # The same pipeline from a first keyframe (fl2va): the keyframe's latents become clean conditioning rows
            # and the text encoder reads it as a vision block.
            TinyPipeline(name="fl2va", build=tiny_pipeline, call_kwargs=LazyKwargs({**_T2VA, "image": tiny_image(32)})),
        ),
        presets=(
            ModelPreset(
                name="minimax-h3",
                pipeline_class="diffusers.MiniMaxH3ModularPipeline",
                hub_id="MiniMaxAI/MiniMax-H3",
            ),
        ),
        notes=(
            "One packed sequence [text | keyframe and target video | audio] through one block list; the text "
            "refiner (`token_refiner`) runs on the text alone before it and always computes. `timestep` holds the "
            "distinct noise levels of the rows; the cache reads the smallest (the video rows' level; keyframe rows "
            "stay pinned near clean). Served by a ModularPipeline (MiniMaxH3ModularPipeline, driven through "
            "fastdit.modular); the tiny pipelines are its t2va workflow and its fl2va workflow from a first keyframe "
            "(`num_inference_steps` counts sigma grid points: 3 give two transformer calls). Its ref2va workflow "
            "(references, the `transformer_ref` partition) has no tiny pipeline. "
            "No CFG parallelism: the checkpoint is guidance-distilled (one forward per step)."
            " No spectral signal: the latent arrives packed into a token sequence (batch, tokens, channels): no grid "
            "to filter."
        ),
    )
)
