"""Wan-Animate-2 (character animation with an in-context reference): ``WanAnimate2Transformer3DModel``.

Not a variant of Wan-Animate (``wan_animate.py``): its own blocks, attention and conditioning. Blocks (diffusers
0.42.1): one list ``blocks`` of ``WanAnimate2TransformerBlock``, called as ``block(hidden_states, kv_cache=...,
**block_kwargs)`` with ``encoder_hidden_states`` by keyword, returning ``hidden_states`` (pattern 2). A segment runs
the transformer twice over: once with ``kv_cache_mode="extract"`` on the driving video (every block stores its
pre-RoPE keys and values in a ``WanAnimate2KVCache``), at the first step's timestep; then once per step and branch
with ``kv_cache_mode="cached"``, where each block's self-attention packs the generation tokens and the cached reference
tokens into one buffer laid out by frame and runs flex attention with a ``BlockMask`` (every generation frame sees all
generation tokens and the reference tokens of its own frame). The unconditional branch passes ``is_uncondtion=True``,
and the loop then skips block 9.

Cache: the reference pass is declared an unstepped call (``unstepped_calls``): it computes every block, so the KV
cache is filled in full, and it is no step of either branch. Block 9 missing from the unconditional calls is a middle
block for every usual ``fn`` / ``bn`` (the segment's residual spans what the branch computed); a cache plan whose
front, back or segment-last block is block 9 would lose that role on the unconditional branch.

diffusers 0.42.1 serves this model through ``WanAnimate2ModularPipeline`` only (a ModularPipeline), which fastdit
drives through :mod:`fastdit.modular`. The tiny pipeline (:func:`tiny_pipeline`) is that pipeline with every component
built from a small config: one segment of 5 frames at 16 x 16 pixels (one token a latent frame), a CLIP vision tower
1280 wide (``img_emb``'s fixed input width) over 224-pixel inputs in 49 patches of 32 pixels. Its loop decodes each
segment inside the denoise step and keeps no latents, so its "latent" output is the decoded video. The tests of the
bare transformer run :func:`tiny_animate`, the modular loop's calls.
"""

from __future__ import annotations

import itertools
import types
from typing import Any

import torch

from fastdit.models._lazy import Deferred, LazyKwargs
from fastdit.models.base import BlockGroup, ForwardPattern, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, HeadParallel, SplitInput
from fastdit.parallel.tp_plan import Colwise, Rowwise, ShardedNorm, Style, TensorParallelPlan
from fastdit.parallel.tp_shapes import attention, under

TRANSFORMER = "diffusers.models.transformers.transformer_wan_animate_2.WanAnimate2Transformer3DModel"

_LAYERS = 12  # block 9, which the unconditional branch skips, is a middle block under fn=1 with bn 0 or 1
_TEXT_DIM = 16
_CLIP_DIM = 1280  # img_emb's input width is fixed by the model
_LATENT = 16
_GRID = (8, 8)  # latent height, width: 4 x 4 tokens a frame
_REFERENCE_FRAMES = 2
_ORIGIN_LEN = 8  # pixel frames of the segment: (8 // 4 + 1) = 3 generation latent frames


def tiny_transformer(seed: int = 0):
    """A 12-block ``WanAnimate2Transformer3DModel``, 2 heads of 12, with the CLIP image branch; it builds its flex
    BlockMask eagerly (:func:`_build_masks_eagerly`)."""
    from diffusers import WanAnimate2Transformer3DModel

    from fastdit.testing.components.encoders import build

    transformer = build(
        WanAnimate2Transformer3DModel,
        seed=seed,
        patch_size=(1, 2, 2),
        text_len=8,
        in_dim=2 * _LATENT + 4,
        dim=24,
        ffn_dim=32,
        freq_dim=16,
        text_dim=_TEXT_DIM,
        out_dim=_LATENT,
        num_heads=2,
        num_layers=_LAYERS,
    )
    _build_masks_eagerly(transformer)
    return transformer


