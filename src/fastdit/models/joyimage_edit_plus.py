"""JoyImage-Edit-Plus (multi-reference editing): ``JoyImageEditPlusTransformer3DModel``.

The blocks are JoyImage-Edit's double-stream blocks (``double_blocks``, pattern 0, see ``joyimage.py``) with an
attention mask. What differs is the input: ``hidden_states`` are already patches, ``(B, max_patches, C, pt, ph, pw)``:
the target's noise and each reference image's latent, patchified one after the other and padded to the longest
sample, with ``shape_list`` giving every item's ``(t, h, w)`` grid. Forward embeds each patch (``Conv3d`` on one
patch), builds per-sample RoPE tables ``(B, S_img, head_dim)`` with a time offset per item (padding rows cos 1, sin
0) and, with ``encoder_hidden_states_mask``, a key-padding mask ``(B, 1, 1, S_img + S_txt)`` over ``[image, text]``
that also hides the padded patches. ``JoyImageEditPlusPipeline`` batches CFG as ``[uncond; cond]`` (the negative
prompt padded to the prompt's length) with ``shape_list * 2``.

The tiny pipelines replace the image processor's size buckets (512 px and up) with the requested size, as for
JoyImage-Edit.
"""

from __future__ import annotations

from fastdit.models._lazy import Deferred, LazyKwargs, tiny_image
from fastdit.models.base import BlockGroup, ForwardPattern, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.joyimage import (
    SIZE,
    components,
    double_block_tp,
    keep_size_image_processor_class,
    transformer_config,
)
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, SplitInput
from fastdit.parallel.tp_plan import TensorParallelPlan
from fastdit.parallel.tp_shapes import under

TRANSFORMER = "diffusers.models.transformers.transformer_joyimage_edit_plus.JoyImageEditPlusTransformer3DModel"
_MODULE = "diffusers.models.transformers.transformer_joyimage_edit_plus"


def tiny_transformer(seed: int = 0):
    """A 3-block ``JoyImageEditPlusTransformer3DModel`` (the JoyImage-Edit tiny config)."""
    from diffusers import JoyImageEditPlusTransformer3DModel

    from fastdit.testing.components.encoders import build

    return build(JoyImageEditPlusTransformer3DModel, seed=seed, **transformer_config())


def tiny_joyimage_edit_plus(seed: int = 0):
    """A complete tiny ``JoyImageEditPlusPipeline`` (Qwen3-VL encoder, Wan 2.1 VAE, 64 px)."""
    from diffusers import JoyImageEditPlusPipeline

    pipe = JoyImageEditPlusPipeline(transformer=tiny_transformer(seed), **components(seed))
    pipe.image_processor = keep_size_image_processor_class()(vae_scale_factor=pipe.vae_scale_factor_spatial)
    return pipe


def _references() -> list:
    # Two references of different sizes: the items' grids differ and the RoPE time offsets step over both.
    return [[tiny_image(SIZE).build(), tiny_image(SIZE // 2).build()]]


_T2I = {
    "prompt": "a cat holding a sign",
    "guidance_scale": 4.0,
    "height": SIZE,
    "width": SIZE,
    "num_inference_steps": 2,
}
_EDIT = {**_T2I, "prompt": "put the cat on the sofa", "images": Deferred(_references)}

# Context parallelism: forward embeds the patches and builds the per-sample RoPE tables and the mask over the whole
# padded sequence, so the streams are split at the first block and the RoPE (cos, sin) pair (B, S_img, head_dim) at
# every block with the image tokens. The key-padding mask indexes the global [image, text] sequence and stays whole:
# attention reorders it into the ranks' shard order (mask_segments). The output projection is gathered.
_TOKENS = SplitInput(dim=1, expected_dims=3)
CP_PLAN = ContextParallelPlan(
    inputs={
        "double_blocks.0": {"hidden_states": _TOKENS, "encoder_hidden_states": _TOKENS},
        "double_blocks.*": {"image_rotary_emb": _TOKENS},
    },
    gather={"proj_out": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(modules=(_MODULE,), mask_segments=("hidden_states", "encoder_hidden_states")),
    notes="Both streams split at double_blocks.0, the per-sample RoPE tables at every block; the global [image, text] "
    "key-padding mask reordered into shard order; gathered after proj_out.",
)

TP_PLAN = TensorParallelPlan(
    layers=under("double_blocks.*", double_block_tp()),
    divide=("double_blocks.*.attn.heads",),
    notes="As JoyImage-Edit: fused per-stream QKV split per part by heads, output projections row-wise, both MLPs by "
    "hidden size; modulation tables and the shared time projection whole.",
)

ADAPTER = register(
    ModelAdapter(
        family="joyimage_edit_plus",
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="double_blocks", pattern=ForwardPattern.P0),),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        # shape_list (per-sample item grids, a list) is duplicated for CFG: it passes whole, and forward reads the
        # entries of the rank's half of the batch (identical halves).
        tiny_pipelines=(
            TinyPipeline(name="edit", build=tiny_joyimage_edit_plus, call_kwargs=LazyKwargs(_EDIT)),
            TinyPipeline(name="t2i", build=tiny_joyimage_edit_plus, call_kwargs=_T2I),
        ),
        presets=(
            ModelPreset(
                name="joyimage-edit-plus",
                pipeline_class="diffusers.JoyImageEditPlusPipeline",
                hub_id="jdopensource/JoyAI-Image-Edit-Plus-Diffusers",
                defaults={"num_inference_steps": 30, "guidance_scale": 4.0},
            ),
        ),
        notes=(
            "Input is a padded sequence of patches (target noise, then each reference latent) with per-item grids in "
            "shape_list; per-sample RoPE with a time offset per item and a key-padding mask over [image, text] hiding "
            "padded patches and text. CFG is batched as [uncond; cond]. The tiny pipelines replace the image "
            "processor's size buckets (512 px and up) with the requested size. No expert layers."
            " No spectral signal: hidden_states arrives as patches (batch, patches, channels, pt, ph, pw), the "
            "target's and each reference's side by side and padded: no grid to filter."
        ),
    )
)
