"""PixArt-α and PixArt-Σ: ``PixArtTransformer2DModel``.

Blocks (diffusers 0.42.1): one list, ``transformer_blocks``, of ``BasicTransformerBlock``s (self-attention, then
cross-attention to the T5 prompt, then a feed-forward; AdaLN-single modulation from the ``timestep`` argument).
Each is called with ``hidden_states`` positionally and ``(attention_mask, encoder_hidden_states,
encoder_attention_mask, timestep, cross_attention_kwargs, class_labels)`` by keyword, and returns the hidden states
alone. The prompt is only read (cross-attention keys/values), never updated: pattern 2.
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
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, SplitInput
from fastdit.parallel.tp_plan import TensorParallelPlan
from fastdit.parallel.tp_shapes import attention, feed_forward, under

TRANSFORMER = "diffusers.models.transformers.pixart_transformer_2d.PixArtTransformer2DModel"

_TEXT_DIM = 32


def tiny_transformer(seed: int = 0, *, sample_size: int = 16):
    """A 3-block ``PixArtTransformer2DModel`` predicting noise and variance (8 output channels) for 4-channel latents.

    ``sample_size=128`` selects the 1024-px PixArt-α layout, whose AdaLN-single also embeds resolution and aspect
    ratio (the pipeline passes them only for that size); that embedding splits the width in three, hence a width of
    48: 6 heads of 8, so tensor parallelism over 2 (or 3) ranks splits whole heads.
    """
    from diffusers import PixArtTransformer2DModel

    from fastdit.testing.components.encoders import build

    return build(
        PixArtTransformer2DModel,
        seed=seed,
        num_attention_heads=6,
        attention_head_dim=8,
        in_channels=4,
        out_channels=8,
        num_layers=3,
        cross_attention_dim=48,
        sample_size=sample_size,
        patch_size=2,
        caption_channels=_TEXT_DIM,
        norm_num_groups=8,
    )


def _components(seed: int, sample_size: int) -> dict:
    from diffusers import DPMSolverMultistepScheduler

    from fastdit.testing.components.autoencoder_kl import autoencoder_kl
    from fastdit.testing.components.encoders import t5_encoder

    text_encoder, tokenizer = t5_encoder(d_model=_TEXT_DIM, seed=seed + 1)
    return {
        "tokenizer": tokenizer,
        "text_encoder": text_encoder,
        "vae": autoencoder_kl(latent_channels=4, seed=seed),
        "transformer": tiny_transformer(seed, sample_size=sample_size),
        "scheduler": DPMSolverMultistepScheduler(),
    }


def tiny_pixart_alpha(seed: int = 0):
    """A complete tiny ``PixArtAlphaPipeline`` in the 1024-px layout (resolution/aspect-ratio conditioning)."""
    from diffusers import PixArtAlphaPipeline

    return PixArtAlphaPipeline(**_components(seed, sample_size=128))


def tiny_pixart_sigma(seed: int = 0):
    """A complete tiny ``PixArtSigmaPipeline``."""
    from diffusers import PixArtSigmaPipeline

    return PixArtSigmaPipeline(**_components(seed, sample_size=16))


# forward builds the image sequence (patch embedding plus sin-cos positions), so the split is at the first block's
# inputs. Only the self-attention sees the split image tokens; the cross-attention (attn2) reads the whole,
# replicated prompt and stays local. AttnProcessor2_0 calls F.scaled_dot_product_attention itself: its module's F is
# routed.
CP_PLAN = ContextParallelPlan(
    inputs={"transformer_blocks.0": {"hidden_states": SplitInput(dim=1, expected_dims=3)}},
    gather={"proj_out": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(
        sdpa_modules=("diffusers.models.attention_processor",), local=("transformer_blocks.*.attn2",)
    ),
    notes="Sin-cos positions added before the split at transformer_blocks.0; cross-attention to the prompt is local.",
)

# Tensor parallelism: self- and cross-attention by heads (AttnProcessor2_0 views q/k/v and the prompt mask with
# attn.heads, divided; the cross-attention's q comes from the image, its k/v from the whole prompt, split alike), the
# GELU FeedForward (not gated) column- then row-wise. The modulation is AdaLN-single: one shared `adaln_single` linear
# and a small per-block (6, dim) `scale_shift_table`, both replicated, as are the caption projection and proj_out.
# PixArt-α/Σ have 16 heads: a degree that does not divide them (3, 6) keeps attention whole and splits the FFN.
_FFN = under("transformer_blocks.*", feed_forward("ff"))
TP_PLAN = TensorParallelPlan(
    layers={**under("transformer_blocks.*", {**attention("attn1"), **attention("attn2")}), **_FFN},
    divide=("transformer_blocks.*.attn1.heads", "transformer_blocks.*.attn2.heads"),
    notes="Self- and cross-attention by heads, GELU FFN column/row-wise; adaln_single and scale_shift_table "
    "replicated; FFN-only fallback when tp does not divide the heads.",
    fallback=TensorParallelPlan(
        layers=_FFN,
        notes="FFN only: tp does not divide the heads, attention replicated.",
        name="ffn-only",
    ),
)

# The pipelines pass the same prompt embeddings at every step (batched CFG's cat([negative, prompt]) is done once
# before the loop): the caption projection repeats. Not `adaln_single` (the timestep, with PixArt-α's resolution and
# aspect-ratio embedding) nor `pos_embed` (the latent's patch embedding).
STEP_INVARIANT = (StepInvariant("caption_projection", inputs=("encoder_hidden_states",)),)

_CALL = {
    "prompt": "a cat holding a sign",
    "height": 32,
    "width": 32,
    "num_inference_steps": 2,
    "guidance_scale": 4.5,
    "max_sequence_length": 16,
    "clean_caption": False,
    # Binning snaps the size to the aspect-ratio table of the real model (512-2048 px).
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
        family="pixart",
        fused_projections=FUSED_PROJECTIONS,
        # hidden_states is (batch, channels, height, width).
        latent=LatentLayout(),
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="transformer_blocks", pattern=ForwardPattern.P2),),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        step_invariant=STEP_INVARIANT,
        tiny_pipelines=(
            TinyPipeline(name="alpha", build=tiny_pixart_alpha, call_kwargs=_CALL),
            TinyPipeline(name="sigma", build=tiny_pixart_sigma, call_kwargs=_CALL),
        ),
        presets=(
            ModelPreset(
                name="pixart-alpha",
                pipeline_class="diffusers.PixArtAlphaPipeline",
                hub_id="PixArt-alpha/PixArt-XL-2-1024-MS",
                defaults={"num_inference_steps": 20, "guidance_scale": 4.5, "height": 1024, "width": 1024},
            ),
            ModelPreset(
                name="pixart-sigma",
                pipeline_class="diffusers.PixArtSigmaPipeline",
                hub_id="PixArt-alpha/PixArt-Sigma-XL-2-1024-MS",
                defaults={"num_inference_steps": 20, "guidance_scale": 4.5, "height": 1024, "width": 1024},
            ),
        ),
        notes=(
            "Cross-attention only reads the prompt, so the encoder stream is constant over the blocks and the "
            "image sequence can be split alone (keys/values of the cross-attention stay whole); the prompt mask "
            "arrives as `encoder_attention_mask` (a bias). Sin-cos positions are added before the blocks (no "
            "RoPE). CFG is batched. The pipelines snap the size to ~1 MP bins unless `use_resolution_binning=False`."
        ),
    )
)
