"""MiniMax Music 3 (lyrics- and caption-conditioned music): ``MiniMaxMusic3Transformer1DModel``.

An audio DiT over 1-D Flow-VAE latents ``(batch, channels, length)``. Blocks (diffusers 0.42.1): one list
``transformer_blocks`` of ``MiniMaxMusic3TransformerBlock``, called positionally as ``block(hidden_states,
rotary_emb)`` and returning ``hidden_states`` (pattern 3). Forward concatenates ``[latent | zeros | condition]`` on
channels, projects it to tokens, **prepends the timestep embedding as one extra token**, computes partial-RoPE
``(cos, sin)`` tables over the whole ``1 + length`` sequence (``rotary_emb``), runs the blocks (full self-attention,
no mask, no cross-attention) and drops the timestep token before ``proj_out``. The flow-matching ``timestep`` rises
from 0 (noise) to 1 (data) over a run.

diffusers serves it through ``MiniMaxMusic3ModularPipeline`` only (a ModularPipeline): a Qwen3 language model with an
RVQ depth decoder generates per-frame hidden states autoregressively, ``MiniMaxMusic3ConditionEncoder`` aligns them
to the latent timeline, the DiT flow-matches 200-frame windows under a ``ClassifierFreeGuidance`` guider (two calls a
step, announced as ``pred_cond`` / ``pred_uncond``), and ``MiniMaxMusic3Vocoder`` decodes a stereo waveform. The tiny
pipeline is that pipeline with every component built from a small config; its output is audio ``(1, 2, samples)``
in [-1, 1]. ``MiniMaxMusic3RVQDepthDecoder`` (diffusers files it under transformers) is the autoregressive stage's
codec head, not a diffusion transformer: no adapter.
"""

from __future__ import annotations

from typing import Any

from fastdit.models.base import BlockGroup, ForwardPattern, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, SplitInput, SplitOutput
from fastdit.parallel.tp_plan import Colwise, Rowwise, TensorParallelPlan
from fastdit.parallel.tp_shapes import attention, under

TRANSFORMER = "diffusers.models.transformers.transformer_minimax_music3.MiniMaxMusic3Transformer1DModel"
_MODULE = "diffusers.models.transformers.transformer_minimax_music3"

# The prompt template's special tokens (the tokenize step spells them out) and the language model's vocabulary: the
# autoregressive step samples semantic codes from rows 151675 + [0, 16384) and reads the end-of-audio token 151670.
_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|caption_start|>", "<|caption_end|>", "<|lyrics_start|>",
    "<|lyrics_end|>", "<|audio_start|>",
)  # fmt: skip
_LM_VOCAB = 151675 + 16384
_LM_WIDTH = 32
_CODEBOOKS = 2
_LATENT = 8
_CONDITION = 16


def tiny_pipeline() -> Any:
    """``MiniMaxMusic3ModularPipeline`` with tiny components: a 1-layer Qwen3 LM (32 wide, the checkpoint's vocabulary
    size), a 2-codebook depth decoder, a 3-block DiT (2 heads of 8) over 8 latent channels, a 2-stage vocoder. One
    frame of the autoregressive stage is one latent frame (the condition encoder's rates are equal)."""
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        MiniMaxMusic3ConditionEncoder,
        MiniMaxMusic3ModularPipeline,
        MiniMaxMusic3RVQDepthDecoder,
        MiniMaxMusic3Vocoder,
    )
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from fastdit.testing.components.decoder_lm import decoder_lm_kwargs
    from fastdit.testing.components.encoders import build
    from fastdit.testing.components.tokenizers import qwen_chat_tokenizer

    tokenizer = qwen_chat_tokenizer(_SPECIALS, 512)
    lm_config = Qwen3Config(
        **decoder_lm_kwargs(tokenizer, _LM_WIDTH, 1, vocab_size=_LM_VOCAB, token_ids=("pad", "eos"), bos_token_id=None)
    )
    pipe = MiniMaxMusic3ModularPipeline()
    pipe.update_components(
        tokenizer=tokenizer,
        language_model=build(Qwen3ForCausalLM, lm_config, seed=0),
        rvq_depth_decoder=build(
            MiniMaxMusic3RVQDepthDecoder,
            seed=1,
            hidden_size=_LM_WIDTH,
            num_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            audio_vocab_size=16,
            num_codebooks=_CODEBOOKS,
        ),
        condition_encoder=build(
            MiniMaxMusic3ConditionEncoder,
            seed=2,
            condition_hidden_dim=_LM_WIDTH,
            num_condition_layers=_CODEBOOKS,
            out_dim=_CONDITION,
            input_sampling_rate=800,
            input_hop_length=100,
            output_sampling_rate=800,
            output_hop_length=100,
        ),
        transformer=tiny_transformer(seed=3),
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vocoder=build(
            MiniMaxMusic3Vocoder,
            seed=4,
            latent_channels=_LATENT,
            decoder_input_dim=16,
            decoder_hidden_dim=16,
            upsampling_ratios=(2, 2),
            sampling_rate=800,
        ),
    )
    return pipe


