"""ERNIE-Image (text-to-image): ``ErnieImageTransformer2DModel``.

Blocks (diffusers 0.42.1): one list, ``layers``, of ``ErnieImageSharedAdaLNBlock``s over the joint sequence
``[image, text]`` in sequence-first layout ``(S, B, H)``; each is called positionally with ``(x, rotary_pos_emb,
temb, attention_mask)`` and returns the sequence alone (pattern 3). ``temb`` is the list of six modulation tensors
the model computes once from the timestep and expands to every token ``(S, B, H)``; every block gets the same list.
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
from fastdit.parallel.tp_plan import Colwise, Rowwise, TensorParallelPlan
from fastdit.parallel.tp_shapes import attention, under

TRANSFORMER = "diffusers.models.transformers.transformer_ernie_image.ErnieImageTransformer2DModel"

_AE_CHANNELS = 4  # the VAE's latent channels; the pipeline patchifies them 2x2 for the transformer
# Wider than the transformer (32), as the released models' text (3072) differs from their width (4096): the model
# then has its text projection (``text_proj``; none when the widths are equal).
_TEXT_DIM = 48


def tiny_transformer(seed: int = 0):
    """A 3-block ``ErnieImageTransformer2DModel`` (2 heads x 16) with random output and modulation weights.

    The model zero-initialises its shared AdaLN linear and its final linear (a trained model overwrites them): with
    them zero every block is the identity and the output is 0 whatever the input, so every comparison a test makes
    would hold trivially. They are redrawn from the seed.
    """
    import torch
    from diffusers.models.transformers.transformer_ernie_image import ErnieImageTransformer2DModel

    from fastdit.testing.components.encoders import build

    model = build(
        ErnieImageTransformer2DModel,
        seed=seed,
        hidden_size=32,
        num_attention_heads=2,
        num_layers=3,
        ffn_hidden_size=64,
        in_channels=4 * _AE_CHANNELS,
        out_channels=4 * _AE_CHANNELS,
        patch_size=1,
        text_in_dim=_TEXT_DIM,
        rope_axes_dim=(4, 6, 6),
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for linear in (model.adaLN_modulation[-1], model.final_linear):
            linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator) * 0.2)
            linear.bias.copy_(torch.randn(linear.bias.shape, generator=generator) * 0.2)
    return model


def tiny_vae(seed: int = 0):
    """A two-level ``AutoencoderKLFlux2`` with 4 latent channels (its BatchNorm covers the 2x2-patchified 16)."""
    from diffusers import AutoencoderKLFlux2

    from fastdit.testing.components.encoders import build

    return build(
        AutoencoderKLFlux2,
        seed=seed,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=_AE_CHANNELS,
        norm_num_groups=8,
        sample_size=32,
    )


def tiny_ernie_image(seed: int = 0):
    """A complete tiny ``ErnieImagePipeline`` (Mistral 3 text tower, FLUX.2 VAE, no prompt enhancer)."""
    from diffusers import ErnieImagePipeline, FlowMatchEulerDiscreteScheduler

    from fastdit.testing.components.mistral3 import mistral3_model

    # The pipeline takes the bare Mistral3Model (it reads hidden_states[-2]): the generation model's .model.
    encoder, tokenizer = mistral3_model(_TEXT_DIM, seed=seed + 1)
    return ErnieImagePipeline(
        transformer=tiny_transformer(seed),
        vae=tiny_vae(seed),
        text_encoder=encoder.model,
        tokenizer=tokenizer,
        scheduler=FlowMatchEulerDiscreteScheduler(),
    )


# Context parallelism: forward patchifies, concatenates [image, text] on dim 0 (sequence-first), builds RoPE over the
# joint sequence and a key-padding mask from text_lens, then loops over the blocks and slices the first N_img tokens
# of the final layer's output. So the sequence is split at the blocks: `x` (S, B, H) on dim 0 at the first block,
# the (B, S, 1, D) RoPE table on dim 1 and the six per-token modulation tensors (S, B, H) on dim 0 at every block,
# and the last block's output is gathered before the slice. The mask (B, 1, 1, S) covers the global keys and is
# left whole: attention uses it as it is (one contiguous split: shard order is global order).
CP_PLAN = ContextParallelPlan(
    inputs={
        "layers.0": {"x": SplitInput(dim=0, expected_dims=3)},
        "layers.*": {
            "rotary_pos_emb": SplitInput(dim=1, expected_dims=4),
            "temb": SplitInput(dim=0, expected_dims=3),  # a list: each tensor split alike
        },
    },
    gather={"layers.-1": GatherOutput(dim=0, expected_dims=3)},
    attention=AttentionRouting(modules=("diffusers.models.transformers.transformer_ernie_image",)),
    notes="Sequence-first stream split on dim 0 at the blocks, RoPE and per-token modulation at every block; "
    "gathered before the image slice; the global key-padding mask whole.",
)

# Tensor parallelism: attention by heads (the processor unflattens by attn.heads: divided; QK-norms per head), the
# GELU-gated FFN's gate_proj / up_proj column-wise and linear_fc2 row-wise. The AdaLN modulation is one model-level
# linear shared by every block: whole.
TP_PLAN = TensorParallelPlan(
    layers=under(
        "layers.*",
        {
            **attention("self_attention"),
            "mlp.gate_proj": Colwise(),
            "mlp.up_proj": Colwise(),
            "mlp.linear_fc2": Rowwise(),
        },
    ),
    divide=("layers.*.self_attention.heads",),
    notes="Attention by heads, gated FFN by hidden size; the shared AdaLN linear whole.",
)

_CALL = {
    "prompt": "a cat holding a sign",
    "negative_prompt": "blurry",
    "height": 32,
    "width": 32,
    "num_inference_steps": 2,
    "guidance_scale": 4.0,
    "use_pe": False,
}

# The pipeline passes the same padded text (text_bth, [uncond, cond] batched once before the loop) and text_lens at
# every step: the text projection, applied to text_bth directly, repeats. Not `pos_embed`: its ids are built in
# forward from text_lens and the latent's height and width, which no declared input pins down (two latents of
# transposed sizes give ids of one shape).
STEP_INVARIANT = (StepInvariant("text_proj", inputs=("text_bth",)),)

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "layers": (
        ("self_attention.to_q", "self_attention.to_k", "self_attention.to_v"),
        ("mlp.up_proj", "mlp.gate_proj"),
    ),
}

ADAPTER = register(
    ModelAdapter(
        family="ernie_image",
        fused_projections=FUSED_PROJECTIONS,
        # hidden_states is (batch, channels, height, width).
        latent=LatentLayout(),
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="layers", pattern=ForwardPattern.P3, hidden_arg="x"),),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        step_invariant=STEP_INVARIANT,
        tiny_pipelines=(TinyPipeline(name="t2i", build=tiny_ernie_image, call_kwargs=_CALL),),
        presets=(
            ModelPreset(
                name="ernie-image",
                pipeline_class="diffusers.ErnieImagePipeline",
                hub_id="baidu/ERNIE-Image",
                defaults={"num_inference_steps": 50, "guidance_scale": 4.0, "height": 1024, "width": 1024},
            ),
        ),
        notes=(
            "Sequence-first (S, B, H) stream over [image, text]; the text of every prompt is padded to the longest "
            "and masked by `text_lens` (a key-padding mask). One shared AdaLN modulation, expanded per token. CFG "
            "is batched ([uncond, cond] in one call), no cache contexts. The optional prompt enhancer (`pe`, a "
            "Ministral 3 LM) rewrites prompts before encoding; the tiny pipeline has none (`use_pe=False`)."
        ),
    )
)
