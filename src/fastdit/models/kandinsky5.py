"""Kandinsky 5 (T2V, I2V, T2I): ``Kandinsky5Transformer3DModel``.

Blocks (diffusers 0.42.1): two lists. ``text_transformer_blocks`` (``Kandinsky5TransformerEncoderBlock``, called
positionally as ``block(x, time_embed, rope)``, returning ``x``) first refine the text tokens alone; then
``visual_transformer_blocks`` (``Kandinsky5TransformerDecoderBlock``, called positionally as ``block(visual_embed,
text_embed, time_embed, rope, sparse_params)``, returning ``visual_embed``: pattern 2) denoise the visual tokens with
cross-attention to the text. The adapter declares only the visual list: the text blocks see no latent (their output
depends on the prompt and the timestep alone), so a cache must not take its decision from them.
"""

from __future__ import annotations

import copy

from fastdit.models._lazy import LazyKwargs, tiny_image
from fastdit.models.base import BlockGroup, ForwardPattern, LatentLayout, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, SplitInput
from fastdit.parallel.tp_plan import Colwise, Rowwise, TensorParallelPlan
from fastdit.parallel.tp_shapes import attention, modulation, under

TRANSFORMER = "diffusers.models.transformers.transformer_kandinsky.Kandinsky5Transformer3DModel"

_LATENT = 4  # the tiny HunyuanVideo VAE's channels; the tiny image VAE uses the same
_TEXT_DIM = 32  # tiny Qwen2.5-VL hidden size
_POOLED_DIM = 32  # tiny CLIP hidden size
_SIZE = 32

# A short chat prompt in the pipelines' format (the real one is a ~128-token system prompt).
_TEMPLATE = "<|im_start|>system\nDescribe the video.<|im_end|>\n<|im_start|>user\n{}<|im_end|>"


def tiny_transformer(seed: int = 0, *, visual_cond: bool = False, patch_size: tuple[int, int, int] = (1, 2, 2)):
    """A 1 text + 3 visual block ``Kandinsky5Transformer3DModel``; ``visual_cond`` adds the I2V frame channels."""
    from diffusers import Kandinsky5Transformer3DModel

    from fastdit.testing.components.encoders import build

    return build(
        Kandinsky5Transformer3DModel,
        seed=seed,
        in_visual_dim=_LATENT,
        out_visual_dim=_LATENT,
        in_text_dim=_TEXT_DIM,
        in_text_dim2=_POOLED_DIM,
        time_dim=16,
        patch_size=patch_size,
        model_dim=32,
        ff_dim=64,
        num_text_blocks=1,
        num_visual_blocks=3,
        axes_dims=(4, 6, 6),
        visual_cond=visual_cond,
    )


def _components(seed: int, transformer, vae) -> dict:
    from diffusers import FlowMatchEulerDiscreteScheduler

    from fastdit.testing.components.encoders import clip_text_model, qwen2_5_vl_model
    from fastdit.testing.components.qwen2_5_vl import qwen2_vl_processor

    text_encoder, tokenizer = qwen2_5_vl_model(hidden_size=_TEXT_DIM, seed=seed)
    text_encoder_2, tokenizer_2 = clip_text_model(hidden_size=_POOLED_DIM, seed=seed + 1)
    return {
        "transformer": transformer,
        "vae": vae,
        "text_encoder": text_encoder,
        # The pipelines tokenize through a Qwen2-VL processor (text only here).
        "tokenizer": qwen2_vl_processor(copy.deepcopy(tokenizer)),
        "text_encoder_2": text_encoder_2,
        "tokenizer_2": tokenizer_2,
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=5.0),
    }


def _shrink(pipe):
    """Swap in the short prompt template and its token offset (instance attributes the pipelines set in __init__)."""
    pipe.prompt_template = _TEMPLATE
    prefix = _TEMPLATE.split("{}")[0]
    pipe.prompt_template_encode_start_idx = len(pipe.tokenizer(text=[prefix])["input_ids"][0])
    return pipe


def tiny_kandinsky5_t2v(seed: int = 0):
    """A complete tiny ``Kandinsky5T2VPipeline`` (Qwen2.5-VL + CLIP text, HunyuanVideo VAE)."""
    from diffusers import Kandinsky5T2VPipeline

    from fastdit.testing.components.autoencoder_kl_hunyuan_video import autoencoder_kl_hunyuan_video

    vae = autoencoder_kl_hunyuan_video(latent_channels=_LATENT, seed=seed)
    return _shrink(Kandinsky5T2VPipeline(**_components(seed, tiny_transformer(seed), vae)))


