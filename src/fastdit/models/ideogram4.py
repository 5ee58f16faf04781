"""Ideogram 4 (text-to-image, asymmetric CFG): ``Ideogram4Transformer2DModel``.

Blocks (diffusers 0.42.1): one list, ``layers``, of ``Ideogram4TransformerBlock``s over a single packed sequence
``[left padding, text, image]``; each is called positionally with ``(hidden_states, attention_mask,
image_rotary_emb, adaln_input)`` and returns the sequence alone (pattern 3). The pipeline holds two transformers of
this class: ``transformer`` denoises the packed text + image sequence, ``unconditional_transformer`` the image
tokens alone with zeroed text features; both are served by this adapter.
"""

from __future__ import annotations

from fastdit.models.base import BlockGroup, ForwardPattern, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, SplitInput
from fastdit.parallel.plan_shapes import TOKENS
from fastdit.parallel.tp_plan import Colwise, Rowwise, TensorParallelPlan
from fastdit.parallel.tp_shapes import attention, under

TRANSFORMER = "diffusers.models.transformers.transformer_ideogram4.Ideogram4Transformer2DModel"

_TEXT_DIM = 16
# The pipeline taps the text encoder's hidden states after layers 0, 3, ..., 33, 35 (a module constant of the
# pipeline), so the tiny encoder needs 36 layers; their 13 states are stacked on the feature axis.
_TEXT_LAYERS = 36
_TAPPED = 13
_LATENT_CHANNELS = 4


def tiny_transformer(seed: int = 0):
    """A 3-block ``Ideogram4Transformer2DModel`` for 2x2-patchified 4-channel latents."""
    from diffusers.models.transformers.transformer_ideogram4 import Ideogram4Transformer2DModel

    from fastdit.testing.components.encoders import build

    return build(
        Ideogram4Transformer2DModel,
        seed=seed,
        in_channels=4 * _LATENT_CHANNELS,
        num_layers=3,
        attention_head_dim=16,
        num_attention_heads=2,
        intermediate_size=64,
        adaln_dim=16,
        llm_features_dim=_TAPPED * _TEXT_DIM,
        # Interleaved M-RoPE puts the h and w frequencies at indices 1 and 2 mod 3 below 3 * section: 2 each stay
        # inside the 8 frequencies of a 16-dim head.
        mrope_section=(4, 2, 2),
    )


def _text_encoder(seed: int):
    """A 36-layer ``Qwen3VLModel`` of width 16 and its tokenizer (the pipeline calls the text tower's layers)."""
    from transformers import Qwen3VLConfig, Qwen3VLModel

    from fastdit.testing.components.decoder_lm import decoder_lm_kwargs, vision_token_ids
    from fastdit.testing.components.encoders import build
    from fastdit.testing.components.qwen3 import qwen3_tokenizer

    tok = qwen3_tokenizer()
    text = decoder_lm_kwargs(
        tok,
        _TEXT_DIM,
        _TEXT_LAYERS,
        token_ids=("pad",),
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    )
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": _TEXT_DIM}
    config = Qwen3VLConfig(text_config=text, vision_config=vision, **vision_token_ids(tok))
    return build(Qwen3VLModel, config, seed=seed), tok


def tiny_vae(seed: int = 0):
    """A two-level ``AutoencoderKLFlux2`` with 4 latent channels (the pipeline patchifies its latents 2x2 -> 16)."""
    from diffusers import AutoencoderKLFlux2

    from fastdit.testing.components.encoders import build

    return build(
        AutoencoderKLFlux2,
        seed=seed,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=_LATENT_CHANNELS,
        norm_num_groups=8,
        sample_size=32,
    )


