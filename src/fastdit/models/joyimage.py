"""JoyImage-Edit (instruction editing and text-to-image): ``JoyImageEditTransformer3DModel``.

Blocks (diffusers 0.42.1): one list ``double_blocks`` of ``JoyImageTransformerBlock``, called by keyword as
``block(hidden_states=img, encoder_hidden_states=txt, temb=vec, image_rotary_emb=(vis_freqs, txt_freqs))`` and
returning ``(img, txt)`` (pattern 0): a double-stream block (own modulation, norms and MLP per stream) whose joint
attention runs over ``[image, text]`` without a mask. Forward patchifies the latent with a ``Conv3d``; an edit call
passes ``(B, 2, C, T, H, W)`` (the reference image's latent and the noise as two items), which forward reorders and
folds into the time axis before patchifying. RoPE is computed inside forward by a method (no module) from the token
grid: ``vis_freqs`` (cos, sin) of shape ``(S_img, head_dim)``, and ``txt_freqs`` for the text only with
``rope_type="mrope"`` (``None`` otherwise). Nothing runs between blocks.

``JoyImageEditPipeline`` encodes the prompt (and, when editing, the reference image) with Qwen3-VL and runs CFG as
two calls per step without cache contexts. Its image processor picks the output size from a bucket table whose
smallest side is 512 px, whatever size the call asks for; the tiny pipelines swap in one that keeps the requested
size (the table's only role is that choice), so the tiny image is 64 px.
"""

from __future__ import annotations

from functools import cache

from fastdit.models._lazy import Deferred, LazyKwargs, tiny_image
from fastdit.models.base import BlockGroup, ForwardPattern, LatentLayout, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, SplitInput
from fastdit.parallel.tp_plan import Colwise, Rowwise, Style, TensorParallelPlan
from fastdit.parallel.tp_shapes import feed_forward, under

TRANSFORMER = "diffusers.models.transformers.transformer_joyimage.JoyImageEditTransformer3DModel"
_MODULE = "diffusers.models.transformers.transformer_joyimage"

TEXT_DIM = 32
LATENT_CHANNELS = 16  # the Wan 2.1 VAE's latent, whose default statistics the pipelines read
SIZE = 64  # pixels: an 8 x 8 latent (Wan VAE, x8), 4 x 4 tokens per item


def transformer_config() -> dict:
    """The tiny config both JoyImage transformers share: 3 blocks, 2 heads x 16, RoPE axes (4, 6, 6)."""
    return {
        "patch_size": [1, 2, 2],
        "in_channels": LATENT_CHANNELS,
        "hidden_size": 32,
        "num_attention_heads": 2,
        "text_dim": TEXT_DIM,
        "mlp_width_ratio": 2.0,
        "num_layers": 3,
        "rope_dim_list": [4, 6, 6],
    }


def tiny_transformer(seed: int = 0, *, rope_type: str = "rope"):
    """A 3-block ``JoyImageEditTransformer3DModel``; ``rope_type="mrope"`` also rotates the text tokens."""
    from diffusers import JoyImageEditTransformer3DModel

    from fastdit.testing.components.encoders import build

    return build(JoyImageEditTransformer3DModel, seed=seed, **transformer_config(), rope_type=rope_type)


@cache
def keep_size_image_processor_class() -> type:
    """``JoyImageEditImageProcessor`` that keeps the size it is asked for (or the image's own) instead of a bucket."""
    from diffusers.pipelines.joyimage.image_processor import JoyImageEditImageProcessor

    class KeepSizeImageProcessor(JoyImageEditImageProcessor):
        """The bucket table starts at 512 px: a tiny pipeline keeps the requested (or the image's) size."""

        def get_default_height_width(self, image=None, height=None, width=None):
            if height is not None and width is not None:
                return height, width
            first = image[0] if isinstance(image, list) else image
            return (first.size[1], first.size[0]) if first is not None else (SIZE, SIZE)

    KeepSizeImageProcessor.__module__ = __name__
    return KeepSizeImageProcessor


