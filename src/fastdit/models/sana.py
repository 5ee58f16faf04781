"""Sana (1.0 / 1.5) and Sana-Sprint: ``SanaTransformer2DModel``.

Blocks (diffusers 0.42.1): one list, ``transformer_blocks``, of ``SanaTransformerBlock``s (linear self-attention,
softmax cross-attention to the Gemma 2 prompt, a Mix-FFN with a depthwise 3x3 convolution over the token grid).
Each is called positionally with ``(hidden_states, attention_mask, encoder_hidden_states, encoder_attention_mask,
timestep, height, width)`` and returns the hidden states alone; the prompt is only read: pattern 2.
"""

from __future__ import annotations

from fastdit.models.base import (
    BlockGroup,
    ForwardPattern,
    LatentLayout,
    ModelAdapter,
    ModelPreset,
    StepInvariant,
    TinyPipeline,
)
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
from fastdit.parallel.tp_plan import Colwise, Rowwise, ShardedNorm, Style, TensorParallelPlan
from fastdit.parallel.tp_shapes import attention, under

TRANSFORMER = "diffusers.models.transformers.sana_transformer.SanaTransformer2DModel"

_TEXT_DIM = 32


def tiny_transformer(seed: int = 0, *, sprint: bool = False):
    """A 3-block ``SanaTransformer2DModel`` for 4-channel latents (Sana-Sprint layout when ``sprint``).

    Sprint embeds the guidance scale, normalises q/k across heads and scales the trigonometric timestep by 1000.
    """
    from diffusers import SanaTransformer2DModel

    from fastdit.testing.components.encoders import build

    extra = {"guidance_embeds": True, "qk_norm": "rms_norm_across_heads", "timestep_scale": 1000.0} if sprint else {}
    return build(
        SanaTransformer2DModel,
        seed=seed,
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=3,
        num_cross_attention_heads=2,
        cross_attention_head_dim=16,
        cross_attention_dim=32,
        caption_channels=_TEXT_DIM,
        sample_size=16,
        patch_size=1,
        **extra,
    )


