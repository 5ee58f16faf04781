"""HunyuanDiT (v1.0-v1.2, bilingual text-to-image): ``HunyuanDiT2DModel``.

Blocks (diffusers 0.42.1): one list, ``blocks``, of ``HunyuanDiTBlock``s (self-attention with RoPE, cross-attention
to the concatenated BERT + T5 prompt, feed-forward). Each is called with ``hidden_states`` positionally and
``(temb, encoder_hidden_states, image_rotary_emb)`` by keyword; blocks of the second half also get ``skip=``, the
output of their mirror block in the first half (a U-Net-like long skip). Each returns the hidden states alone; the
prompt is only read by cross-attention: pattern 2.
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

TRANSFORMER = "diffusers.models.transformers.hunyuan_transformer_2d.HunyuanDiT2DModel"

_BERT_DIM = 32
_T5_DIM = 32
# The pipeline tokenizes to fixed lengths (77 for BERT, 256 for T5) and the model keeps a learned padding of
# exactly that many tokens, so the config must use the same numbers.
_BERT_LEN = 77
_T5_LEN = 256


def tiny_transformer(seed: int = 0, *, style_and_size: bool = False):
    """A 6-block ``HunyuanDiT2DModel`` (blocks 0-1 feed the skips of blocks 5-4) with learned sigma.

    ``style_and_size`` selects the v1.0/v1.1 layout that also embeds the image size and a style id.
    """
    from diffusers import HunyuanDiT2DModel

    from fastdit.testing.components.encoders import build

    heads, head_dim = 2, 16
    return build(
        HunyuanDiT2DModel,
        seed=seed,
        num_attention_heads=heads,
        attention_head_dim=head_dim,
        in_channels=4,
        patch_size=2,
        sample_size=8,
        hidden_size=heads * head_dim,
        num_layers=6,
        mlp_ratio=2.0,
        learn_sigma=True,
        cross_attention_dim=_BERT_DIM,
        cross_attention_dim_t5=_T5_DIM,
        pooled_projection_dim=16,
        text_len=_BERT_LEN,
        text_len_t5=_T5_LEN,
        use_style_cond_and_image_meta_size=style_and_size,
    )


def _pipeline(seed: int, *, style_and_size: bool):
    from diffusers import DDPMScheduler, HunyuanDiTPipeline

    from fastdit.testing.components.autoencoder_kl import autoencoder_kl
    from fastdit.testing.components.bert import bert_model
    from fastdit.testing.components.encoders import t5_encoder

    text_encoder, tokenizer = bert_model(hidden_size=_BERT_DIM, seed=seed + 1)
    text_encoder_2, tokenizer_2 = t5_encoder(d_model=_T5_DIM, seed=seed + 2)
    return HunyuanDiTPipeline(
        vae=autoencoder_kl(latent_channels=4, num_levels=4, scaling_factor=0.13025, seed=seed),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=tiny_transformer(seed, style_and_size=style_and_size),
        scheduler=DDPMScheduler(beta_schedule="scaled_linear", steps_offset=1, prediction_type="v_prediction"),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
    )


def tiny_hunyuan_dit(seed: int = 0):
    """A complete tiny ``HunyuanDiTPipeline`` in the v1.2 layout (no size/style conditioning)."""
    return _pipeline(seed, style_and_size=False)


def tiny_hunyuan_dit_v11(seed: int = 0):
    """A complete tiny ``HunyuanDiTPipeline`` in the v1.0/v1.1 layout (size and style conditioning)."""
    return _pipeline(seed, style_and_size=True)


# forward builds the image sequence (patch embedding), so the image tokens are split at the first block's inputs;
# the (cos, sin) RoPE tables the pipeline passes in are split alike at the root. Both attentions rotate the image
# queries with them; the cross-attention (attn2) reads the whole, replicated prompt and stays local. The long skips
# are token-wise, so the blocks see only split tokens. HunyuanAttnProcessor2_0 calls
# F.scaled_dot_product_attention itself: its module's F is routed.
CP_PLAN = ContextParallelPlan(
    inputs={
        "": {"image_rotary_emb": SplitInput(dim=0, expected_dims=2)},
        "blocks.0": {"hidden_states": SplitInput(dim=1, expected_dims=3)},
    },
    gather={"proj_out": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(sdpa_modules=("diffusers.models.attention_processor",), local=("blocks.*.attn2",)),
    notes="RoPE (cos, sin) tables split at the root with the image tokens (split at blocks.0); cross-attention local.",
)

# Tensor parallelism: HunyuanAttnProcessor2_0 views q/k/v with attn.heads in both the self-attention and the
# cross-attention (q from the image, k/v from the prompt), so both heads are divided and both split by heads (to_out
# row-wise); QK-norms are per-head LayerNorms and RoPE rotates each head alike (replicated). The FFN is split by hidden
# size. The AdaLN here is a shift only (dim -> dim, small) and the long-skip skip_linear reads the whole
# cat([hidden, skip]): both stay replicated, as do the embedders and the output layer.
TP_PLAN = TensorParallelPlan(
    layers=under("blocks.*", {**attention("attn1"), **attention("attn2"), **feed_forward()}),
    divide=("blocks.*.attn1.heads", "blocks.*.attn2.heads"),
    notes="Self- and cross-attention split by heads, FFN by hidden size; the shift-only AdaLN (dim -> dim) and the "
    "long-skip linears are replicated.",
)

# The pipeline passes the same BERT and T5 prompt embeddings at every step (batched CFG's cats are done once before
# the loop): the T5 projection (`text_embedder`, fed a `.view` of the T5 states, a new tensor every call) and the
# attention pooler of the T5 states inside the combined time embedding repeat, both keyed on `encoder_hidden_states_t5`.
# Not the rest of `time_extra_emb` (it adds the timestep; its `extra_embedder` reads the size embedding cast to the
# timestep's dtype), nor `pos_embed` (the latent). The RoPE tables come from the pipeline.
STEP_INVARIANT = (
    StepInvariant("text_embedder", inputs=("encoder_hidden_states_t5",)),
    StepInvariant("time_extra_emb.pooler", inputs=("encoder_hidden_states_t5",)),
)

_CALL = {
    "prompt": "a cat holding a sign",
    # The pipeline derives the RoPE grid from height // 8, so the VAE must downsample by 8: 64 px -> 8x8 latents.
    "height": 64,
    "width": 64,
    "num_inference_steps": 2,
    "guidance_scale": 5.0,
    # Binning snaps the size to the 1024-1280 px table of the real model.
    "use_resolution_binning": False,
}

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "blocks": (
        ("attn1.to_q", "attn1.to_k", "attn1.to_v"),
        ("attn2.to_k", "attn2.to_v"),
    ),
}

ADAPTER = register(
    ModelAdapter(
        family="hunyuan_dit",
        fused_projections=FUSED_PROJECTIONS,
        # hidden_states is (batch, channels, height, width).
        latent=LatentLayout(),
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="blocks", pattern=ForwardPattern.P2),),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        step_invariant=STEP_INVARIANT,
        tiny_pipelines=(
            TinyPipeline(name="v1.2", build=tiny_hunyuan_dit, call_kwargs=_CALL),
            TinyPipeline(name="v1.1", build=tiny_hunyuan_dit_v11, call_kwargs=_CALL),
        ),
        presets=(
            ModelPreset(
                name="hunyuan-dit",
                pipeline_class="diffusers.HunyuanDiTPipeline",
                hub_id="Tencent-Hunyuan/HunyuanDiT-v1.2-Diffusers",
                defaults={"num_inference_steps": 50, "guidance_scale": 5.0, "height": 1024, "width": 1024},
            ),
            ModelPreset(
                name="hunyuan-dit-distilled",
                pipeline_class="diffusers.HunyuanDiTPipeline",
                hub_id="Tencent-Hunyuan/HunyuanDiT-v1.2-Diffusers-Distilled",
                defaults={"num_inference_steps": 25, "guidance_scale": 5.0, "height": 1024, "width": 1024},
            ),
        ),
        notes=(
            "Long skip connections inside the block loop: the outputs of the first num_layers/2 - 1 blocks are "
            "pushed on a stack and blocks after num_layers/2 pop them as `skip=`, so a cache that skips middle "
            "blocks must still feed the back blocks a skip for every front block it did not run. The RoPE table "
            "is built by the pipeline from the image size and passed in (`image_rotary_emb`); the prompt mask is "
            "applied by swapping padded tokens for a learned padding, no attention mask reaches the blocks. CFG is "
            "batched; the pipeline snaps sizes to ~1 MP bins unless `use_resolution_binning=False`."
        ),
    )
)
