"""ACE-Step 1.5: ``AceStepTransformer1DModel`` (text-to-music, ``AceStepPipeline``).

Blocks (diffusers 0.42.1): one list, ``layers``, of ``AceStepTransformerBlock``s (AdaLN-modulated GQA self-attention
with RMS QK-norms and RoPE, alternating sliding-window and full attention; cross-attention to the packed text, lyric
and timbre conditioning; an AdaLN-modulated SwiGLU MLP). Each is called by keyword with ``hidden_states``,
``position_embeddings``, ``temb``, ``attention_mask``, ``encoder_hidden_states`` and ``encoder_attention_mask`` and
returns the hidden states alone: the conditioning is only read, pattern 2. Forward concatenates the context latents
(source latents and chunk mask) to the noisy latents on channels, patchifies with a strided ``Conv1d``, builds the
RoPE pair and a sliding-window mask over the patch sequence, and unpatchifies with a ``ConvTranspose1d``.
"""

from __future__ import annotations

from fastdit.models.base import BlockGroup, ForwardPattern, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, SplitInput
from fastdit.parallel.tp_plan import Colwise, Rowwise, TensorParallelPlan
from fastdit.parallel.tp_shapes import attention, under

TRANSFORMER = "diffusers.models.transformers.ace_step_transformer.AceStepTransformer1DModel"
_MODULE = "diffusers.models.transformers.ace_step_transformer"

_WIDTH = 32
_ACOUSTIC = 4  # latent channels of the tiny Oobleck VAE
_HEADS = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}


def tiny_transformer(seed: int = 0):
    """A 3-layer ``AceStepTransformer1DModel`` (sliding, full, sliding attention over a window of 4 patches): 4 query
    heads of 8 over 2 key/value heads, patches of 2 latent frames; its input is the 4 noisy latent channels after the
    8 context channels (source latents and chunk mask)."""
    from diffusers import AceStepTransformer1DModel

    from fastdit.testing.components.encoders import build

    return build(
        AceStepTransformer1DModel,
        seed=seed,
        hidden_size=_WIDTH,
        intermediate_size=2 * _WIDTH,
        num_hidden_layers=3,
        in_channels=3 * _ACOUSTIC,
        audio_acoustic_hidden_dim=_ACOUSTIC,
        patch_size=2,
        sliding_window=4,
        **_HEADS,
    )


def tiny_ace_step(seed: int = 0):
    """A complete tiny ``AceStepPipeline`` (Qwen3 text encoder, one-layer lyric and timbre encoders): 16 s at 16 Hz
    are 256 stereo samples, 32 latent frames, 16 patches."""
    from diffusers import AceStepPipeline, FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.ace_step.modeling_ace_step import AceStepConditionEncoder

    from fastdit.testing.components.audio import autoencoder_oobleck
    from fastdit.testing.components.encoders import build
    from fastdit.testing.components.qwen3 import qwen3_model

    text_encoder, tokenizer = qwen3_model(hidden_size=_WIDTH, seed=seed + 1)
    condition_encoder = build(
        AceStepConditionEncoder,
        seed=seed + 2,
        hidden_size=_WIDTH,
        intermediate_size=2 * _WIDTH,
        text_hidden_dim=_WIDTH,
        timbre_hidden_dim=_ACOUSTIC,
        num_lyric_encoder_hidden_layers=1,
        num_timbre_encoder_hidden_layers=1,
        sliding_window=4,
        **_HEADS,
    )
    return AceStepPipeline(
        vae=autoencoder_oobleck(latent_channels=_ACOUSTIC, seed=seed + 3),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=tiny_transformer(seed),
        condition_encoder=condition_encoder,
        # The pipeline hands the scheduler its own sigmas in [0, 1].
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1, shift=1.0),
    )


# Context parallelism: the patch sequence exists only inside forward (after the patchify convolution), so it is
# split at the first layer; the RoPE pair ((seq, head_dim) cos and sin, built over the whole sequence) is split alike
# at every layer. The sliding-window mask (1, 1, seq, seq) over the global sequence is passed to the processor as
# it is: context-parallel attention reorders a global mask to the ranks' shards. The output is gathered after the
# last layer, before norm_out and the unpatchify convolution. Cross-attention (to the replicated conditioning) is
# local: its processor passes the same parallel_config, so the cross-attention modules are left out.
CP_PLAN = ContextParallelPlan(
    inputs={
        "layers.0": {"hidden_states": SplitInput(dim=1, expected_dims=3)},
        "layers.*": {"position_embeddings": SplitInput(dim=0, expected_dims=2)},
    },
    gather={"layers.-1": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(modules=(_MODULE,), local=("layers.*.cross_attn",)),
    notes="Patch sequence split at layers.0, the RoPE pair at every layer; the global sliding-window mask reordered "
    "by the attention; gathered after the last layer; cross-attention local.",
)

# Tensor parallelism: self- and cross-attention by heads (q by query heads, k/v by key/value heads: rank r's query
# heads use rank r's key/value heads), the SwiGLU MLP's gate and up column-wise and down row-wise. QK-norms are per
# head (replicated); the AdaLN tables and the timestep embedders act on the whole width (replicated).
TP_PLAN = TensorParallelPlan(
    layers=under(
        "layers.*",
        {
            **attention("self_attn"),
            **attention("cross_attn"),
            "mlp.gate_proj": Colwise(),
            "mlp.up_proj": Colwise(),
            "mlp.down_proj": Rowwise(),
        },
    ),
    divide=(
        "layers.*.self_attn.heads",
        "layers.*.self_attn.kv_heads",
        "layers.*.cross_attn.heads",
        "layers.*.cross_attn.kv_heads",
    ),
    notes="Self- and cross-attention by (grouped) heads, SwiGLU MLP column/row-wise; AdaLN and the timestep "
    "embedders replicated.",
)

_CALL = {
    "prompt": "a cat holding a sign",
    "lyrics": "[verse] a cat",
    "audio_duration": 16.0,
    "num_inference_steps": 2,
    "guidance_scale": 3.0,
    "max_text_length": 16,
    "max_lyric_length": 16,
}

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "layers": (
        ("self_attn.to_q", "self_attn.to_k", "self_attn.to_v"),
        ("cross_attn.to_k", "cross_attn.to_v"),
        ("mlp.gate_proj", "mlp.up_proj"),
    ),
}

ADAPTER = register(
    ModelAdapter(
        family="ace_step",
        fused_projections=FUSED_PROJECTIONS,
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="layers", pattern=ForwardPattern.P2),),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        tiny_pipelines=(TinyPipeline(name="text2music", build=tiny_ace_step, call_kwargs=_CALL),),
        presets=(
            ModelPreset(
                name="ace-step-1.5",
                pipeline_class="diffusers.AceStepPipeline",
                hub_id="ACE-Step/acestep-v15-xl-turbo-diffusers",
                defaults={"num_inference_steps": 8, "audio_duration": 30.0},
            ),
        ),
        notes=(
            "Audio: outputs are (channels, samples) waveforms, compared by waveform PSNR / SNR and log-spectrogram "
            "SSIM. Layers alternate sliding-window and full self-attention; the window is a mask over the global "
            "patch sequence (flash backends use a window size instead, which context parallelism does not take). "
            "Guidance is APG, batched as [cond, null]; turbo checkpoints run without guidance. The cover task with "
            "`audio_cover_strength` < 1 makes a third call per step at the same timestep."
            " No spectral signal: the latent is a sequence of audio frames; the filter's power-law prior is one of "
            "images and videos and has not been checked on audio latents."
        ),
    )
)
