"""FLUX.2 (dev with Mistral 3, klein with Qwen3; text-to-image and reference editing): ``Flux2Transformer2DModel``.

Blocks (diffusers 0.42.1): ``transformer_blocks`` (double stream) are called by keyword with ``(hidden_states,
encoder_hidden_states, temb_mod_img, temb_mod_txt, image_rotary_emb, joint_attention_kwargs)`` and return
``(encoder_hidden_states, hidden_states)`` (pattern 1). The model then concatenates ``[text, image]`` and runs
``single_transformer_blocks``, called by keyword with ``encoder_hidden_states=None`` plus ``(temb_mod,
image_rotary_emb, joint_attention_kwargs)``; they return the joint sequence alone (pattern 3).
"""

from __future__ import annotations

from fastdit.models._lazy import LazyKwargs, tiny_image
from fastdit.models.base import BlockGroup, ForwardPattern, ModelAdapter, ModelPreset, StepInvariant, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan_shapes import mmdit_root_plan
from fastdit.parallel.tp_plan import Colwise, Rowwise, TensorParallelPlan
from fastdit.parallel.tp_shapes import joint_attention, under

TRANSFORMER = "diffusers.models.transformers.transformer_flux2.Flux2Transformer2DModel"

_TEXT_DIM = 32
_TEXT_LAYERS = 3
# The pipelines stack three hidden states of the text encoder on the feature axis; the tiny encoders have three
# layers, so they take all of them (the real models take layers 10/20/30 and 9/18/27).
_TEXT_OUT_LAYERS = (1, 2, 3)


def tiny_transformer(seed: int = 0, *, guidance: bool):
    """A 3-block ``Flux2Transformer2DModel`` (1 double + 2 single) for 2x2-packed 4-channel latents.

    ``guidance`` embeds the guidance scale (FLUX.2 dev); klein has no guidance embedding and uses true CFG.
    """
    from diffusers import Flux2Transformer2DModel

    from fastdit.testing.components.encoders import build

    return build(
        Flux2Transformer2DModel,
        seed=seed,
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=len(_TEXT_OUT_LAYERS) * _TEXT_DIM,
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=guidance,
    )


def tiny_vae(seed: int = 0):
    """A two-level ``AutoencoderKLFlux2`` with 4 latent channels (scale factor 2, latents packed 2x2 -> 16)."""
    from diffusers import AutoencoderKLFlux2

    from fastdit.testing.components.encoders import build

    return build(
        AutoencoderKLFlux2,
        seed=seed,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=32,
    )


def _scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, time_shift_type="exponential")


def tiny_flux2_dev(seed: int = 0):
    """A complete tiny ``Flux2Pipeline`` (Mistral 3 text encoder, embedded guidance)."""
    from diffusers import Flux2Pipeline

    from fastdit.testing.components.mistral3 import mistral3_model

    text_encoder, tokenizer = mistral3_model(_TEXT_DIM, _TEXT_LAYERS, seed=seed + 1)
    return Flux2Pipeline(
        scheduler=_scheduler(),
        vae=tiny_vae(seed),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=tiny_transformer(seed, guidance=True),
    )


def tiny_flux2_klein(seed: int = 0):
    """A complete tiny ``Flux2KleinPipeline`` (Qwen3 text encoder, base model with true CFG)."""
    from diffusers import Flux2KleinPipeline
    from transformers import Qwen3ForCausalLM

    from fastdit.testing.components.encoders import build
    from fastdit.testing.components.qwen3 import qwen3_config, qwen3_tokenizer

    text_encoder = build(Qwen3ForCausalLM, qwen3_config(_TEXT_DIM, _TEXT_LAYERS), seed=seed + 1)
    return Flux2KleinPipeline(
        scheduler=_scheduler(),
        vae=tiny_vae(seed),
        text_encoder=text_encoder,
        tokenizer=qwen3_tokenizer(),
        transformer=tiny_transformer(seed, guidance=False),
        is_distilled=False,
    )


# Context parallelism: the forward is "embed, double blocks, concatenate [text, image], single blocks, drop the text,
# project out", all token-wise outside attention, so the root inputs are split. RoPE is computed inside forward from
# txt_ids and img_ids (the pipelines pass (B, S, 4), forward also takes (S, 4)): splitting them on their sequence dim
# (-2 in both layouts) like the streams gives every rank the rotary embedding of exactly its tokens. The text length
# forward drops before proj_out is read from the (local) text stream, so each rank keeps its own image shard.
# Not covered: the klein KV pipeline's kv_cache_mode calls, whose reference-token attention bypasses parallel_config
# and whose modulation blend uses global token counts.
CP_PLAN = mmdit_root_plan(
    "diffusers.models.transformers.transformer_flux2",
    notes="RoPE from img_ids/txt_ids, split on their sequence dim with the streams: no RoPE patch needed.",
)