def _create_block_mask_eagerly(*args: Any, _compile: bool = False, **kwargs: Any) -> Any:
    """``create_block_mask`` with the class's ``_compile=True`` dropped."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(*args, **kwargs)


def _build_masks_eagerly(transformer: torch.nn.Module) -> None:
    """Give ``transformer`` the class's ``create_mask`` with ``create_block_mask`` evaluated eagerly.

    The class builds its BlockMask through ``create_block_mask(..., _compile=True)``, an inductor compile of the mask
    function (C++ on CPU): 5-12 s in every process that first builds one and again for each new mask shape, while
    evaluating the tiny mask (at most a few hundred tokens a side) eagerly takes milliseconds. The BlockMask is the
    same either way (flex attention itself runs unfused, uncompiled, on the tiny model in both cases), so the outputs
    are bit-identical. The class's own code still builds the mask: only the name ``create_block_mask`` it calls is
    rebound, on this instance alone (a copy of the method over a copy of its module's globals), so nothing global is
    patched and a transformer loaded with ``from_pretrained`` keeps the compiled path.
    """
    method = type(transformer).create_mask
    namespace = {**method.__globals__, "create_block_mask": _create_block_mask_eagerly}
    eager = types.FunctionType(method.__code__, namespace, method.__name__, method.__defaults__, method.__closure__)
    eager.__kwdefaults__ = method.__kwdefaults__  # not taken by the constructor: keyword-only defaults stay too
    transformer.create_mask = types.MethodType(eager, transformer)


def tiny_pipeline() -> Any:
    """``WanAnimate2ModularPipeline`` with tiny components: a UMT5 encoder 16 wide, a 1-layer CLIP vision tower, the
    tiny Wan 2.1 VAE, the 12-block transformer of :func:`tiny_transformer`, a flow-matching Euler scheduler."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanAnimate2ModularPipeline
    from transformers import CLIPVisionConfig, CLIPVisionModel

    from fastdit.testing.components.autoencoder_kl_wan import autoencoder_kl_wan
    from fastdit.testing.components.encoders import build, umt5_encoder

    text_encoder, tokenizer = umt5_encoder(d_model=_TEXT_DIM, seed=1)
    clip = CLIPVisionConfig(
        hidden_size=_CLIP_DIM,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=224,  # the encode step resizes every frame to 224 x 224
        # 49 patches of 32 pixels: the encode step reads the embeddings (hidden_states[-2]), whose width img_emb
        # fixes at 1280; a 112-pixel patch kernel made its one-thread convolution most of the pipeline's run time
        # and its 48M weights most of the build.
        patch_size=32,
    )
    pipe = WanAnimate2ModularPipeline()
    pipe.update_components(
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        image_encoder=build(CLIPVisionModel, clip, seed=2),
        vae=autoencoder_kl_wan(seed=3),
        transformer=tiny_transformer(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
    )
    return pipe


def _frames(count: int, size: int, seed: int) -> list:
    """``count`` random RGB frames of ``size`` squared pixels (deterministic)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(count)]


def _image(size: int, seed: int) -> Any:
    return _frames(1, size, seed)[0]


_PIXELS = 16
_CALL = {
    "prompt": "a dancer",
    "negative_prompt": "blurry",
    "image": Deferred(_image, (_PIXELS, 0)),
    "driving_video": Deferred(_frames, (5, _PIXELS, 1)),
    "height": _PIXELS,
    "width": _PIXELS,
    "segment_frame_length": 5,
    "max_sequence_length": 8,  # the tiny transformer's text_len
    "num_inference_steps": 2,
}


def _inputs(seed: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed + 1)
    frames = _ORIGIN_LEN // 4 + 1
    height, width = _GRID

    def noise(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    return {
        "reference": noise(_LATENT, _REFERENCE_FRAMES, height, width),
        "reference_condition": noise(_LATENT + 4, _REFERENCE_FRAMES, height, width),
        "latents": noise(_LATENT, frames, height, width),
        "condition": noise(_LATENT + 4, frames, height, width),
        "prompt": noise(5, _TEXT_DIM),
        "negative": noise(3, _TEXT_DIM),
        "clip": noise(1, 4, _CLIP_DIM),
        "grid_ref": torch.tensor([[_REFERENCE_FRAMES, height // 2, width // 2]]),
    }


def _extract(transformer: torch.nn.Module, inputs: dict[str, Any], timestep: torch.Tensor, kv_cache: Any) -> None:
    """The reference pass: fills ``kv_cache`` from the driving video (the first step's timestep, as the loop does)."""
    transformer(
        [inputs["reference"]],
        timestep=timestep,
        encoder_hidden_states=[inputs["prompt"]],
        encoder_hidden_states_image=inputs["clip"],
        condition_latents=[inputs["reference_condition"]],
        kv_cache=kv_cache,
        kv_cache_mode="extract",
        seq_len=inputs["reference"][0].numel() // 4,
        offset_grid_sizes=inputs["grid_ref"],
    )


def _step_call(inputs: dict[str, Any], latents: torch.Tensor, timestep: torch.Tensor, kv_cache: Any, uncond: bool):
    return {
        "hidden_states": [latents],
        "timestep": timestep,
        "encoder_hidden_states": [inputs["negative" if uncond else "prompt"]],
        "encoder_hidden_states_image": inputs["clip"],
        "condition_latents": [inputs["condition"]],
        "kv_cache": kv_cache,
        "kv_cache_mode": "cached",
        "seq_len": latents[0].numel() // 4,
        "reference_grid_sizes": inputs["grid_ref"],
        "origin_len": _ORIGIN_LEN,
        "origin_area": [8 * _GRID[0], 8 * _GRID[1]],
        "is_uncondtion": uncond,
        "return_dict": False,
    }


def example(seed: int = 0) -> tuple[torch.nn.Module, dict[str, Any]]:
    """A tiny transformer, its KV cache filled, and one conditional step call (for ``fastdit inspect``)."""
    from diffusers.models.transformers.transformer_wan_animate_2 import WanAnimate2KVCache

    transformer = tiny_transformer(seed)
    inputs = _inputs(seed)
    kv_cache = WanAnimate2KVCache(_LAYERS)
    with torch.no_grad():
        _extract(transformer, inputs, torch.tensor([1000.0]), kv_cache)
    return transformer, _step_call(inputs, inputs["latents"], torch.tensor([1000.0]), kv_cache, uncond=False)


def tiny_animate(transformer: torch.nn.Module, steps: int = 3, seed: int = 0, guidance: float = 3.0) -> torch.Tensor:
    """One segment as the modular loop runs it: a reference pass, then per step a conditional and an unconditional
    call (unannounced), combined with classifier-free guidance, Euler steps from 1000 down."""
    from diffusers.models.transformers.transformer_wan_animate_2 import WanAnimate2KVCache

    inputs = _inputs(seed)
    kv_cache = WanAnimate2KVCache(len(transformer.blocks))
    timesteps = torch.linspace(1000.0, 0.0, steps + 1)
    latents = inputs["latents"]
    with torch.no_grad():
        _extract(transformer, inputs, timesteps[:1], kv_cache)
        for t, following in itertools.pairwise(timesteps):
            timestep = t.reshape(1)
            cond = transformer(**_step_call(inputs, latents, timestep, kv_cache, uncond=False))[0][0]
            uncond = transformer(**_step_call(inputs, latents, timestep, kv_cache, uncond=True))[0][0]
            latents = latents + (following - t) / 1000.0 * (uncond + guidance * (cond - uncond))
    return latents


def _attention(path: str, *, image: bool) -> dict[str, Style]:
    layers = {**attention(path), f"{path}.norm_q": ShardedNorm(), f"{path}.norm_k": ShardedNorm()}
    if image:
        layers.update(
            {f"{path}.add_k_proj": Colwise(), f"{path}.add_v_proj": Colwise(), f"{path}.norm_added_k": ShardedNorm()}
        )
    return layers


# Tensor parallelism: self- and cross-attention by heads (q/k/v column-wise, to_out.0 row-wise, heads divided: the
# processors unflatten with them); their QK-norms are RMSNorms over the whole width, so ShardedNorm. Each rank's KV
# cache holds its heads' reference keys and values, written by the reference pass and read by the steps on the same
# rank; the flex BlockMask is built for every head alike (H=None). The CLIP branch of cross-attention (add_k/add_v,
# norm_added_k) likewise; optional for a model without it. FFN (Linear, GELU, Linear) split; modulation tables whole.
TP_PLAN = TensorParallelPlan(
    layers=under(
        "blocks.*",
        {
            **_attention("self_attn", image=False),
            **_attention("cross_attn", image=True),
            "ffn.0": Colwise(),
            "ffn.2": Rowwise(),
        },
    ),
    divide=("blocks.*.self_attn.heads", "blocks.*.cross_attn.heads"),
    optional=tuple(f"blocks.*.cross_attn.{name}" for name in ("add_k_proj", "add_v_proj", "norm_added_k")),
    notes="Self- and cross-attention by heads (QK-norms over the width as ShardedNorm; each rank caches its heads' "
    "reference K/V), FFN split; modulation, embeddings, head and CLIP projection whole.",
)

# Context parallelism: forward patch-embeds and checks the token count before the loop, so the tokens are split at
# the first block (block 0 runs on both branches) and gathered after the head (unpatchify reads the whole grid). The
# generation self-attention scatters the tokens into a buffer laid out by frame for the whole video and attends
# through a flex BlockMask over it; the reference pass stores pre-RoPE keys and values per block. So the
# self-attention is head-parallel: q/k leave the QK-norms (RMSNorms over the whole width, which must see every head:
# on a token shard they do) and v leaves to_v as the whole sequence of this rank's heads (`heads`, which the
# processor unflattens with, holds the rank's share meanwhile); the processor's RoPE (from grid_sizes), buffer, block
# mask and KV cache (each rank caching its heads, on both passes) then apply as on one device, and to_out.0 takes the
# result back to the rank's tokens. Cross-attention reads the whole, replicated text and CLIP tokens: local.
CP_PLAN = ContextParallelPlan(
    inputs={"blocks.0": {"hidden_states": SplitInput(dim=1, expected_dims=3)}},
    gather={"head": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(
        head_parallel={
            "blocks.*.self_attn": HeadParallel(
                inputs=("norm_q", "norm_k", "to_v"), output="to_out.0", divide=("heads",)
            )
        },
        local=("blocks.*.cross_attn",),
    ),
    notes="Tokens split at blocks.0, gathered after the head; self-attention head-parallel (the frame buffer, its "
    "BlockMask and the reference KV cache on the whole sequence of the rank's heads); cross-attention local.",
)

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "blocks": (
        ("self_attn.to_q", "self_attn.to_k", "self_attn.to_v"),
        ("cross_attn.to_k", "cross_attn.to_v"),
        ("cross_attn.add_k_proj", "cross_attn.add_v_proj"),
    ),
}

ADAPTER = register(
    ModelAdapter(
        family="wan_animate2",
        fused_projections=FUSED_PROJECTIONS,
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="blocks", pattern=ForwardPattern.P2),),
        unstepped_calls={"kv_cache_mode": ("extract",)},
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        cfg_parallel=False,
        example="fastdit.models.wan_animate2:example",
        tiny_pipelines=(TinyPipeline(name="animate", build=tiny_pipeline, call_kwargs=LazyKwargs(_CALL)),),
        presets=(ModelPreset(name="wan-animate-2", pipeline_class="diffusers.WanAnimate2ModularPipeline"),),
        notes=(
            "The reference pass (`kv_cache_mode='extract'`) fills every block's KV cache at the first step's "
            "timestep; it is declared an unstepped call (computed in full, not counted). The unconditional branch "
            "skips block 9 (`is_uncondtion`). Served by a ModularPipeline (WanAnimate2ModularPipeline, driven "
            "through fastdit.modular). Context parallelism splits "
            "the tokens at blocks.0; the generation self-attention scatters them into a buffer laid out by frame for "
            "the full video and attends through a flex BlockMask over that whole buffer, so it is head-parallel "
            "(`AttentionRouting.head_parallel`): the processor runs on the whole sequence of the rank's heads, its "
            "KV cache holding those heads (fused projections are not supported under CP: the exchange is hooked on "
            "to_v). No CFG parallelism: the branches are "
            "unannounced calls, and the reference pass shares their first timestep, so pairing them by timestep "
            "would pair the wrong calls."
            " No spectral signal: the latent arrives as a list of per-sample tensors, not one tensor on a grid."
        ),
    )
)
