"""SANA-Video: ``SanaVideoTransformer3DModel``.

Blocks (diffusers 0.42.1): one list, ``transformer_blocks`` (``SanaVideoTransformerBlock``: linear self-attention with
3-D RoPE, softmax cross-attention to the Gemma 2 prompt, a Mix-FFN with a temporal convolution). Each is called
positionally with ``(hidden_states, attention_mask, encoder_hidden_states, encoder_attention_mask, timestep, frames,
height, width, rotary_emb)`` and returns the hidden states alone (pattern 2). Between blocks the forward only adds
ControlNet residuals (when given).
"""

from __future__ import annotations

from fastdit.models.base import BlockGroup, ForwardPattern, LatentLayout, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import (
    ContextParallelPlan,
    GatherOutput,
    Halo,
    LocalExtent,
    SplitInput,
    TokenSum,
)
from fastdit.parallel.plan_shapes import linear_self_attention
from fastdit.parallel.tp_plan import Colwise, Rowwise, ShardedNorm, TensorParallelPlan
from fastdit.parallel.tp_shapes import attention, under

TRANSFORMER = "diffusers.models.transformers.transformer_sana_video.SanaVideoTransformer3DModel"

_LATENT_CHANNELS = 4
_TEXT_DIM = 32


def tiny_transformer(seed: int = 0, *, num_layers: int = 3):
    """A 3-block ``SanaVideoTransformer3DModel`` (2 heads x 16, Gemma 2 width 32, patch 1x2x2)."""
    from diffusers import SanaVideoTransformer3DModel

    from fastdit.testing.components.encoders import build

    return build(
        SanaVideoTransformer3DModel,
        seed=seed,
        in_channels=_LATENT_CHANNELS,
        out_channels=_LATENT_CHANNELS,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=num_layers,
        num_cross_attention_heads=2,
        cross_attention_head_dim=16,
        cross_attention_dim=32,
        caption_channels=_TEXT_DIM,
        sample_size=8,
        patch_size=(1, 2, 2),
        rope_max_seq_len=64,
    )


def tiny_sana_video(seed: int = 0):
    """A complete tiny ``SanaVideoPipeline`` (Gemma 2 text encoder, Wan VAE, flow DPM-Solver++)."""
    from diffusers import DPMSolverMultistepScheduler, SanaVideoPipeline

    from fastdit.testing.components.autoencoder_kl_wan import autoencoder_kl_wan
    from fastdit.testing.components.gemma2 import gemma2_model

    text_encoder, tokenizer = gemma2_model(hidden_size=_TEXT_DIM, seed=seed + 1)
    scheduler = DPMSolverMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=8.0)
    return SanaVideoPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=autoencoder_kl_wan(latent_channels=_LATENT_CHANNELS, seed=seed),
        transformer=tiny_transformer(seed),
        scheduler=scheduler,
    )


def _token_sums() -> tuple[TokenSum, ...]:
    import torch

    # SanaLinearAttnProcessor3_0 (diffusers 0.42.1) sums over the tokens twice: ``key.sum(dim=-1)`` for the
    # normaliser (then ``@ query``, a Tensor.matmul over channels) and ``torch.matmul(value, key_rotate.T)``; the
    # second torch.matmul meets the local queries.
    return (TokenSum(torch.Tensor.sum, 0), TokenSum(torch.matmul, 0))


# Tokens are frame-major (frames, height, width): a split in whole frames keeps each rank's Mix-FFN reshape exact.
_FRAMES = ("height", "width")

CP_PLAN = ContextParallelPlan(
    inputs={
        "transformer_blocks.0": {"hidden_states": SplitInput(dim=1, expected_dims=3, unit=_FRAMES)},
        "transformer_blocks.*": {
            "frames": LocalExtent(of="hidden_states"),
            # (cos, sin), each (1, F·H·W, 1, head_dim), built by `rope` from the global grid.
            "rotary_emb": SplitInput(dim=1, expected_dims=4, unit=_FRAMES),
            # (B, 1, 6·D) for one timestep per sample; (B, F·H·W, 6·D) for per-token timesteps (I2V).
            "timestep": SplitInput(dim=1, expected_dims=3, unit=_FRAMES, keep_singleton=True),
        },
    },
    # Before norm_out, whose modulation is per token with per-token timesteps and built full-length by forward.
    gather={"transformer_blocks.-1": GatherOutput(dim=1, expected_dims=3)},
    # The temporal (3, 1) convolution reads one frame before and after: a one-frame halo on (B, C, F, H·W). The
    # spatial 3x3 convolution runs per frame, which a rank holds whole.
    halo={"transformer_blocks.*.ff.conv_temp": Halo(dim=2, size=1)},
    attention=linear_self_attention(_token_sums()),
    notes=(
        "Split at transformer_blocks.0 in whole latent frames (each block's `frames` becomes the rank's frames); "
        "RoPE tables (from the global grid) and per-token timesteps split at every block; linear self-attention "
        "all-reduces its key sum and value-key product (TokenSum); the temporal convolution gets a one-frame halo; "
        "cross-attention local; gathered after the last block."
    ),
)