def tiny_kandinsky5_i2v(seed: int = 0):
    """A complete tiny ``Kandinsky5I2VPipeline`` (the first latent frame conditions the rest)."""
    from diffusers import Kandinsky5I2VPipeline

    from fastdit.testing.components.autoencoder_kl_hunyuan_video import autoencoder_kl_hunyuan_video

    transformer = tiny_transformer(seed, visual_cond=True)
    vae = autoencoder_kl_hunyuan_video(latent_channels=_LATENT, seed=seed)
    return _shrink(Kandinsky5I2VPipeline(**_components(seed, transformer, vae)))


def tiny_kandinsky5_t2i(seed: int = 0):
    """A complete tiny ``Kandinsky5T2IPipeline`` (one frame, Flux-style 2D VAE)."""
    from diffusers import Kandinsky5T2IPipeline

    from fastdit.testing.components.autoencoder_kl import autoencoder_kl

    vae = autoencoder_kl(latent_channels=_LATENT, num_levels=4, scaling_factor=0.3611, shift_factor=0.1159, seed=seed)
    pipe = _shrink(Kandinsky5T2IPipeline(**_components(seed, tiny_transformer(seed), vae)))
    # The pipeline snaps any size to its list of ~1 MP resolutions; the tiny one allows 32x32 only.
    pipe.resolutions = [(_SIZE, _SIZE)]
    return pipe


_CALL = {
    "prompt": "a cat holding a sign",
    "negative_prompt": "blue",
    "height": _SIZE,
    "width": _SIZE,
    "num_frames": 5,
    "num_inference_steps": 2,
    "guidance_scale": 5.0,
    "max_sequence_length": 16,
}

# The T2I pipeline makes one frame; it takes no num_frames.
_T2I_CALL = {k: v for k, v in _CALL.items() if k != "num_frames"}

# Context parallelism: the visual sequence only exists after patch embedding and flattening inside forward, so it is
# split at the first visual block; forward passes the same flattened 3-D RoPE table (B, S, 1, D/2, 2, 2) to every
# block, so it is split on dim 1 at each of them (the blocks take both positionally). Forward reshapes the tokens to
# the (T, H, W) grid between the last visual block and out_layer, so the sequence is gathered at the last visual
# block's output. The text is replicated: its encoder blocks run on the whole text before the split, and the visual
# blocks' cross-attention attends from local visual tokens to the whole text, so both stay ordinary local attention.
CP_PLAN = ContextParallelPlan(
    inputs={
        "visual_transformer_blocks.0": {"visual_embed": SplitInput(dim=1, expected_dims=3)},
        "visual_transformer_blocks.*": {"rope": SplitInput(dim=1, expected_dims=6)},
    },
    gather={"visual_transformer_blocks.-1": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(
        modules=("diffusers.models.transformers.transformer_kandinsky",),
        local=("text_transformer_blocks", "visual_transformer_blocks.*.cross_attention"),
    ),
    notes=(
        "Visual tokens split at visual_transformer_blocks.0, their RoPE table at every visual block; gathered at the "
        "last visual block (before the (T, H, W) reshape); text replicated, its self-attention and the "
        "cross-attention local. The sparse (NABLA) attention of the Pro models builds its block mask from the "
        "local shard: not supported."
    ),
)

# Tensor parallelism, for the text encoder blocks and the visual decoder blocks alike (same attention and FFN
# modules, as large as each other): every attention's to_query/to_key/to_value column-wise and out_layer row-wise; the
# processor reshapes with attn.num_heads, so it is divided. The QK-norms are RMSNorm over head_dim and the RoPE
# tables broadcast over heads: both per head, replicated; the NABLA block mask is estimated per head, so local heads
# build their own. The FFN's in_layer is column-wise, its out_layer row-wise. The per-block AdaLN modulation
# (time_dim -> 6 model_dim for text blocks, 9 model_dim for visual blocks, chunked on the feature dim) is split with
# a gathered output. Replicated: the embeddings and out_layer (its 2 model_dim modulation is one, global).
_ATTENTION = ("to_query", "to_key", "to_value")
_FEED_FORWARD = {"feed_forward.in_layer": Colwise(), "feed_forward.out_layer": Rowwise()}
TP_PLAN = TensorParallelPlan(
    layers={
        **under(
            "text_transformer_blocks.*",
            {
                **attention("self_attention", qkv=_ATTENTION, out="out_layer"),
                **_FEED_FORWARD,
                **modulation("text_modulation.out_layer"),
            },
        ),
        **under(
            "visual_transformer_blocks.*",
            {
                **attention("self_attention", qkv=_ATTENTION, out="out_layer"),
                **attention("cross_attention", qkv=_ATTENTION, out="out_layer"),
                **_FEED_FORWARD,
                **modulation("visual_modulation.out_layer"),
            },
        ),
    },
    divide=(
        "text_transformer_blocks.*.self_attention.num_heads",
        "visual_transformer_blocks.*.self_attention.num_heads",
        "visual_transformer_blocks.*.cross_attention.num_heads",
    ),
    notes="Text and visual blocks: attention and FFN split, per-block AdaLN modulation split with a gathered output; "
    "QK-norms and RoPE per head replicated; out_layer and its global modulation replicated.",
)

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "visual_transformer_blocks": (
        ("self_attention.to_query", "self_attention.to_key", "self_attention.to_value"),
        ("cross_attention.to_key", "cross_attention.to_value"),
    ),
}