def tiny_vae(seed: int = 0):
    """A two-level ``AutoencoderDC`` (scale factor 2, 4 latent channels) with one EfficientViT level like DC-AE."""
    from diffusers import AutoencoderDC

    from fastdit.testing.components.encoders import build

    return build(
        AutoencoderDC,
        seed=seed,
        in_channels=3,
        latent_channels=4,
        attention_head_dim=8,
        encoder_block_types=("ResBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "EfficientViTBlock"),
        encoder_block_out_channels=(8, 16),
        decoder_block_out_channels=(8, 16),
        encoder_layers_per_block=(1, 1),
        decoder_layers_per_block=(1, 1),
        encoder_qkv_multiscales=((), (5,)),
        decoder_qkv_multiscales=((), (5,)),
        scaling_factor=0.41407,
    )


def _components(seed: int, *, sprint: bool) -> dict:
    from fastdit.testing.components.gemma2 import gemma2_model

    text_encoder, tokenizer = gemma2_model(hidden_size=_TEXT_DIM, seed=seed + 1)
    return {
        "tokenizer": tokenizer,
        "text_encoder": text_encoder,
        "vae": tiny_vae(seed),
        "transformer": tiny_transformer(seed, sprint=sprint),
    }


def tiny_sana(seed: int = 0):
    """A complete tiny ``SanaPipeline`` (flow-matching DPM-Solver++)."""
    from diffusers import DPMSolverMultistepScheduler, SanaPipeline

    scheduler = DPMSolverMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    return SanaPipeline(**_components(seed, sprint=False), scheduler=scheduler)


def tiny_sana_sprint(seed: int = 0):
    """A complete tiny ``SanaSprintPipeline`` (sCM consistency sampler, guidance embedded, no CFG)."""
    from diffusers import SanaSprintPipeline, SCMScheduler

    return SanaSprintPipeline(**_components(seed, sprint=True), scheduler=SCMScheduler())


def _token_sums() -> tuple[TokenSum, ...]:
    import torch

    # SanaLinearAttnProcessor2_0 (diffusers 0.42.1): ``scores = torch.matmul(value, key)`` with the value padded by a
    # row of ones sums v kᵀ and k over the tokens (the normaliser is its last row); the second matmul meets the
    # local queries. Only the first is summed over the ranks.
    return (TokenSum(torch.matmul, 0),)


CP_PLAN = ContextParallelPlan(
    inputs={
        # Whole rows of the (height, width) token grid per rank, so the Mix-FFN's grid reshape sees its own rows.
        "transformer_blocks.0": {"hidden_states": SplitInput(dim=1, expected_dims=3, unit=("width",))},
        "transformer_blocks.*": {"height": LocalExtent(of="hidden_states")},
    },
    gather={"proj_out": GatherOutput(dim=1, expected_dims=3)},
    # The 3x3 depthwise convolution of the Mix-FFN reads one row above and below: a one-row halo on (B, C, H, W).
    halo={"transformer_blocks.*.ff.conv_depth": Halo(dim=2, size=1)},
    attention=linear_self_attention(_token_sums()),
    notes=(
        "Split at transformer_blocks.0 in whole rows of the token grid (each block's `height` becomes the rank's "
        "rows); linear self-attention all-reduces its summed value-key products (TokenSum); the Mix-FFN's 3x3 "
        "convolution gets a one-row halo from the adjacent ranks; cross-attention to the prompt is local; sin-cos "
        "positions (when configured) are added before the split."
    ),
)

# Tensor parallelism, by heads. Linear self-attention (SanaLinearAttnProcessor2_0) sums v kᵀ per head and
# cross-attention (SanaAttnProcessor2_0) is softmax per head, so a rank holding whole heads computes its heads
# exactly; both reshape with `attn.heads` (and the cross-attention mask is viewed per head), which is divided. The
# Mix-FFN (GLUMBConv) is three convolutions: the 1x1 `conv_inverted` outputs [hidden | gate] and the depthwise 3x3
# `conv_depth` keeps them before `chunk(2, dim=1)`, so both split with two segments (each rank pairs its hidden
# channels with their gates; the depthwise groups follow the channels); the 1x1 `conv_point` back to the width is
# row-wise. Sana-Sprint normalises q/k across all heads (RMSNorm over the inner dim): sharded norms, absent in
# plain Sana. The modulation is a per-block (6, dim) table added to the shared `time_embed` output: both whole.
_SANA_BLOCK: dict[str, Style] = {
    **attention("attn1"),
    **attention("attn2"),
    "ff.conv_inverted": Colwise(segments=(1, 1)),
    "ff.conv_depth": Colwise(segments=(1, 1)),
    "ff.conv_point": Rowwise(),
}
_SPRINT_NORMS = tuple(f"transformer_blocks.*.{a}.{n}" for a in ("attn1", "attn2") for n in ("norm_q", "norm_k"))
TP_PLAN = TensorParallelPlan(
    layers={**under("transformer_blocks.*", _SANA_BLOCK), **dict.fromkeys(_SPRINT_NORMS, ShardedNorm())},
    divide=("transformer_blocks.*.attn1.heads", "transformer_blocks.*.attn2.heads"),
    optional=_SPRINT_NORMS,
    notes="Self- and cross-attention by heads, Mix-FFN convolutions by channel ([hidden | gate] segments); "
    "Sprint's across-heads QK-norms sharded; scale_shift_table and time_embed replicated.",
)

# The pipelines pass the same prompt embeddings at every step (batched CFG's cat([negative, prompt]) is done once
# before the loop; `.to(transformer_dtype)` returns the same tensor when the dtypes agree): the caption projection and
# the RMSNorm after it repeat. Both are keyed on `encoder_hidden_states`: the norm reads a `.view` of the projection's
# output, a new tensor every call. Not `time_embed` (the timestep, and Sprint's guidance) nor `patch_embed` (latent).
STEP_INVARIANT = (
    StepInvariant("caption_projection", inputs=("encoder_hidden_states",)),
    StepInvariant("caption_norm", inputs=("encoder_hidden_states",)),
)

_CALL = {
    "prompt": "a cat holding a sign",
    "height": 32,
    "width": 32,
    "num_inference_steps": 2,
    "max_sequence_length": 16,
    # Binning snaps the size to the aspect-ratio table of the real model (>= 512 px).
    "use_resolution_binning": False,
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
        family="sana",
        fused_projections=FUSED_PROJECTIONS,
        # hidden_states is (batch, channels, height, width).
        latent=LatentLayout(),
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="transformer_blocks", pattern=ForwardPattern.P2),),
        tiny_pipelines=(
            TinyPipeline(name="sana", build=tiny_sana, call_kwargs={**_CALL, "guidance_scale": 4.5}),
            TinyPipeline(name="sprint", build=tiny_sana_sprint, call_kwargs={**_CALL, "guidance_scale": 4.5}),
        ),
        presets=(
            ModelPreset(
                name="sana",
                pipeline_class="diffusers.SanaPipeline",
                hub_id="Efficient-Large-Model/Sana_1600M_1024px_diffusers",
                defaults={"num_inference_steps": 20, "guidance_scale": 4.5, "height": 1024, "width": 1024},
            ),
            ModelPreset(
                name="sana-1.5",
                pipeline_class="diffusers.SanaPipeline",
                hub_id="Efficient-Large-Model/SANA1.5_4.8B_1024px_diffusers",
                defaults={"num_inference_steps": 20, "guidance_scale": 4.5, "height": 1024, "width": 1024},
            ),
            ModelPreset(
                name="sana-sprint",
                pipeline_class="diffusers.SanaSprintPipeline",
                hub_id="Efficient-Large-Model/Sana_Sprint_1.6B_1024px_diffusers",
                defaults={"num_inference_steps": 2, "guidance_scale": 4.5, "height": 1024, "width": 1024},
            ),
        ),
        notes=(
            "Self-attention is linear (ReLU kernel, not SDPA), so Ulysses/ring attention backends do not apply to "
            "it; the Mix-FFN reshapes the tokens to the (height, width) grid passed to every block and runs a 3x3 "
            "depthwise convolution, so a sequence split needs whole rows plus a one-row halo. Cross-attention reads "
            "the prompt with `encoder_attention_mask`. CFG is batched (Sprint embeds guidance and runs one branch); "
            "the pipelines snap sizes to ~1 MP bins unless `use_resolution_binning=False`. "
            "Context parallel: the sequence is split in whole rows (at least one latent row per rank); "
            "`controlnet_block_samples` (SanaControlNet) are full-length and not supported under it."
        ),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        step_invariant=STEP_INVARIANT,
    )
)
