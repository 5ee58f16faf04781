"""Bria FIBO 2.0 (text-to-image and multi-image editing): ``BriaFibo2Transformer2DModel``.

Blocks (diffusers 0.42.1): Z-Image's single-stream block. The forward patchifies the image (and the images to edit,
as clean context tokens), runs the ``noise_refiner`` blocks over ``[image, context]``, squeezes the first text bundle
into gist tokens with a Perceiver resampler, then runs the main ``layers`` over ``[gist, image, context]`` (the gist
last when a batch pads it). Every block is called with the stream ``x`` positionally and ``(attn_mask, freqs_cis)``
positionally, the rest by keyword, and returns the stream alone (pattern 3). The blocks listed in
``injection_layer_ids`` also cross-attend to their own text bundle. Only the image tokens reach the final layer.
"""

from __future__ import annotations

from fastdit.models._lazy import LazyKwargs, tiny_image
from fastdit.models.base import BlockGroup, ForwardPattern, LatentLayout, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, SplitInput
from fastdit.parallel.plan_shapes import TOKENS
from fastdit.parallel.tp_plan import Colwise, Rowwise, TensorParallelPlan
from fastdit.parallel.tp_shapes import attention, under

TRANSFORMER = "diffusers.models.transformers.transformer_bria_fibo2.BriaFibo2Transformer2DModel"

_LATENT_CHANNELS = 4
_TEXT_DIM = 16
# The pipeline reads Qwen3-VL hidden states up to index 35 (six bundles of three layers, a module constant of the
# pipeline), so the tiny encoder has 36 layers; a bundle concatenates three of them.
_TEXT_LAYERS = 36
_INJECTION = (1,)  # the transformer reads bundle 0 (Perceiver) and one bundle per injection block


def tiny_transformer(seed: int = 0):
    """A ``BriaFibo2Transformer2DModel`` of 1 refiner and 3 main blocks (block 1 injects text), 2 heads x 16."""
    from diffusers.models.transformers.transformer_bria_fibo2 import BriaFibo2Transformer2DModel

    from fastdit.testing.components.encoders import build

    return build(
        BriaFibo2Transformer2DModel,
        seed=seed,
        in_channels=_LATENT_CHANNELS,
        patch_size=2,
        dim=32,
        n_layers=3,
        n_refiner_layers=1,
        n_heads=2,
        cap_feat_dim=3 * _TEXT_DIM,
        injection_layer_ids=_INJECTION,
        perceiver_num_layers=1,
        min_num_gist_tokens=4,
        max_num_gist_tokens=8,
        gist_step=4,
        gist_min_text_len=8,
        gist_max_text_len=64,
        axes_dims=(4, 6, 6),
        # Axis 0 holds the gist positions, then one plane for the image and one per image to edit (up to 5).
        axes_lens=(16, 64, 64),
    )


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
        latent_channels=_LATENT_CHANNELS,
        norm_num_groups=8,
        sample_size=32,
    )


def tiny_bria_fibo2(seed: int = 0):
    """A complete tiny ``BriaFibo2Pipeline`` (36-layer Qwen3-VL with a one-block vision tower, FLUX.2 VAE)."""
    from diffusers import BriaFibo2Pipeline, FlowMatchEulerDiscreteScheduler
    from transformers import Qwen3VLForConditionalGeneration

    from fastdit.testing.components.encoders import build
    from fastdit.testing.components.qwen3_vl import qwen3_vl_model, qwen3_vl_processor

    # The pipeline calls the generation model (output_hidden_states); the component builds the bare model's config.
    encoder, tokenizer = qwen3_vl_model(hidden_size=_TEXT_DIM, num_layers=_TEXT_LAYERS, seed=seed + 1)
    return BriaFibo2Pipeline(
        transformer=tiny_transformer(seed),
        scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True),
        vae=tiny_vae(seed),
        text_encoder=build(Qwen3VLForConditionalGeneration, encoder.config, seed=seed + 1),
        processor=qwen3_vl_processor(tokenizer),
    )