def tiny_transformer(seed: int = 0) -> Any:
    """A 3-block ``MiniMaxMusic3Transformer1DModel``: 2 heads of 8, rotary over 4 of each head's dims."""
    from diffusers import MiniMaxMusic3Transformer1DModel

    from fastdit.testing.components.encoders import build

    return build(
        MiniMaxMusic3Transformer1DModel,
        seed=seed,
        in_channels=_LATENT,
        condition_dim=_CONDITION,
        num_layers=3,
        num_attention_heads=2,
        attention_head_dim=8,
        ff_inner_dim=32,
        rotary_dim=4,
        fourier_embedding_dim=16,
    )


# Context parallelism: the sequence is built inside forward (the timestep token prepended to the projected latent
# frames), so it is split at the first block, with the (cos, sin) tables `rotary_emb` returns over the same 1 + length
# rows; it is gathered at the last block, because forward then drops the timestep token (the first row of the whole
# sequence, which only rank 0 holds) before the output projection. Uneven shards: 1 + length need not divide.
CP_PLAN = ContextParallelPlan(
    inputs={"transformer_blocks.0": {"hidden_states": SplitInput(dim=1, expected_dims=3)}},
    outputs={
        "rotary_emb": (SplitOutput(dim=0, expected_dims=2, index=0), SplitOutput(dim=0, expected_dims=2, index=1))
    },
    gather={"transformer_blocks.-1": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(modules=(_MODULE,)),
    notes="[timestep token | latent frames] split at transformer_blocks.0 with the RoPE tables; gathered at the last "
    "block, before forward drops the timestep token.",
)

# Tensor parallelism: attention by heads (to_q/to_k/to_v column-wise, to_out.0 row-wise; heads divided, since the
# processor views with them), the SwiGLU FFN's fused [hidden | gate] ff_in split per half, ff_out row-wise. Norms,
# the time embedding, the 1x1 convolutions and the projections in and out whole.
TP_PLAN = TensorParallelPlan(
    layers=under("transformer_blocks.*", {**attention("attn"), "ff_in": Colwise(segments=(1, 1)), "ff_out": Rowwise()}),
    divide=("transformer_blocks.*.attn.heads",),
    notes="Attention by heads, SwiGLU FFN split per half; convolutions, time embedding and projections whole. No "
    "expert layers.",
)

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "transformer_blocks": (("attn.to_q", "attn.to_k", "attn.to_v"),),
}

ADAPTER = register(
    ModelAdapter(
        family="minimax_music3",
        fused_projections=FUSED_PROJECTIONS,
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="transformer_blocks", pattern=ForwardPattern.P3),),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        # The guider calls the transformer for pred_cond, then pred_uncond, at one timestep, without announcing
        # them (no cache_context), and combines the two only after both calls.
        cfg_pairs_by_timestep=True,
        tiny_pipelines=(
            TinyPipeline(
                name="t2a",
                build=tiny_pipeline,
                call_kwargs={
                    "prompt": "a calm piano",
                    "lyrics": "[verse]\nla la la",
                    "audio_duration": 1.0,
                    "num_inference_steps": 2,
                },
            ),
        ),
        presets=(ModelPreset(name="minimax-music3", pipeline_class="diffusers.MiniMaxMusic3ModularPipeline"),),
        notes=(
            "Audio DiT over 1-D latents; the timestep embedding is one token prepended to the sequence and dropped "
            "after the blocks, and the flow-matching timestep rises over a run. Served by a ModularPipeline "
            "(MiniMaxMusic3ModularPipeline): an autoregressive Qwen3 stage, the DiT under a CFG guider over 200-frame "
            "windows (each window is a run of its own), a vocoder; the output is a stereo waveform."
            " No spectral signal: the latent is a sequence of audio frames; the filter's power-law prior is one of "
            "images and videos and has not been checked on audio latents."
        ),
    )
)
