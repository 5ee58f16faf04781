"""NucleusMoE-Image: ``NucleusMoEImageTransformer2DModel``, a single-stream mixture-of-experts DiT.

Blocks (diffusers 0.42.1): one list, ``transformer_blocks`` of ``NucleusMoEImageTransformerBlock``, called by keyword
with ``(hidden_states, encoder_hidden_states, temb, image_rotary_emb, attention_kwargs)``; each returns the image
stream alone (pattern 2). The text is not a stream: every block projects the (same, normalised) prompt embeddings
with its own ``encoder_proj`` into extra keys and values, and the image queries attend to ``[image, text]`` keys
(grouped-query attention). A padding mask over those joint keys reaches the processors through
``attention_kwargs["attention_mask"]``.

The feed-forward of most blocks (``dense_moe_strategy``: the first three and the last stay dense in the released
checkpoint) is a ``NucleusMoELayer``: a router over ``[temb, unmodulated tokens]``, *expert-choice* routing (each of
the ``E`` experts takes its top ``C = ceil(capacity_factor * S / E)`` tokens of the sample), packed SwiGLU experts
(``experts.gate_up_proj`` ``(E, D, 2I)``, ``experts.down_proj`` ``(E, I, D)``) and a shared SwiGLU expert. Routing is
therefore *not* token-wise: which experts a token meets depends on every other token of its sample.
"""

from __future__ import annotations

from fastdit.models.base import BlockGroup, ForwardPattern, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import (
    AttentionRouting,
    ContextParallelPlan,
    GatherInput,
    GatherOutput,
    SplitOutput,
)
from fastdit.parallel.plan_shapes import TOKENS
from fastdit.parallel.tp_plan import Colwise, ExpertShard, Rowwise, TensorParallelPlan
from fastdit.parallel.tp_shapes import feed_forward, modulation, under

TRANSFORMER = "diffusers.models.transformers.transformer_nucleusmoe_image.NucleusMoEImageTransformer2DModel"
_MODULE = "diffusers.models.transformers.transformer_nucleusmoe_image"

_LATENT = 4
_TEXT_DIM = 32  # tiny Qwen3-VL hidden size
_TEXT_LAYERS = 2


def tiny_transformer(seed: int = 0, *, num_layers: int = 3, strategy: str = "leave_first_block_dense"):
    """A ``NucleusMoEImageTransformer2DModel`` of 4 query heads over 2 KV heads of 16, 4 experts.

    Width 64 is the least whose dense SwiGLU is not empty (its hidden size rounds ``8/3 * dim`` down to 128s).

    Block 0 is dense and blocks 1 and 2 mixtures of experts (``leave_first_block_dense``), so the cache (whose middle
    block is then an MoE block), the splits and the plans meet both kinds of feed-forward.
    """
    from diffusers import NucleusMoEImageTransformer2DModel

    from fastdit.testing.components.encoders import build

    model = build(
        NucleusMoEImageTransformer2DModel,
        seed=seed,
        patch_size=2,
        in_channels=_LATENT * 4,
        out_channels=_LATENT,
        num_layers=num_layers,
        attention_head_dim=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        joint_attention_dim=_TEXT_DIM,
        axes_dims_rope=(4, 6, 6),
        mlp_ratio=4.0,
        moe_enabled=True,
        dense_moe_strategy=strategy,
        num_experts=4,
        moe_intermediate_dim=16,
        capacity_factors=2.0,
        route_scale=2.5,
    )
    # The packed expert weights are created with torch.empty and left to checkpoint loading: give them seeded values.
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                param.copy_(torch.randn(param.shape, generator=generator) * param.shape[1] ** -0.5)
    return model


