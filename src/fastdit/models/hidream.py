"""HiDream-I1 (Full / Dev / Fast): ``HiDreamImageTransformer2DModel``.

Blocks (diffusers 0.42.1): ``double_stream_blocks`` then ``single_stream_blocks``, each entry a ``HiDreamBlock``
wrapper around the real block, all called by keyword with ``(hidden_states, hidden_states_masks,
encoder_hidden_states, temb, image_rotary_emb)``. Double-stream blocks return ``(hidden_states,
encoder_hidden_states)`` (pattern 0); single-stream blocks get ``encoder_hidden_states=None`` and return the joint
sequence alone (pattern 3).
"""

from __future__ import annotations

import copy

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
from fastdit.parallel.tp_plan import Colwise, Rowwise, ShardedNorm, Style, TensorParallelPlan
from fastdit.parallel.tp_shapes import modulation, under

TRANSFORMER = "diffusers.models.transformers.transformer_hidream_image.HiDreamImageTransformer2DModel"

_CLIP_PROJ = 16
_T5_DIM = 32
_LLAMA_DIM = 32
_LLAMA_LAYERS = 2
_NUM_DOUBLE = 1
_NUM_SINGLE = 2


def tiny_transformer(seed: int = 0):
    """A 3-block ``HiDreamImageTransformer2DModel`` (1 double + 2 single, MoE feed-forward with 2 experts).

    Every block reads its own Llama layer: ``llama_layers`` names one hidden state per block (there are only two in
    the tiny encoder, so the last is reused).
    """
    from diffusers import HiDreamImageTransformer2DModel

    from fastdit.testing.components.encoders import build

    num_blocks = _NUM_DOUBLE + _NUM_SINGLE
    return build(
        HiDreamImageTransformer2DModel,
        seed=seed,
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=_NUM_DOUBLE,
        num_single_layers=_NUM_SINGLE,
        attention_head_dim=16,
        num_attention_heads=2,
        caption_channels=[_T5_DIM, _LLAMA_DIM],
        text_emb_dim=2 * _CLIP_PROJ,
        num_routed_experts=2,
        num_activated_experts=1,
        axes_dims_rope=(4, 6, 6),
        # Non-square latents are padded to max_resolution**2 / patch**2 tokens: 16x16 latents -> 64 tokens.
        max_resolution=(16, 16),
        llama_layers=[min(i, _LLAMA_LAYERS - 1) for i in range(num_blocks)],
    )


def _llama():
    from transformers import LlamaForCausalLM

    from fastdit.testing.components.encoders import build
    from fastdit.testing.components.llama import llama_config, llama_tokenizer

    # The pipeline asks for attention weights, which only the eager attention returns.
    config = llama_config(_LLAMA_DIM, _LLAMA_LAYERS)
    config._attn_implementation = "eager"
    # A private tokenizer: the pipeline overwrites its pad token.
    return build(LlamaForCausalLM, config, seed=3), copy.deepcopy(llama_tokenizer())


