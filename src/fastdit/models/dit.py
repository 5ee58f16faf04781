"""DiT (class-conditional ImageNet DiT-XL/2): ``DiTTransformer2DModel``.

Blocks (diffusers 0.42.1): one list, ``transformer_blocks``, of ``BasicTransformerBlock``s with AdaLN-zero
modulation. Each is called with ``hidden_states`` positionally and ``(attention_mask, encoder_hidden_states=None,
encoder_attention_mask, timestep, cross_attention_kwargs, class_labels)`` by keyword, and returns the hidden states
alone (pattern 3: there is no text stream).
"""

from __future__ import annotations

from fastdit.models.base import BlockGroup, ForwardPattern, LatentLayout, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, SplitInput
from fastdit.parallel.tp_plan import TensorParallelPlan
from fastdit.parallel.tp_shapes import attention, feed_forward, modulation, under

TRANSFORMER = "diffusers.models.transformers.dit_transformer_2d.DiTTransformer2DModel"

# The pipeline takes the latent size from the transformer config: 16 latent pixels -> 32 px images.
_LATENT_SIZE = 16


def tiny_transformer(seed: int = 0):
    """A 3-block ``DiTTransformer2DModel`` with learned sigma (8 output channels) and 1000 classes."""
    from diffusers import DiTTransformer2DModel

    from fastdit.testing.components.encoders import build

    return build(
        DiTTransformer2DModel,
        seed=seed,
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=8,
        num_layers=3,
        norm_num_groups=8,
        sample_size=_LATENT_SIZE,
        patch_size=2,
        # The pipeline uses label 1000 as the unconditional class, so the label table keeps ImageNet's size.
        num_embeds_ada_norm=1000,
    )


def tiny_dit(seed: int = 0):
    """A complete tiny ``DiTPipeline`` (labels ``"zero"`` ... ``"nine"`` map to classes 0-9)."""
    from diffusers import DDIMScheduler, DiTPipeline

    from fastdit.testing.components.autoencoder_kl import autoencoder_kl

    names = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
    return DiTPipeline(
        transformer=tiny_transformer(seed),
        vae=autoencoder_kl(latent_channels=4, seed=seed),
        scheduler=DDIMScheduler(),
        id2label={i: name for i, name in enumerate(names)},
    )


# forward builds the image sequence (patch embedding plus sin-cos positions), so the split is at the first block's
# inputs; every block conditions on per-sample timestep and class labels only. AttnProcessor2_0 calls
# F.scaled_dot_product_attention itself: its module's F is routed.
CP_PLAN = ContextParallelPlan(
    inputs={"transformer_blocks.0": {"hidden_states": SplitInput(dim=1, expected_dims=3)}},
    gather={"proj_out_2": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(sdpa_modules=("diffusers.models.attention_processor",)),
    notes="Sin-cos positions added before the split at transformer_blocks.0; no RoPE, no mask.",
)

# Tensor parallelism: AttnProcessor2_0 views q/k/v with attn.heads, so attn1.heads is divided and q/k/v split by heads
# (to_out row-wise); the FFN is split by hidden size. Each block's AdaLN-zero linear (dim -> 6·dim) is split with a
# gathered output; its timestep/class embedder (norm1.emb, whose first copy also conditions the output layer) and
# the output projections stay replicated.
TP_PLAN = TensorParallelPlan(
    layers=under("transformer_blocks.*", {**attention("attn1"), **feed_forward(), **modulation("norm1.linear")}),
    divide=("transformer_blocks.*.attn1.heads",),
    notes="Attention split by heads, FFN by hidden size; per-block AdaLN-zero (6·dim) split with a gathered output; "
    "per-block timestep/class embedders replicated.",
)

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "transformer_blocks": (("attn1.to_q", "attn1.to_k", "attn1.to_v"),),
}

ADAPTER = register(
    ModelAdapter(
        family="dit",
        fused_projections=FUSED_PROJECTIONS,
        # hidden_states is (batch, channels, height, width).
        latent=LatentLayout(),
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="transformer_blocks", pattern=ForwardPattern.P3),),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        tiny_pipelines=(
            TinyPipeline(
                name="dit",
                build=tiny_dit,
                call_kwargs={"class_labels": [3], "num_inference_steps": 2, "guidance_scale": 4.0},
            ),
        ),
        presets=(
            ModelPreset(
                name="dit-xl-2-256",
                pipeline_class="diffusers.DiTPipeline",
                hub_id="facebook/DiT-XL-2-256",
                defaults={"num_inference_steps": 25, "guidance_scale": 4.0},
            ),
            ModelPreset(
                name="dit-xl-2-512",
                pipeline_class="diffusers.DiTPipeline",
                hub_id="facebook/DiT-XL-2-512",
                defaults={"num_inference_steps": 25, "guidance_scale": 4.0},
            ),
        ),
        notes=(
            "Class-conditional, no text: every block embeds `timestep` and `class_labels` itself (AdaLN-zero inside "
            "the block). CFG is batched (label 1000 is the null class). The image size is fixed by the config "
            "(`sample_size` latent pixels); sin-cos positions are added before the blocks, no RoPE, no mask."
        ),
    )
)
