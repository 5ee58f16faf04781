"""FLUX.1 (dev / schnell / Kontext): ``FluxTransformer2DModel``.

Blocks (diffusers 0.42.x): 19 double-stream ``transformer_blocks`` and 38 single-stream ``single_transformer_blocks``;
both take ``(hidden_states, encoder_hidden_states, temb, image_rotary_emb, joint_attention_kwargs)`` by keyword and
return ``(encoder_hidden_states, hidden_states)`` (pattern 1).
"""

from __future__ import annotations

from fastdit.models._lazy import LazyKwargs, tiny_image
from fastdit.models.base import BlockGroup, ForwardPattern, ModelAdapter, ModelPreset, StepInvariant, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan_shapes import mmdit_root_plan
from fastdit.parallel.tp_plan import Colwise, Rowwise, TensorParallelPlan

TRANSFORMER = "diffusers.models.transformers.transformer_flux.FluxTransformer2DModel"


def tiny_transformer(seed: int = 0, *, num_layers: int = 1, num_single_layers: int = 2, guidance: bool = False):
    """A 3-block ``FluxTransformer2DModel`` for 2x2-patchified 4-channel latents."""
    from diffusers import FluxTransformer2DModel

    from fastdit.testing.components.encoders import build

    return build(
        FluxTransformer2DModel,
        seed=seed,
        patch_size=1,
        in_channels=16,
        out_channels=None,
        num_layers=num_layers,
        num_single_layers=num_single_layers,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        guidance_embeds=guidance,
        axes_dims_rope=(4, 6, 6),
    )


def _components(seed: int, guidance: bool) -> dict:
    from diffusers import FlowMatchEulerDiscreteScheduler

    from fastdit.testing.components.autoencoder_kl import autoencoder_kl
    from fastdit.testing.components.encoders import clip_text_model, t5_encoder

    text_encoder, tokenizer = clip_text_model(seed=seed)
    text_encoder_2, tokenizer_2 = t5_encoder(seed=seed + 1)
    return {
        "transformer": tiny_transformer(seed, guidance=guidance),
        "vae": autoencoder_kl(
            latent_channels=4, scaling_factor=1.5035, shift_factor=0.0609, use_quant_conv=False, seed=seed
        ),
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "text_encoder_2": text_encoder_2,
        "tokenizer_2": tokenizer_2,
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=False),
    }


def tiny_flux(seed: int = 0):
    """A complete tiny ``FluxPipeline`` (FLUX.1-dev layout: guidance embedding on)."""
    from diffusers import FluxPipeline

    return FluxPipeline(**_components(seed, guidance=True))


def tiny_flux_kontext(seed: int = 0):
    """A complete tiny ``FluxKontextPipeline`` (image editing: the input image is concatenated as tokens)."""
    from diffusers import FluxKontextPipeline

    return FluxKontextPipeline(**_components(seed, guidance=True))


# Context parallelism: the forward is "embed, loop over blocks, project out", so the root inputs are split. RoPE is
# computed inside forward from cat(txt_ids, img_ids); splitting the ids on their sequence dim (-2, for 2-D and 3-D ids)
# like the hidden states (dim 1) gives every rank the rotary embedding of exactly its own tokens. Each rank's attention
# sequence is [text_r, image_r].
CP_PLAN = mmdit_root_plan(
    "diffusers.models.transformers.transformer_flux",
    notes="RoPE from img_ids/txt_ids, split on their sequence dim with the streams: no RoPE patch needed.",
)

