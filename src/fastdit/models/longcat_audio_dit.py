"""LongCat-AudioDiT: ``LongCatAudioDiTTransformer`` (text-to-audio, ``LongCatAudioDiTPipeline``).

Blocks (diffusers 0.42.1): one list, ``blocks``, of ``AudioDiTBlock``s (globally AdaLN-modulated self-attention with
RMS QK-norms over the whole inner width and RoPE, cross-attention to the UMT5 prompt with RoPE on both sides, a GELU
feed-forward). Each is called by keyword with ``hidden_states``, ``timestep_embed``, ``cond``, ``mask``,
``cond_mask``, ``rope``, ``cond_rope`` and ``adaln_global_out`` and returns the hidden states alone: the prompt is
only read, pattern 2 with ``encoder_arg="cond"``. Forward embeds the latents (and the latent condition), keeps them
for a long skip added after the blocks, and builds both RoPE pairs.
"""

from __future__ import annotations

from fastdit.models.base import BlockGroup, ForwardPattern, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, SplitInput
from fastdit.parallel.tp_plan import Colwise, Rowwise, ShardedNorm, TensorParallelPlan
from fastdit.parallel.tp_shapes import attention, under

TRANSFORMER = "diffusers.models.transformers.transformer_longcat_audio_dit.LongCatAudioDiTTransformer"
_MODULE = "diffusers.models.transformers.transformer_longcat_audio_dit"

_TEXT_DIM = 32
_LATENT_DIM = 4


def tiny_transformer(seed: int = 0):
    """A 3-block ``LongCatAudioDiTTransformer`` of width 32 (4 heads of 8) over 4 latent channels.

    The model zero-initialises its global AdaLN output layer, ``norm_out`` and ``proj_out``, so a random model would
    predict zeros whatever its blocks compute; those get random weights here.
    """
    import torch
    from diffusers import LongCatAudioDiTTransformer

    from fastdit.testing.components.encoders import build

    model = build(
        LongCatAudioDiTTransformer,
        seed=seed,
        dit_dim=32,
        dit_depth=3,
        dit_heads=4,
        dit_text_dim=_TEXT_DIM,
        latent_dim=_LATENT_DIM,
        ff_mult=2.0,
    )
    generator = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        # Unit-scale AdaLN gates: the blocks' updates must not vanish next to the long skip, or a random model
        # would look converged to a step cache.
        for layer, scale in (
            (model.adaln_global_mlp.mlp[-1], 1.0),
            (model.norm_out.linear, 0.2),
            (model.proj_out, 0.2),
        ):
            for param in (layer.weight, layer.bias):
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    return model


def tiny_longcat_audio_dit(seed: int = 0):
    """A complete tiny ``LongCatAudioDiTPipeline``: mono audio at 16 Hz, 8 samples per latent frame."""
    from diffusers import FlowMatchEulerDiscreteScheduler, LongCatAudioDiTPipeline, LongCatAudioDiTVae

    from fastdit.testing.components.encoders import build, umt5_encoder

    text_encoder, tokenizer = umt5_encoder(d_model=_TEXT_DIM, seed=seed + 1)
    vae = build(
        LongCatAudioDiTVae,
        seed=seed + 2,
        in_channels=1,
        channels=4,
        c_mults=[1, 2],
        strides=[2, 4],
        latent_dim=_LATENT_DIM,
        encoder_latent_dim=2 * _LATENT_DIM,
        downsampling_ratio=8,
        sample_rate=16,
    )
    return LongCatAudioDiTPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=tiny_transformer(seed),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0, invert_sigmas=True),
    )


# Context parallelism: the latent sequence is split at the first block (forward keeps the whole embedding for its
# long skip, added after the blocks, where the output is gathered). The audio RoPE pair ((seq, head_dim) cos and sin)
# is split at every block: the self-attention rotates its local queries and keys, the cross-attention its local
# queries. The frame mask (B, seq) is split like the tokens: the self-attention's processor passes it as a key
# padding mask over the local keys (context-parallel attention gathers it) and multiplies its local output rows by
# it, as the cross-attention does. The prompt, its mask and its RoPE pair stay whole (cross-attention is local).
CP_PLAN = ContextParallelPlan(
    inputs={
        "blocks.0": {"hidden_states": SplitInput(dim=1, expected_dims=3)},
        "blocks.*": {"rope": SplitInput(dim=0, expected_dims=2), "mask": SplitInput(dim=1, expected_dims=2)},
    },
    gather={"blocks.-1": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(modules=(_MODULE,), local=("blocks.*.cross_attn",)),
    notes="Latent frames split at blocks.0, the audio RoPE pair and the frame mask at every block (the mask is a "
    "local key-padding mask the attention gathers); gathered after the last block, before the long skip; "
    "cross-attention local.",
)

# Tensor parallelism: self- and cross-attention by heads; their QK-norms are RMSNorms over the whole inner width (not
# per head), so they become ShardedNorm (statistics summed over the ranks); the processors reshape with heads and
# inner_dim, both divided. The GELU feed-forward column- then row-wise. The global AdaLN MLP, the per-block AdaLN
# table and the text ConvNeXt blocks act on the whole width: replicated.
_NORMS = {f"{attn}.{norm}": ShardedNorm() for attn in ("self_attn", "cross_attn") for norm in ("q_norm", "k_norm")}
TP_PLAN = TensorParallelPlan(
    layers=under(
        "blocks.*",
        {
            **attention("self_attn"),
            **attention("cross_attn"),
            **_NORMS,
            "ffn.ff.0": Colwise(),
            "ffn.ff.3": Rowwise(),
        },
    ),
    divide=tuple(f"blocks.*.{attn}.{attr}" for attn in ("self_attn", "cross_attn") for attr in ("heads", "inner_dim")),
    notes="Self- and cross-attention by heads with their inner-width QK-norms sharded, GELU FFN column/row-wise; "
    "AdaLN and the text ConvNeXt replicated.",
)

_CALL = {
    "prompt": "a cat holding a sign",
    "negative_prompt": "blue",
    "audio_duration_s": 8.0,
    "num_inference_steps": 2,
    "guidance_scale": 4.0,
}

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "blocks": (
        ("self_attn.to_q", "self_attn.to_k", "self_attn.to_v"),
        ("cross_attn.to_k", "cross_attn.to_v"),
    ),
}

ADAPTER = register(
    ModelAdapter(
        family="longcat_audio_dit",
        fused_projections=FUSED_PROJECTIONS,
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="blocks", pattern=ForwardPattern.P2, encoder_arg="cond"),),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        cfg_pairs_by_timestep=True,
        tiny_pipelines=(TinyPipeline(name="t2a", build=tiny_longcat_audio_dit, call_kwargs=_CALL),),
        presets=(
            ModelPreset(
                name="longcat-audio-dit",
                pipeline_class="diffusers.LongCatAudioDiTPipeline",
                hub_id="ruixiangma/LongCat-AudioDiT-1B-Diffusers",
                defaults={"num_inference_steps": 16, "guidance_scale": 4.0},
            ),
        ),
        notes=(
            "Audio: outputs are (channels, samples) waveforms, compared by waveform PSNR / SNR and log-spectrogram "
            "SSIM. The pipeline runs the conditional and the null-prompt call one after the other at the same "
            "timestep without announcing them (CFG parallelism pairs them by timestep). `adaln_type='local'` models "
            "(per-block AdaLN MLPs) are served by the same plans."
            " No spectral signal: the latent is a sequence of audio frames; the filter's power-law prior is one of "
            "images and videos and has not been checked on audio latents."
        ),
    )
)
