"""Bria FIBO and FIBO-Edit: ``BriaFiboTransformer2DModel`` (a FLUX-style MMDiT fed by every SmolLM3 layer).

Blocks (diffusers 0.42.1): 8 dual-stream ``transformer_blocks`` called by keyword with ``(hidden_states,
encoder_hidden_states, temb, image_rotary_emb, joint_attention_kwargs)`` and returning ``(encoder_hidden_states,
hidden_states)`` (pattern 1), then 38 single-stream ``single_transformer_blocks`` called by keyword with
``(hidden_states, temb, image_rotary_emb, joint_attention_kwargs)`` returning one tensor (pattern 3).

The forward does work between blocks: before every block it overwrites the upper half of the text stream's channels
with that block's projection of one text-encoder layer; around every single block it concatenates ``[text | image]``
into ``hidden_states`` and splits the result again. A single block's hidden stream is therefore the joint sequence.
"""

from __future__ import annotations

from fastdit.models._lazy import LazyKwargs, tiny_image
from fastdit.models.base import BlockGroup, ForwardPattern, ModelAdapter, ModelPreset, StepInvariant, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import SplitOutput
from fastdit.parallel.plan_shapes import mmdit_root_plan
from fastdit.parallel.tp_shapes import flux1_tp_plan

TRANSFORMER = "diffusers.models.transformers.transformer_bria_fibo.BriaFiboTransformer2DModel"

_LATENT_CHANNELS = 4
_TEXT_WIDTH = 32


def tiny_transformer(seed: int = 0, *, num_layers: int = 1, num_single_layers: int = 2):
    """A 3-block ``BriaFiboTransformer2DModel`` (2 heads x 16).

    The forward projects one text-encoder hidden state per block, so ``num_layers + num_single_layers`` must equal
    the encoder's hidden-state count (2 SmolLM3 layers + embeddings = 3).
    """
    from diffusers import BriaFiboTransformer2DModel

    from fastdit.testing.components.encoders import build

    return build(
        BriaFiboTransformer2DModel,
        seed=seed,
        patch_size=1,
        in_channels=_LATENT_CHANNELS,
        num_layers=num_layers,
        num_single_layers=num_single_layers,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=2 * _TEXT_WIDTH,  # the pipeline concatenates the last two encoder layers
        axes_dims_rope=[4, 6, 6],
        text_encoder_dim=_TEXT_WIDTH,
    )


def _components(seed: int) -> dict:
    from diffusers import FlowMatchEulerDiscreteScheduler

    from fastdit.testing.components.autoencoder_kl_wan import autoencoder_kl_wan
    from fastdit.testing.components.smollm3 import smollm3_model

    text_encoder, tokenizer = smollm3_model(hidden_size=_TEXT_WIDTH, seed=seed)
    return {
        "transformer": tiny_transformer(seed),
        "scheduler": FlowMatchEulerDiscreteScheduler(),
        # Wan 2.2 layout: spatial factor 16, as FIBO expects.
        "vae": autoencoder_kl_wan(latent_channels=_LATENT_CHANNELS, wan22=True, seed=seed),
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
    }


def tiny_bria_fibo(seed: int = 0):
    """A complete tiny ``BriaFiboPipeline`` (SmolLM3 text encoder, Wan 2.2-style VAE)."""
    from diffusers import BriaFiboPipeline

    return BriaFiboPipeline(**_components(seed))


def tiny_bria_fibo_edit(seed: int = 0):
    """A complete tiny ``BriaFiboEditPipeline`` (the reference image is VAE-encoded and appended as tokens)."""
    from diffusers import BriaFiboEditPipeline

    return BriaFiboEditPipeline(**_components(seed))


# FIBO is prompted with structured JSON. guidance_scale > 1 batches cond and uncond in one call; the default empty
# negative prompt exercises the hard-coded <|begin_of_text|> id path.
_CALL = {
    "height": 64,
    "width": 64,
    "num_inference_steps": 2,
    "guidance_scale": 5.0,
    "max_sequence_length": 64,
}