# Tensor parallelism: diffusers' `_tp_plan` for the attention and FFN linears, plus the AdaLN modulation linears split
# with a gathered output, which diffusers keeps whole: they are ~27 % of FLUX.1-dev's weights (dim → 6·dim per stream
# and double block, dim → 3·dim per single block), and their gathered output is one small (B, k·dim) all-gather per
# block. The single block's proj_out reads cat([attn_out, mlp_hidden]): each stream is split on its own.
_MMDIT_ATTENTION = {
    "attn.to_q": Colwise(),
    "attn.to_k": Colwise(),
    "attn.to_v": Colwise(),
    "attn.to_out.0": Rowwise(),
    "attn.add_q_proj": Colwise(),
    "attn.add_k_proj": Colwise(),
    "attn.add_v_proj": Colwise(),
    "attn.to_add_out": Rowwise(),
}
TP_PLAN = TensorParallelPlan(
    layers={
        **{f"transformer_blocks.*.{k}": v for k, v in _MMDIT_ATTENTION.items()},
        "transformer_blocks.*.ff.net.0.proj": Colwise(),
        "transformer_blocks.*.ff.net.2": Rowwise(),
        "transformer_blocks.*.ff_context.net.0.proj": Colwise(),
        "transformer_blocks.*.ff_context.net.2": Rowwise(),
        "transformer_blocks.*.norm1.linear": Colwise(gather_output=True),
        "transformer_blocks.*.norm1_context.linear": Colwise(gather_output=True),
        "single_transformer_blocks.*.attn.to_q": Colwise(),
        "single_transformer_blocks.*.attn.to_k": Colwise(),
        "single_transformer_blocks.*.attn.to_v": Colwise(),
        "single_transformer_blocks.*.proj_mlp": Colwise(),
        "single_transformer_blocks.*.proj_out": Rowwise(segments=("attn.inner_dim", "mlp_hidden_dim")),
        "single_transformer_blocks.*.norm.linear": Colwise(gather_output=True),
    },
    divide=("transformer_blocks.*.attn.heads", "single_transformer_blocks.*.attn.heads"),
    notes="diffusers' plan plus AdaLN modulation split with a gathered output (~27 % of the weights); "
    "QK-norms are per head (replicated).",
)

# The pipelines pass the same position ids and prompt embeddings at every step: the rotary table (computed in forward
# from cat(txt_ids, img_ids)) and the text projection repeat. Both are keyed on the transformer's arguments, which
# context parallelism splits beneath the lookup (a new shard every call).
STEP_INVARIANT = (
    StepInvariant("pos_embed", inputs=("txt_ids", "img_ids")),
    StepInvariant("context_embedder", inputs=("encoder_hidden_states",)),
)

# Projections each block applies to one tensor (Fuse): each stream's Q/K/V in the double blocks, and the single
# blocks' Q/K/V with the MLP's input projection, all four on the normalised hidden states (N = 3 x 3,072 + 12,288 on
# FLUX.1-dev).
FUSED_PROJECTIONS = {
    "transformer_blocks": (
        ("attn.to_q", "attn.to_k", "attn.to_v"),
        ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    ),
    "single_transformer_blocks": (("proj_mlp", "attn.to_q", "attn.to_k", "attn.to_v"),),
}

_CALL = {
    "prompt": "a cat holding a sign",
    "height": 32,
    "width": 32,
    "num_inference_steps": 2,
    "max_sequence_length": 16,
}

ADAPTER = register(
    ModelAdapter(
        family="flux",
        notes=(
            "No spectral signal: the latent arrives packed into a token sequence (batch, tokens, channels): no grid "
            "to filter."
        ),
        transformer_classes=(TRANSFORMER,),
        block_groups=(
            BlockGroup(path="transformer_blocks", pattern=ForwardPattern.P1),
            BlockGroup(path="single_transformer_blocks", pattern=ForwardPattern.P1),
        ),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        step_invariant=STEP_INVARIANT,
        fused_projections=FUSED_PROJECTIONS,
        tiny_pipelines=(
            TinyPipeline(name="flux", build=tiny_flux, call_kwargs={**_CALL, "guidance_scale": 3.5}),
            TinyPipeline(
                name="kontext",
                build=tiny_flux_kontext,
                # Kontext scales the image and the output to ~1 MP unless told not to.
                call_kwargs=LazyKwargs(
                    {
                        **_CALL,
                        "guidance_scale": 2.5,
                        "image": tiny_image(),
                        "_auto_resize": False,
                        "max_area": 32 * 32,
                    }
                ),
            ),
        ),
        presets=(
            ModelPreset(
                name="flux",
                pipeline_class="diffusers.FluxPipeline",
                hub_id="black-forest-labs/FLUX.1-dev",
                defaults={"num_inference_steps": 28, "guidance_scale": 3.5, "height": 1024, "width": 1024},
            ),
            ModelPreset(
                name="flux-schnell",
                pipeline_class="diffusers.FluxPipeline",
                hub_id="black-forest-labs/FLUX.1-schnell",
                defaults={"num_inference_steps": 4, "guidance_scale": 0.0, "height": 1024, "width": 1024},
            ),
            ModelPreset(
                name="flux-kontext",
                pipeline_class="diffusers.FluxKontextPipeline",
                hub_id="black-forest-labs/FLUX.1-Kontext-dev",
                defaults={"num_inference_steps": 28, "guidance_scale": 2.5},
            ),
        ),
    )
)