# Tensor parallelism: both attentions split by heads. SanaLinearAttnProcessor3_0 unflattens q/k/v into (attn.heads, -1)
# and every reduction of the linear attention (the key sum of the normaliser, the value-key product) is per head, so a
# rank's heads are exact on their own; SanaAttnProcessor2_0 (cross-attention) views with attn.heads too. Both divide
# heads. The QK RMSNorms are across heads (over the whole inner dim) and become sharded norms. The Mix-FFN
# (GLUMBTempConv) splits like Sana's: the 1x1 `conv_inverted` and the depthwise 3x3 `conv_depth` output
# [hidden | gate] before `chunk(2, dim=1)` (two segments; the depthwise groups follow the channels), the 1x1
# `conv_point` back to the width is row-wise. Its temporal (3, 1) `conv_temp` stays whole: it runs on the all-reduced
# width (the forward views its input with the block's full channel count and adds it as a residual), so splitting it
# would cost a second collective per block. The global adaln_single, the per-block scale_shift_table and the
# embedders stay replicated.
_NORMS = {f"{attn}.norm_{qk}": ShardedNorm() for attn in ("attn1", "attn2") for qk in ("q", "k")}
_FFN = {
    "ff.conv_inverted": Colwise(segments=(1, 1)),
    "ff.conv_depth": Colwise(segments=(1, 1)),
    "ff.conv_point": Rowwise(),
}
TP_PLAN = TensorParallelPlan(
    layers=under("transformer_blocks.*", {**attention("attn1"), **attention("attn2"), **_NORMS, **_FFN}),
    divide=("transformer_blocks.*.attn1.heads", "transformer_blocks.*.attn2.heads"),
    notes="Linear self-attention (per-head sums) and cross-attention split by heads, QK RMSNorms across heads "
    "sharded; Mix-FFN convolutions by channel ([hidden | gate] segments), its temporal conv_temp and the "
    "AdaLN-single tables replicated.",
)

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "transformer_blocks": (
        ("attn1.to_q", "attn1.to_k", "attn1.to_v"),
        ("attn2.to_k", "attn2.to_v"),
    ),
}

ADAPTER = register(
    ModelAdapter(
        family="sana_video",
        fused_projections=FUSED_PROJECTIONS,
        # hidden_states is (batch, channels, frames, height, width).
        latent=LatentLayout(),
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="transformer_blocks", pattern=ForwardPattern.P2),),
        tiny_pipelines=(
            TinyPipeline(
                name="t2v",
                build=tiny_sana_video,
                # guidance_scale > 1 batches cond and uncond in one transformer call per step.
                call_kwargs={
                    "prompt": "a cat holding a sign",
                    "negative_prompt": "blue",
                    "guidance_scale": 6.0,
                    "height": 32,
                    "width": 32,
                    # 3 latent frames: a whole frame per rank on 3 ranks, 2 + 1 on 2.
                    "frames": 9,
                    "num_inference_steps": 2,
                    "max_sequence_length": 16,
                    # Binning snaps the size to the aspect-ratio table of the real model (480p).
                    "use_resolution_binning": False,
                },
            ),
        ),
        presets=(
            ModelPreset(
                name="sana-video",
                pipeline_class="diffusers.SanaVideoPipeline",
                hub_id="Efficient-Large-Model/SANA-Video_2B_480p_diffusers",
                defaults={"num_inference_steps": 50, "guidance_scale": 6.0, "frames": 81, "height": 480, "width": 832},
            ),
        ),
        notes=(
            "Blocks need the latent grid (frames, height, width: the Mix-FFN's convolutions reshape tokens to it); "
            "3-D RoPE is computed from hidden_states.shape inside forward. Cross-attention takes a text padding mask. "
            "CFG is batched in one call and the pipeline opens no cache contexts. Context parallel: the sequence is "
            "split in whole latent frames (at least one per rank); `controlnet_block_samples` are full-length and not "
            "supported under it."
        ),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
    )
)