# Context parallelism: forward builds the sequences itself (patchify, refiner, gist tokens prepended) and the final
# layer slices the image tokens by their global offset, so the split happens at the blocks, as for Z-Image. Every
# block gets the stream `x`, the RoPE table `freqs_cis` (1, S, D/2) and the per-token noise mask, the last two the
# same full-length tensors for every block of a list: the refiner blocks split all three and gather their output
# (the refiner's sequence is then extended by the gist tokens), the main layers split `x` at the first layer, the
# table and mask at every layer, and the last layer's output is gathered before the slice. The key-padding mask of a
# padded gist is (B, S) over the global sequence: left whole, attention reads it as it is. The Perceiver (gist tokens
# from the replicated text) and the injection blocks' cross-attention to the text run locally.
_PER_TOKEN = SplitInput(dim=1, expected_dims=2)
CP_PLAN = ContextParallelPlan(
    inputs={
        "noise_refiner.*": {"x": TOKENS, "freqs_cis": TOKENS, "noise_mask": _PER_TOKEN},
        "layers.0": {"x": TOKENS},
        "layers.*": {"freqs_cis": TOKENS, "noise_mask": _PER_TOKEN},
    },
    gather={"noise_refiner.*": GatherOutput(dim=1, expected_dims=3), "layers.-1": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(
        modules=("diffusers.models.transformers.transformer_bria_fibo2",),
        local=("perceiver", "layers.*.cross_attention"),
    ),
    notes="Split at the blocks (refiner per block, main layers from the first), RoPE and noise mask at every block; "
    "gathered before the final layer's image slice; Perceiver and text cross-attention local.",
)

# Tensor parallelism: the self-attention of every refiner and main block and the injection blocks' cross-attention
# (k/v from the text features) by heads (the processor unflattens by attn.heads: divided; QK-norms per head), the
# SwiGLU FFN's w1 / w3 column-wise and w2 row-wise. The per-block AdaLN linear reads a 256-wide embedding (~2 % of a
# block) and stays whole, as do the Perceiver (it runs once per call on a few hundred gist tokens), the embedders and
# the final layer.
_FFN = {"feed_forward.w1": Colwise(), "feed_forward.w3": Colwise(), "feed_forward.w2": Rowwise()}
TP_PLAN = TensorParallelPlan(
    layers={
        **under("noise_refiner.*", {**attention("attention"), **_FFN}),
        **under("layers.*", {**attention("attention"), **attention("cross_attention"), **_FFN}),
    },
    divide=("noise_refiner.*.attention.heads", "layers.*.attention.heads", "layers.*.cross_attention.heads"),
    notes="Self- and cross-attention by heads, SwiGLU by hidden size in the refiner and main blocks; AdaLN linears, "
    "the Perceiver and the final layer whole.",
)

_CALL = {
    "prompt": '{"short_description": "a cat holding a sign"}',
    "negative_prompt": "blurry",
    "height": 32,
    "width": 32,
    "num_inference_steps": 2,
    "guidance_scale": 5.0,
    "render_text_images": False,
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
        family="bria_fibo2",
        fused_projections=FUSED_PROJECTIONS,
        # hidden_states is (batch, channels, height, width). Edit references arrive apart, in context_latents.
        latent=LatentLayout(),
        transformer_classes=(TRANSFORMER,),
        # The refiner is left out of the cache's block lists, as for Z-Image: it runs every step on the image
        # tokens before the main layers, whose first block measures the step.
        block_groups=(BlockGroup(path="layers", pattern=ForwardPattern.P3, hidden_arg="x"),),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        # CFG as two unannounced calls per step; the first output is cast (.float()) before the second call, which
        # the placeholder of the rank that skips it records and replays once filled.
        cfg_pairs_by_timestep=True,
        tiny_pipelines=(
            TinyPipeline(name="t2i", build=tiny_bria_fibo2, call_kwargs=_CALL),
            TinyPipeline(
                name="edit",
                build=tiny_bria_fibo2,
                call_kwargs=LazyKwargs(
                    {**_CALL, "prompt": '{"edit_instruction": "make the cat red"}', "image": tiny_image()}
                ),
            ),
        ),
        presets=(
            ModelPreset(
                name="bria-fibo2",
                pipeline_class="diffusers.BriaFibo2Pipeline",
                hub_id="briaai/FIBO-2",
                defaults={"num_inference_steps": 30, "guidance_scale": 5.0, "height": 1024, "width": 1024},
            ),
        ),
        notes=(
            "The text enters as six bundles of three Qwen3-VL layers: a Perceiver squeezes the first into gist "
            "tokens (their count depends on the prompt length) that join the sequence, the others feed the "
            "injection blocks' cross-attention. Images to edit join as clean context tokens (timestep 0 "
            "modulation, chosen per token by a noise mask). A key-padding mask exists only when a batch pads the "
            "gist. CFG runs as two unannounced calls per step (paired by timestep for CFG parallelism)."
        ),
    )
)