def tiny_hidream(seed: int = 0):
    """A complete tiny ``HiDreamImagePipeline`` (two CLIPs, T5, Llama; Flux-style VAE)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, HiDreamImagePipeline

    from fastdit.testing.components.autoencoder_kl import autoencoder_kl
    from fastdit.testing.components.encoders import clip_text_model_with_projection, t5_encoder

    text_encoder, tokenizer = clip_text_model_with_projection(_CLIP_PROJ, _CLIP_PROJ, seed=seed)
    text_encoder_2, tokenizer_2 = clip_text_model_with_projection(_CLIP_PROJ, _CLIP_PROJ, seed=seed + 1)
    text_encoder_3, tokenizer_3 = t5_encoder(d_model=_T5_DIM, seed=seed + 2)
    text_encoder_4, tokenizer_4 = _llama()
    pipe = HiDreamImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=autoencoder_kl(latent_channels=4, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
        text_encoder_4=text_encoder_4,
        tokenizer_4=tokenizer_4,
        transformer=tiny_transformer(seed),
    )
    # The pipeline rescales every request to the area of a default_sample_size**2 latent (1024**2 px for the real
    # model); the tiny model's area is 16**2 latents = 32**2 px, which max_resolution above also covers.
    pipe.default_sample_size = 16
    return pipe


# Context parallelism inside every block. Before every block forward concatenates a whole Llama layer to the text
# (double blocks) or joint (single blocks) stream, and it slices the results by global lengths, so the streams
# between blocks stay whole on every rank: each block's inner module (inside the HiDreamBlock wrapper, so a cache
# hook on the wrapper sees whole tensors on both sides) splits its sequences and gathers its output.
# - Single blocks: the joint [image, text] sequence, the RoPE table built for that sequence and the non-square token
#   mask are split contiguously; the output is gathered.
# - Double blocks: the image and text streams are split separately; their attention concatenates the local
#   [image_shard, text_shard], so the RoPE table (one tensor over the global [image, text]) is split per segment with
#   the same shard sizes; the (image, text) output is gathered element by element. The non-square token mask covers
#   the image tokens only and is split with them.
# In both, the token mask multiplies the local keys before attention and SDPA gets no mask, so the order of the
# ranks' tokens after the exchange ([image_0, text_0, image_1, ...]) needs no reordering (no mask_segments).
_SEQ = SplitInput(dim=1, expected_dims=3)
_TOKEN_MASK = SplitInput(dim=1, expected_dims=2)  # None for square latents
CP_PLAN = ContextParallelPlan(
    inputs={
        "double_stream_blocks.*.block": {
            "hidden_states": _SEQ,
            "encoder_hidden_states": _SEQ,
            "hidden_states_masks": _TOKEN_MASK,
            # (B, S_image + S_text, 1, D/2, 2, 2)
            "image_rotary_emb": SplitInput(dim=1, expected_dims=6, segments=("hidden_states", "encoder_hidden_states")),
        },
        "single_stream_blocks.*.block": {
            "hidden_states": _SEQ,
            "hidden_states_masks": _TOKEN_MASK,
            "image_rotary_emb": SplitInput(dim=1, expected_dims=6),  # (B, S, 1, D/2, 2, 2)
        },
    },
    gather={
        "double_stream_blocks.*.block": GatherOutput(dim=1, expected_dims=3, index=(0, 1)),
        "single_stream_blocks.*.block": GatherOutput(dim=1, expected_dims=3),
    },
    attention=AttentionRouting(sdpa_modules=("diffusers.models.transformers.transformer_hidream_image",)),
    notes="Every block splits and gathers inside its wrapper: double blocks their image and text streams (RoPE "
    "split per segment, both outputs gathered), single blocks their joint sequence (RoPE, token mask).",
)


def _swiglu(ff: str) -> dict[str, Style]:
    """A HiDream SwiGLU FFN: w1 (gate) and w3 (up) column-wise, w2 row-wise."""
    return {f"{ff}.w1": Colwise(), f"{ff}.w3": Colwise(), f"{ff}.w2": Rowwise()}


def _hidream_attention(suffix: str = "") -> dict[str, Style]:
    """One stream of a HiDreamAttention (``suffix`` "_t": the text stream), its QK-norms over all heads."""
    return {
        **{f"attn1.to_{name}{suffix}": Colwise() for name in ("q", "k", "v")},
        f"attn1.to_out{suffix}": Rowwise(),
        f"attn1.q_rms_norm{suffix}": ShardedNorm(),
        f"attn1.k_rms_norm{suffix}": ShardedNorm(),
    }


# Tensor parallelism. HiDreamAttention's QK-norms are RMSNorms over the whole inner dim (all heads), so they become
# sharded norms over the column-split q/k; the processor takes the local inner dim from the key's shape and the head
# dim from it and ``attn.heads`` (divided). Its output projections are plain Linears (``to_out``, ``to_out_t``). Every
# SwiGLU FFN (w1/w3 up, w2 down) is split Megatron-style, the MoE's shared expert and each routed expert alike: the
# router (MoEGate, a bare weight over the model width) stays replicated, so every rank routes the same tokens to the
# same experts and runs the same row-wise all-reduces. The per-block AdaLN linears (dim -> 12·dim per double block,
# dim -> 6·dim per single block) are split with a gathered output. Caption projections, embedders and the final layer
# stay whole.
_MOE = {**_swiglu("ff_i.shared_experts"), **_swiglu("ff_i.experts.*")}
TP_PLAN = TensorParallelPlan(
    layers={
        **under(
            "double_stream_blocks.*.block",
            {
                **_hidream_attention(),
                **_hidream_attention("_t"),
                **_MOE,
                **_swiglu("ff_t"),
                **modulation("adaLN_modulation.1"),
            },
        ),
        **under(
            "single_stream_blocks.*.block",
            {**_hidream_attention(), **_MOE, **modulation("adaLN_modulation.1")},
        ),
    },
    divide=("double_stream_blocks.*.block.attn1.heads", "single_stream_blocks.*.block.attn1.heads"),
    notes="QK-norms over all heads sharded; every SwiGLU expert split with the router replicated (same routing on "
    "every rank); per-block AdaLN modulation split with a gathered output; caption projections replicated.",
)

# The pipeline passes the same T5 and stacked Llama-3 embeddings and pooled CLIP embeddings at every step (batched
# CFG's cats are done once before the loop). Every caption projection repeats: one per block reads its Llama layer
# (`encoder_hidden_states_llama3[k]`, a new view every call), the last reads the T5 states; all are keyed on both
# arguments. The pooled embedder (`p_embedder`) repeats too; the timestep is embedded separately (`t_embedder`) and
# only added after it. Not `pe_embedder`: its ids are built in forward from the latent's grid (patchify), which no
# argument named here determines; nor `x_embedder` (the latent).
STEP_INVARIANT = (
    StepInvariant("caption_projection.*", inputs=("encoder_hidden_states_t5", "encoder_hidden_states_llama3")),
    StepInvariant("p_embedder", inputs=("pooled_embeds",)),
)

_CALL = {
    "prompt": "a cat holding a sign",
    "height": 32,
    "width": 32,
    "num_inference_steps": 2,
    "guidance_scale": 5.0,
    "max_sequence_length": 16,
}

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "double_stream_blocks": (
        ("block.attn1.to_q", "block.attn1.to_k", "block.attn1.to_v"),
        ("block.attn1.to_q_t", "block.attn1.to_k_t", "block.attn1.to_v_t"),
        ("block.ff_i.shared_experts.w1", "block.ff_i.shared_experts.w3"),
        ("block.ff_i.experts.*.w1", "block.ff_i.experts.*.w3"),  # each routed expert's pair, on its tokens
        ("block.ff_t.w1", "block.ff_t.w3"),
    ),
    "single_stream_blocks": (
        ("block.attn1.to_q", "block.attn1.to_k", "block.attn1.to_v"),
        ("block.ff_i.shared_experts.w1", "block.ff_i.shared_experts.w3"),
        ("block.ff_i.experts.*.w1", "block.ff_i.experts.*.w3"),
    ),
}

ADAPTER = register(
    ModelAdapter(
        family="hidream",
        fused_projections=FUSED_PROJECTIONS,
        # hidden_states is (batch, channels, height, width). Non-square sizes too: the pipeline passes the grid,
        # forward patchifies it.
        latent=LatentLayout(),
        transformer_classes=(TRANSFORMER,),
        # The Llama-3 states come stacked per layer, (layers, B, S, D): their batch is dim 1.
        cfg_batch_dims={"encoder_hidden_states_llama3": 1},
        block_groups=(
            BlockGroup(path="double_stream_blocks", pattern=ForwardPattern.P0),
            BlockGroup(path="single_stream_blocks", pattern=ForwardPattern.P3),
        ),
        timestep_arg="timesteps",
        tp_plan=TP_PLAN,
        step_invariant=STEP_INVARIANT,
        tiny_pipelines=(
            TinyPipeline(name="hidream", build=tiny_hidream, call_kwargs=_CALL),
            # Non-square sizes take the padded path: image tokens padded to a fixed length plus a token mask.
            TinyPipeline(name="non-square", build=tiny_hidream, call_kwargs={**_CALL, "height": 16}),
        ),
        presets=(
            ModelPreset(
                name="hidream-i1-full",
                pipeline_class="diffusers.HiDreamImagePipeline",
                hub_id="HiDream-ai/HiDream-I1-Full",
                defaults={"num_inference_steps": 50, "guidance_scale": 5.0, "height": 1024, "width": 1024},
            ),
            ModelPreset(
                name="hidream-i1-dev",
                pipeline_class="diffusers.HiDreamImagePipeline",
                hub_id="HiDream-ai/HiDream-I1-Dev",
                defaults={"num_inference_steps": 28, "guidance_scale": 0.0, "height": 1024, "width": 1024},
            ),
            ModelPreset(
                name="hidream-i1-fast",
                pipeline_class="diffusers.HiDreamImagePipeline",
                hub_id="HiDream-ai/HiDream-I1-Fast",
                defaults={"num_inference_steps": 16, "guidance_scale": 0.0, "height": 1024, "width": 1024},
            ),
        ),
        notes=(
            "Block inputs are rebuilt between blocks: each double block gets [T5 + last Llama layer, its own Llama "
            "layer] as encoder stream and the model keeps only the first part of what it returns; each single block "
            "gets [joint sequence, its own Llama layer] and the model cuts the appended tokens off again. So a "
            "block's input is not the previous block's output, and the encoder stream it returns is longer than the "
            "one the next block is given. Non-square latents are padded to a fixed token count with "
            "`hidden_states_masks`; MoE feed-forward (top-k routed experts); timestep argument is `timesteps`. "
            "CFG is batched. The pipeline rescales every request to the model's default area (~1 MP). "
            "Context parallel splits inside every block and gathers its output (forward appends a whole Llama "
            "layer before every block and slices by global lengths): double-stream blocks split their image and "
            "text streams and their RoPE table per [image, text] segment and gather both outputs; single-stream "
            "blocks split their joint sequence."
        ),
        cp_plan=CP_PLAN,
    )
)