# Context parallelism: the forward is "embed, loop over blocks, project out", and what it does between blocks is
# token-wise (channel concatenations; [text | image] concatenated and cut by the local text length), so the root
# inputs are split. RoPE is computed inside forward from cat(txt_ids, img_ids), split on their sequence dim (-2 for
# 2-D and 3-D ids) like the streams. The per-block text-encoder layers arrive as a list, which a root split does not
# reach: each `caption_projection` output (B, S_text, D/2) is split instead, like the text stream it is concatenated
# to. The pipeline's padding mask (in joint_attention_kwargs) covers the global [text, image] sequence and stays whole:
# attention reorders it into shard order by mask_segments. Single blocks use Bria's processor, hence two modules.
CP_PLAN = mmdit_root_plan(
    "diffusers.models.transformers.transformer_bria_fibo",
    "diffusers.models.transformers.transformer_bria",
    outputs={"caption_projection.*": SplitOutput(dim=1, expected_dims=3)},
    notes="RoPE from img_ids/txt_ids and the per-block text layers split with the streams; global mask reordered.",
)

# Tensor parallelism: FLUX.1's split. Both processors reshape with ``attn.heads`` (divided); the QK-norms are per head
# (replicated). The per-block AdaLN linears (dim -> 6·dim per stream and dual block, dim -> 3·dim per single block) are
# split with a gathered output, as for FLUX.1. The forward's channel work between blocks (the text stream's upper
# half overwritten by a caption projection, with the root's ``inner_dim``) is on whole-width block outputs, so the
# caption projections and the root's ``inner_dim`` stay whole. The single block's proj_out reads
# cat([attn_out, mlp_hidden]): each stream is split on its own.
TP_PLAN = flux1_tp_plan(
    notes="FLUX.1's split plus per-block AdaLN modulation split with a gathered output; caption projections, "
    "embedders and QK-norms (per head) replicated.",
)

# The pipelines pass the same position ids and prompt embeddings at every step: the rotary table (computed in forward
# from cat(txt_ids, img_ids)) and the text projection repeat, keyed on the transformer's arguments, which context
# parallelism splits beneath the lookup (a new shard every call). Each block's caption projection reads its own entry
# of the same `text_encoder_layers` list every step (its own argument; the CP plan's split of its output runs around
# the lookup).
STEP_INVARIANT = (
    StepInvariant("pos_embed", inputs=("txt_ids", "img_ids")),
    StepInvariant("context_embedder", inputs=("encoder_hidden_states",)),
    StepInvariant("caption_projection.*"),
)

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "transformer_blocks": (
        ("attn.to_q", "attn.to_k", "attn.to_v"),
        ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    ),
    "single_transformer_blocks": (("proj_mlp", "attn.to_q", "attn.to_k", "attn.to_v"),),
}

ADAPTER = register(
    ModelAdapter(
        family="bria_fibo",
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
            TinyPipeline(
                name="fibo",
                build=tiny_bria_fibo,
                call_kwargs={**_CALL, "prompt": '{"short_description": "a cat holding a sign"}'},
            ),
            TinyPipeline(
                name="edit",
                build=tiny_bria_fibo_edit,
                # Explicit height/width: without them the output snaps to a ~1 MP preferred resolution.
                call_kwargs=LazyKwargs(
                    {
                        **_CALL,
                        "prompt": '{"edit_instruction": "make the cat red"}',
                        "image": tiny_image(64),
                    }
                ),
            ),
        ),
        presets=(
            ModelPreset(
                name="bria-fibo",
                pipeline_class="diffusers.BriaFiboPipeline",
                hub_id="briaai/FIBO",
                defaults={"num_inference_steps": 50, "guidance_scale": 5.0, "height": 1024, "width": 1024},
            ),
            ModelPreset(
                name="bria-fibo-edit",
                pipeline_class="diffusers.BriaFiboEditPipeline",
                hub_id="briaai/Fibo-Edit-1.5-base",
                defaults={"num_inference_steps": 30, "guidance_scale": 5.0},
            ),
            ModelPreset(
                name="bria-fibo-edit-turbo",
                pipeline_class="diffusers.BriaFiboEditPipeline",
                hub_id="briaai/Fibo-Edit-1.5-turbo",
                defaults={"num_inference_steps": 4, "guidance_scale": 1.0},
            ),
        ),
        notes=(
            "Extra ops inside the block loop: the text stream's upper half is replaced per block by a projected "
            "text-encoder layer, and single blocks get [text | image] concatenated as hidden_states (split again "
            "after). A joint padding mask travels in joint_attention_kwargs when text is padded. CFG is batched in "
            "one call and the pipeline opens no cache contexts."
            " No spectral signal: the latent arrives packed into a token sequence (batch, tokens, channels): no grid "
            "to filter."
        ),
    )
)