def tiny_nucleusmoe_image(seed: int = 0):
    """A complete tiny ``NucleusMoEImagePipeline`` (two-layer Qwen3-VL text encoder, Qwen-Image VAE)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, NucleusMoEImagePipeline
    from transformers import Qwen3VLForConditionalGeneration

    from fastdit.testing.components.autoencoder_kl_qwenimage import autoencoder_kl_qwenimage
    from fastdit.testing.components.encoders import build
    from fastdit.testing.components.qwen3_vl import qwen3_vl_model, qwen3_vl_processor

    # The pipeline calls the generation model (output_hidden_states); the component builds the bare model's config.
    encoder, tokenizer = qwen3_vl_model(hidden_size=_TEXT_DIM, num_layers=_TEXT_LAYERS, seed=seed + 1)
    return NucleusMoEImagePipeline(
        transformer=tiny_transformer(seed),
        scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True),
        vae=autoencoder_kl_qwenimage(latent_channels=_LATENT, seed=seed),
        text_encoder=build(Qwen3VLForConditionalGeneration, encoder.config, seed=seed + 1),
        processor=qwen3_vl_processor(tokenizer),
    )


# Context parallelism. The root forward builds the joint key mask from the image and text lengths it sees and the
# text RoPE from the text length, so nothing is split at the root: the image stream is split at the first block, the
# text (each block projects it anew) at every block, and `pos_embed`'s (image, text) complex tables like their tokens.
# Image queries attend to [image, text] keys; the (B, S_img + S_txt) mask over the global keys is reordered into the
# exchanged keys' order (mask_segments). The mixture-of-experts layers route by expert choice — each expert picks its
# top tokens of the whole sample — so a shard cannot route on its own: every MoE layer gathers its two inputs (the
# modulated and unmodulated tokens), routes and computes on the whole sequence, identically on every rank, and hands
# the loop this rank's shard of its output again. Routing is thus exactly the single-process routing; the MoE compute
# is replicated over the context-parallel ranks (attention and the dense layers are split).
_MOE = "transformer_blocks.*.img_mlp[NucleusMoELayer]"
CP_PLAN = ContextParallelPlan(
    inputs={
        "transformer_blocks.0": {"hidden_states": TOKENS},
        "transformer_blocks.*": {"encoder_hidden_states": TOKENS},
        _MOE: {
            "hidden_states": GatherInput(dim=1, expected_dims=3),
            "hidden_states_unmodulated": GatherInput(dim=1, expected_dims=3),
        },
    },
    outputs={
        "pos_embed": (SplitOutput(dim=0, expected_dims=2, index=0), SplitOutput(dim=0, expected_dims=2, index=1)),
        _MOE: SplitOutput(dim=1, expected_dims=3),
    },
    gather={"proj_out": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(modules=(_MODULE,), mask_segments=("hidden_states", "encoder_hidden_states")),
    notes=(
        "image split at the first block, text at every block, RoPE tables like their tokens; each MoE layer gathers "
        "the sequence and routes it whole (expert choice), so routing equals one process."
    ),
)

# Tensor parallelism. Attention splits by heads (query heads and KV heads alike: the processor reads both counts from
# inner_dim / inner_kv_dim over heads, all three divided); the QK-norms are per head. The per-block modulation
# (`img_mod.1`, dim -> 4 dim) is split with a gathered output; the text projection `encoder_proj` stays whole (it
# feeds the split key/value projections). Dense FFNs and the shared expert are Megatron-split SwiGLUs. The routed
# experts are expert-sharded: expert-choice routing gives every expert exactly B x C tokens, so E / tp experts a rank
# is an exactly balanced share with static shapes, the packed (E, ...) weights split on their expert dim without
# re-laying, and a rank holds 1/tp of the expert weights (the bulk of the model). The router stays whole and sees the
# replicated tokens, so every rank routes alike; each rank runs its experts' rows of the routed batch and the rows
# are all-gathered before the model combines them.
_MOE_BLOCK = {
    **feed_forward("img_mlp.shared_expert", gated=True),
    "img_mlp.experts": ExpertShard(parameters=("gate_up_proj", "down_proj")),
}
_DENSE_BLOCK = feed_forward("img_mlp", gated=True)
TP_PLAN = TensorParallelPlan(
    layers=under(
        "transformer_blocks.*",
        {
            "attn.to_q": Colwise(),
            "attn.to_k": Colwise(),
            "attn.to_v": Colwise(),
            "attn.add_k_proj": Colwise(),
            "attn.add_v_proj": Colwise(),
            "attn.to_out.0": Rowwise(),
            **modulation("img_mod.1"),
            **_DENSE_BLOCK,
            **_MOE_BLOCK,
        },
    ),
    divide=(
        "transformer_blocks.*.attn.heads",
        "transformer_blocks.*.attn.inner_dim",
        "transformer_blocks.*.attn.inner_kv_dim",
    ),
    # A checkpoint may have no dense block or no MoE block at all (dense_moe_strategy "all_moe" / "all_dense").
    optional=tuple(f"transformer_blocks.*.{path}" for path in (*_DENSE_BLOCK, *_MOE_BLOCK)),
    notes=(
        "heads split (query and KV), modulation split with a gathered output, dense FFNs and the shared expert "
        "Megatron-split; routed experts expert-sharded (E / tp per rank, router replicated)."
    ),
)

_CALL = {
    "prompt": "a cat holding a sign",
    "negative_prompt": "blue",
    "guidance_scale": 4.0,
    "num_inference_steps": 2,
    "height": 32,
    "width": 32,
    "max_sequence_length": 64,
    "return_index": -1,  # the tiny text encoder has 2 layers (the pipeline's default reads the 8th from last)
}

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "transformer_blocks": (
        ("attn.to_q", "attn.to_k", "attn.to_v"),
        ("attn.add_k_proj", "attn.add_v_proj"),
    ),
}

ADAPTER = register(
    ModelAdapter(
        family="nucleusmoe_image",
        fused_projections=FUSED_PROJECTIONS,
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="transformer_blocks", pattern=ForwardPattern.P2),),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        # Two calls a step (positive, then negative prompt), no cache contexts, the negative output used only after
        # both: CFG parallelism pairs them by timestep.
        cfg_pairs_by_timestep=True,
        tiny_pipelines=(TinyPipeline(name="t2i", build=tiny_nucleusmoe_image, call_kwargs=_CALL),),
        presets=(
            ModelPreset(
                name="nucleusmoe-image",
                pipeline_class="diffusers.NucleusMoEImagePipeline",
                hub_id="NucleusAI/NucleusMoE-Image",
                defaults={"num_inference_steps": 50, "guidance_scale": 4.0, "height": 1024, "width": 1024},
            ),
        ),
        notes=(
            "Mixture of experts with expert-choice routing (each expert takes its top tokens of the whole sample): the "
            "step cache skips whole blocks, routing included, and a computed block routes exactly as without the "
            "cache. Under context parallelism every MoE layer gathers the sequence and routes and computes it whole "
            "on every rank (experts replicated over the CP ranks, routing identical to one process); under tensor "
            "parallelism the routed experts are expert-sharded (E / tp experts a rank, an exactly balanced share "
            "under expert choice) with the router replicated. The pipeline runs two transformer calls per step for "
            "CFG. A text key/value cache passed through attention_kwargs (cached_txt_key) is not split under context "
            "parallelism."
            " No spectral signal: the latent arrives packed into a token sequence (batch, tokens, channels): no grid "
            "to filter."
        ),
    )
)