ADAPTER = register(
    ModelAdapter(
        family="kandinsky5",
        fused_projections=FUSED_PROJECTIONS,
        # hidden_states is (batch, frames, height, width, channels); image-to-video appends the first frame's
        # latents and a mask as channels, which stay put: they dilute the signal.
        latent=LatentLayout(channel_dim=-1),
        # CFG as two unannounced calls per step, each output used only after both: paired by timestep.
        cfg_pairs_by_timestep=True,
        transformer_classes=(TRANSFORMER,),
        block_groups=(
            BlockGroup(
                path="visual_transformer_blocks",
                pattern=ForwardPattern.P2,
                hidden_arg="visual_embed",
                encoder_arg="text_embed",
            ),
        ),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        tiny_pipelines=(
            TinyPipeline(name="t2v", build=tiny_kandinsky5_t2v, call_kwargs=_CALL),
            # I2V renormalises the first 4 latent frames against the next ones: it needs 5 latent frames (17 frames).
            TinyPipeline(
                name="i2v",
                build=tiny_kandinsky5_i2v,
                call_kwargs=LazyKwargs({**_CALL, "image": tiny_image(_SIZE), "num_frames": 17}),
            ),
            TinyPipeline(name="t2i", build=tiny_kandinsky5_t2i, call_kwargs=_T2I_CALL),
        ),
        presets=(
            ModelPreset(
                name="kandinsky5-lite-t2v",
                pipeline_class="diffusers.Kandinsky5T2VPipeline",
                hub_id="kandinskylab/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers",
                defaults={
                    "num_inference_steps": 50,
                    "guidance_scale": 5.0,
                    "height": 512,
                    "width": 768,
                    "num_frames": 121,
                },
            ),
            ModelPreset(
                name="kandinsky5-lite-i2v",
                pipeline_class="diffusers.Kandinsky5I2VPipeline",
                hub_id="kandinskylab/Kandinsky-5.0-I2V-Lite-5s-Diffusers",
                defaults={
                    "num_inference_steps": 50,
                    "guidance_scale": 5.0,
                    "height": 512,
                    "width": 768,
                    "num_frames": 121,
                },
            ),
            ModelPreset(
                name="kandinsky5-lite-t2i",
                pipeline_class="diffusers.Kandinsky5T2IPipeline",
                hub_id="kandinskylab/Kandinsky-5.0-T2I-Lite-sft-Diffusers",
                defaults={"num_inference_steps": 50, "guidance_scale": 3.5, "height": 1024, "width": 1024},
            ),
        ),
        notes=(
            "Only visual_transformer_blocks are declared: text_transformer_blocks (pattern 3, hidden_arg 'x') run "
            "first on the text alone and always compute. Visual tokens are flattened from the (T, H, W) grid, in "
            "block ('fractal') order when sparse attention is on (Pro models), and 3-D RoPE follows that order. "
            "CFG runs as two calls per step without cache_context."
        ),
    )
)