def components(seed: int) -> dict:
    """The parts both JoyImage pipelines share: Qwen3-VL encoder, tokenizer and processor, Wan VAE, scheduler."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from transformers import Qwen3VLForConditionalGeneration

    from fastdit.testing.components.autoencoder_kl_wan import autoencoder_kl_wan
    from fastdit.testing.components.encoders import build
    from fastdit.testing.components.qwen3_vl import qwen3_vl_model, qwen3_vl_processor

    # The pipelines hook the generation model's last decoder layer; the component builds the bare model's config.
    encoder, tokenizer = qwen3_vl_model(hidden_size=TEXT_DIM, seed=seed + 1)
    return {
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=3.0),
        "vae": autoencoder_kl_wan(seed=seed),
        "text_encoder": build(Qwen3VLForConditionalGeneration, encoder.config, seed=seed + 1),
        "tokenizer": tokenizer,
        "processor": qwen3_vl_processor(tokenizer),
    }


def tiny_joyimage_edit(seed: int = 0):
    """A complete tiny ``JoyImageEditPipeline`` (Qwen3-VL encoder, Wan 2.1 VAE, 64 px)."""
    from diffusers import JoyImageEditPipeline

    pipe = JoyImageEditPipeline(transformer=tiny_transformer(seed), **components(seed))
    pipe.vae_image_processor = keep_size_image_processor_class()(vae_scale_factor=pipe.vae_scale_factor_spatial)
    return pipe


def _reference_image():
    return tiny_image(SIZE).build()


# guidance_scale > 1: a conditional and an unconditional call per step. The edit variant passes a reference image
# (two items per call); the text-to-image variant none.
_T2I = {
    "prompt": "a cat holding a sign",
    "guidance_scale": 4.0,
    "height": SIZE,
    "width": SIZE,
    "num_inference_steps": 2,
}
_EDIT = {**_T2I, "prompt": "make the cat blue", "image": Deferred(_reference_image)}

# Context parallelism: forward builds both streams (patchify, text projection) and the RoPE tables, and the tables
# reach every block as one nested argument ((vis_cos, vis_sin), (txt_cos, txt_sin) or None), so both streams are split
# at the first block and the tables at every block, each pair along its tokens (dim 0) like its stream: the image
# pair with the image tokens, the text pair (mrope) with the text tokens. The joint attention has no mask: a rank's
# [image shard, text shard] needs no reordering. The output projection is gathered before the un-patchify.
_TOKENS = SplitInput(dim=1, expected_dims=3)
CP_PLAN = ContextParallelPlan(
    inputs={
        "double_blocks.0": {"hidden_states": _TOKENS, "encoder_hidden_states": _TOKENS},
        "double_blocks.*": {"image_rotary_emb": SplitInput(dim=0, expected_dims=2)},
    },
    gather={"proj_out": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(modules=(_MODULE,)),
    notes="Both streams split at double_blocks.0, the image (and mrope text) RoPE tables at every block; gathered "
    "after proj_out.",
)


def double_block_tp() -> dict[str, Style]:
    """A JoyImage double block under TP (paths within the block)."""
    return {
        # Fused [Q|K|V] per stream, each part split by heads; the processor chunks the local output in three and
        # unflattens with attn.heads (divided). The QK RMSNorms are over head_dim (per head): whole.
        "attn.img_attn_qkv": Colwise(segments=(1, 1, 1)),
        "attn.txt_attn_qkv": Colwise(segments=(1, 1, 1)),
        "attn.img_attn_proj": Rowwise(),
        "attn.txt_attn_proj": Rowwise(),
        **feed_forward("img_mlp"),
        **feed_forward("txt_mlp"),
    }


# Tensor parallelism: the joint attention of both streams by heads and both GELU MLPs by hidden size. The modulation
# is a per-block parameter table added to one shared time projection (condition_embedder.time_proj): whole.
TP_PLAN = TensorParallelPlan(
    layers=under("double_blocks.*", double_block_tp()),
    divide=("double_blocks.*.attn.heads",),
    notes="Fused per-stream QKV split per part by heads, output projections row-wise, both MLPs by hidden size; "
    "modulation tables and the shared time projection whole.",
)

ADAPTER = register(
    ModelAdapter(
        family="joyimage",
        # hidden_states is (batch, items, channels, frames, height, width): an edit call's reference latent and the
        # noise are two items, filtered apart.
        latent=LatentLayout(channel_dim=2, item_dims=(1,)),
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="double_blocks", pattern=ForwardPattern.P0),),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        # Two calls per step, cond then uncond, that announce no cache context; the pipeline combines them after both.
        cfg_pairs_by_timestep=True,
        tiny_pipelines=(
            TinyPipeline(name="edit", build=tiny_joyimage_edit, call_kwargs=LazyKwargs(_EDIT)),
            TinyPipeline(name="t2i", build=tiny_joyimage_edit, call_kwargs=_T2I),
        ),
        presets=(
            ModelPreset(
                name="joyimage-edit",
                pipeline_class="diffusers.JoyImageEditPipeline",
                hub_id="jdopensource/JoyAI-Image-Edit-Diffusers",
                defaults={"num_inference_steps": 40, "guidance_scale": 4.0},
            ),
        ),
        notes=(
            "Double-stream blocks with joint attention over [image, text] and no mask; an edit call carries the "
            "reference latent as a second item folded into the time axis. RoPE is built by a method inside forward "
            "(text RoPE only with rope_type='mrope'). CFG runs two unannounced calls per step (paired by timestep). "
            "The tiny pipelines replace the image processor's size buckets (512 px and up) with the requested size. "
            "No expert layers."
        ),
    )
)