_CALL = {
    "prompt": "a cat holding a sign",
    "height": 32,
    "width": 32,
    "num_inference_steps": 2,
    "max_sequence_length": 32,
    "text_encoder_out_layers": _TEXT_OUT_LAYERS,
}

# Tensor parallelism (the same split as diffusers' `_tp_plan`): the double blocks' attention and SwiGLU FFNs (gate and
# up fused in `linear_in`: two segments), the single blocks' fused [Q|K|V|gate|up] input projection and their output
# projection over cat([attn_out, mlp_hidden]) split segment by segment. The processor splits the fused output by its
# global ratio, so only `heads` needs dividing. The modulation is three model-level linears shared by every block:
# small, kept whole. QK-norms are per head.
_SWIGLU = {"linear_in": Colwise(segments=(1, 1)), "linear_out": Rowwise()}
TP_PLAN = TensorParallelPlan(
    layers={
        **under("transformer_blocks.*", joint_attention("attn")),
        **under("transformer_blocks.*.ff", _SWIGLU),
        **under("transformer_blocks.*.ff_context", _SWIGLU),
        "single_transformer_blocks.*.attn.to_qkv_mlp_proj": Colwise(
            segments=("inner_dim", "inner_dim", "inner_dim", "mlp_hidden_dim", "mlp_hidden_dim")
        ),
        "single_transformer_blocks.*.attn.to_out": Rowwise(segments=("inner_dim", "mlp_hidden_dim")),
    },
    divide=("transformer_blocks.*.attn.heads", "single_transformer_blocks.*.attn.heads"),
    notes="diffusers' plan: fused [Q|K|V|gate|up] and SwiGLU weights split per segment; shared modulation whole.",
)

# The pipelines pass the same prompt embeddings at every step (CFG branches: one tensor each, made before the loop):
# the text projection repeats; keyed on the transformer's argument, which context parallelism splits beneath the
# lookup. Not `pos_embed`: the Klein edit pipeline concatenates its latent and reference-image ids inside the loop, a
# new img_ids tensor every step, so no key on the ids would ever hit there.
STEP_INVARIANT = (StepInvariant("context_embedder", inputs=("encoder_hidden_states",)),)

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "transformer_blocks": (
        ("attn.to_q", "attn.to_k", "attn.to_v"),
        ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    ),
}

ADAPTER = register(
    ModelAdapter(
        family="flux2",
        fused_projections=FUSED_PROJECTIONS,
        transformer_classes=(TRANSFORMER,),
        block_groups=(
            BlockGroup(path="transformer_blocks", pattern=ForwardPattern.P1),
            BlockGroup(path="single_transformer_blocks", pattern=ForwardPattern.P3),
        ),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        step_invariant=STEP_INVARIANT,
        tiny_pipelines=(
            TinyPipeline(name="dev", build=tiny_flux2_dev, call_kwargs={**_CALL, "guidance_scale": 4.0}),
            TinyPipeline(name="klein", build=tiny_flux2_klein, call_kwargs={**_CALL, "guidance_scale": 4.0}),
            TinyPipeline(
                name="klein-edit",
                build=tiny_flux2_klein,
                # Reference images are encoded and appended to the image tokens (the output keeps the first part).
                # The pipelines reject reference images under 64 px a side.
                call_kwargs=LazyKwargs({**_CALL, "guidance_scale": 4.0, "image": tiny_image(64)}),
            ),
        ),
        presets=(
            ModelPreset(
                name="flux2-dev",
                pipeline_class="diffusers.Flux2Pipeline",
                hub_id="black-forest-labs/FLUX.2-dev",
                defaults={"num_inference_steps": 50, "guidance_scale": 4.0, "height": 1024, "width": 1024},
            ),
            ModelPreset(
                name="flux2-klein-4b",
                pipeline_class="diffusers.Flux2KleinPipeline",
                hub_id="black-forest-labs/FLUX.2-klein-4B",
                defaults={"num_inference_steps": 4, "guidance_scale": 1.0, "height": 1024, "width": 1024},
            ),
            ModelPreset(
                name="flux2-klein-base-4b",
                pipeline_class="diffusers.Flux2KleinPipeline",
                hub_id="black-forest-labs/FLUX.2-klein-base-4B",
                defaults={"num_inference_steps": 50, "guidance_scale": 4.0, "height": 1024, "width": 1024},
            ),
        ),
        notes=(
            "Modulation is shared: the model computes one set of modulation tensors per stream from the timestep "
            "and passes it to every block. 4-axis RoPE from `txt_ids`/`img_ids` (computed outside the blocks); "
            "reference images add image tokens after the generated ones. FLUX.2 dev embeds guidance (one forward "
            "per step); klein base runs true CFG inside cache_context('cond'/'uncond'). No attention mask."
            " No spectral signal: the latent arrives packed into a token sequence (batch, tokens, channels): no grid "
            "to filter."
        ),
    )
)