def tiny_ideogram4(seed: int = 0):
    """A complete tiny ``Ideogram4Pipeline`` (conditional and unconditional transformers, FLUX.2 VAE)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Ideogram4Pipeline

    text_encoder, tokenizer = _text_encoder(seed + 1)
    return Ideogram4Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=tiny_vae(seed),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=tiny_transformer(seed),
        unconditional_transformer=tiny_transformer(seed + 2),
    )


# Context parallelism: the forward is "mask the roles, embed, RoPE from position_ids, blocks, final layer", all
# token-wise outside attention, so the root's per-token inputs are split on their token dim: the packed latents, the
# per-token text features, the (B, L, 3) position ids (RoPE of each rank's tokens), the role indicator and a
# per-token timestep. segment_ids is left whole: it only builds the block-diagonal mask (B, 1, L, L) over the global
# sequence, which context-parallel attention takes as it is (one contiguous split: shard order is global order).
CP_PLAN = ContextParallelPlan(
    inputs={
        "": {
            "hidden_states": TOKENS,
            "encoder_hidden_states": TOKENS,
            "position_ids": SplitInput(dim=1, expected_dims=3),
            "indicator": SplitInput(dim=1, expected_dims=2),
            "timestep": SplitInput(dim=1, expected_dims=2),  # (B,) per sample passes whole
        }
    },
    gather={"final_layer": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(modules=("diffusers.models.transformers.transformer_ideogram4",)),
    notes="Packed sequence, position ids and roles split at the root; segment_ids whole: the model's "
    "block-diagonal mask is built over the global sequence.",
)

# Tensor parallelism: attention by heads (the processor unflattens by attn.num_heads and attn.head_dim: num_heads is
# divided), the SwiGLU FFN's w1 / w3 column-wise and w2 row-wise. QK-norms are per head; the post-attention and
# post-FFN RMSNorms see the reduced output (replicated). The per-block AdaLN linear (adaln_dim -> 4 x hidden, ~4 % of
# the weights) stays whole.
TP_PLAN = TensorParallelPlan(
    layers=under(
        "layers.*",
        {
            **attention("attention"),
            "feed_forward.w1": Colwise(),
            "feed_forward.w3": Colwise(),
            "feed_forward.w2": Rowwise(),
        },
    ),
    divide=("layers.*.attention.num_heads",),
    notes="Attention by heads, SwiGLU by hidden size; the per-block AdaLN linear whole.",
)

_CALL = {
    "prompt": "a cat holding a sign",
    "height": 32,
    "width": 32,
    "num_inference_steps": 2,
    "guidance_scale": 4.0,
    "guidance_schedule": None,
    "max_sequence_length": 32,
}

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "layers": (
        ("attention.to_q", "attention.to_k", "attention.to_v"),
        ("feed_forward.w1", "feed_forward.w3"),
    ),
}

ADAPTER = register(
    ModelAdapter(
        family="ideogram4",
        fused_projections=FUSED_PROJECTIONS,
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="layers", pattern=ForwardPattern.P3),),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        # The branches are calls of two transformers: each runs on its branch's rank.
        cfg_branch_components={"transformer": "cond", "unconditional_transformer": "uncond"},
        tiny_pipelines=(TinyPipeline(name="t2i", build=tiny_ideogram4, call_kwargs=_CALL),),
        presets=(
            ModelPreset(
                name="ideogram4",
                pipeline_class="diffusers.Ideogram4Pipeline",
                hub_id="ideogram-ai/ideogram-4",
                defaults={"num_inference_steps": 48, "height": 2048, "width": 2048},
            ),
        ),
        notes=(
            "Asymmetric CFG: two transformers, `transformer` on the packed [padding, text, image] sequence and "
            "`unconditional_transformer` on the image tokens alone, blended per step with a guidance schedule; "
            "each has its own cache. A block-diagonal mask from `segment_ids` keeps the left padding apart. "
            "3-axis interleaved M-RoPE from `position_ids`. The pipeline taps 13 fixed layers (up to 35) of the "
            "Qwen3-VL text tower. CFG parallelism puts each transformer on its own rank "
            "(`cfg_branch_components`); the pipeline slices and casts the conditional output before the "
            "unconditional call, which the placeholder replays once filled."
            " No spectral signal: the latent arrives packed into a token sequence (batch, tokens, channels): no grid "
            "to filter."
        ),
    )
)
