"""OmniGen (text-to-image and instruction editing): ``OmniGenTransformer2DModel``.

Blocks (diffusers 0.42.1): one list ``layers`` of ``OmniGenBlock`` (a Phi-3 decoder layer); the model calls each as
``block(hidden_states, attention_mask=..., image_rotary_emb=...)`` and the block returns the hidden states (pattern
3). Before the loop, forward builds one sequence ``[condition tokens | time token | output-image tokens]``: the
prompt's token embeddings with the input images' patch embeddings written over their placeholder tokens, then the
timestep as one token, then the noisy latent's patches. The processor's ``(B, S, S)`` mask is causal over the
condition and time tokens, bidirectional within each image, and pads the text on the left; forward turns it into an
additive ``(B, 1, S, S)`` mask. RoPE (Phi-3's SuScaled) is computed inside forward from ``position_ids``: one
``(S, head_dim)`` (cos, sin) pair, from the first sample's positions (``[0]``), shared by the whole batch.
"""

from __future__ import annotations

from fastdit.models._lazy import Deferred, LazyKwargs
from fastdit.models.base import BlockGroup, ForwardPattern, LatentLayout, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, SplitInput, SplitOutput
from fastdit.parallel.tp_plan import Colwise, Rowwise, TensorParallelPlan
from fastdit.parallel.tp_shapes import attention, under

TRANSFORMER = "diffusers.models.transformers.transformer_omnigen.OmniGenTransformer2DModel"

_HIDDEN = 32
_HEADS = 2
_HEAD_DIM = _HIDDEN // _HEADS
# 32 pixels: the processor counts 16 pixels per token side (VAE factor 8 x patch 2), so 2 x 2 output tokens.
_SIZE = 32


def tiny_transformer(seed: int = 0):
    """A 3-layer ``OmniGenTransformer2DModel`` (2 heads, no GQA, as OmniGen-v1) over the tiny Phi-3 vocabulary."""
    from diffusers import OmniGenTransformer2DModel

    from fastdit.testing.components.encoders import build

    return build(
        OmniGenTransformer2DModel,
        seed=seed,
        in_channels=4,
        patch_size=2,
        hidden_size=_HIDDEN,
        num_attention_heads=_HEADS,
        num_key_value_heads=_HEADS,
        intermediate_size=64,
        num_layers=3,
        pad_token_id=2,  # the collator pads with id 2
        vocab_size=256,
        rope_scaling={"short_factor": [1.0] * (_HEAD_DIM // 2), "long_factor": [1.0] * (_HEAD_DIM // 2)},
        pos_embed_max_size=8,
        time_step_dim=16,
    )


def tiny_omnigen(seed: int = 0):
    """A complete tiny ``OmniGenPipeline`` (SDXL-style VAE of factor 8, the tiny Phi-3 tokenizer)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from fastdit.testing.components.autoencoder_kl import autoencoder_kl
    from fastdit.testing.components.omnigen import omnigen_pipeline
    from fastdit.testing.components.phi3 import phi3_tokenizer

    # The pipeline wraps the tokenizer in OmniGen's multimodal processor (placeholders, masks, positions), which
    # diffusers builds with torchvision; without it the processor's image transform is rebuilt in torch.
    return omnigen_pipeline(
        transformer=tiny_transformer(seed),
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=autoencoder_kl(num_levels=4, scaling_factor=0.13025, seed=seed),
        tokenizer=phi3_tokenizer(),
    )


def _input_images(size: int) -> list:
    from fastdit.testing.components.images import random_image

    return [random_image(size)]


_CALL = {
    "prompt": "a cat holding a sign",
    "height": _SIZE,
    "width": _SIZE,
    "num_inference_steps": 2,
    "guidance_scale": 2.5,
}

# Context parallelism: the sequence exists only inside forward, so the first block's hidden states are split on the
# token dim, and the (cos, sin) tables the rope module returns for that sequence are split alike (rows = tokens).
# The additive (B, 1, S, S) mask covers the global sequence and stays whole: attention puts it in shard order. The
# processor calls F.scaled_dot_product_attention itself; its module's F is routed. forward keeps the last
# output-image tokens of the sequence after the final norm (a global slice), so the norm's output is gathered.
CP_PLAN = ContextParallelPlan(
    inputs={"layers.0": {"hidden_states": SplitInput(dim=1, expected_dims=3)}},
    outputs={"rope": (SplitOutput(dim=0, expected_dims=2, index=0), SplitOutput(dim=0, expected_dims=2, index=1))},
    gather={"norm": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(sdpa_modules=("diffusers.models.transformers.transformer_omnigen",)),
    notes="The [condition | time | image] sequence split at the first layer, the RoPE tables at the rope module's "
    "output; the global causal/bidirectional mask is put in shard order in attention; gathered after the final norm.",
)

# Tensor parallelism: Phi-3's layer. q/k/v column-wise and o row-wise with the heads divided; the processor reshapes
# its output with attn.out_dim, which is divided too, and derives the KV heads from the local widths. The fused
# [gate | up] projection is split per half, so each rank gates its own slice; down_proj row-wise. Replicated: token
# and patch embeddings, the time embedders, the RMSNorms (over whole hidden states), norm_out, proj_out.
TP_PLAN = TensorParallelPlan(
    layers=under(
        "layers.*",
        {
            **attention("self_attn"),
            "mlp.gate_up_proj": Colwise(segments=(1, 1)),
            "mlp.down_proj": Rowwise(),
        },
    ),
    divide=("layers.*.self_attn.heads", "layers.*.self_attn.out_dim"),
    notes="Attention (heads and out_dim divided) and the fused [gate | up] MLP split per half; embeddings and norms "
    "replicated.",
)

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "layers": (("self_attn.to_q", "self_attn.to_k", "self_attn.to_v"),),
}

ADAPTER = register(
    ModelAdapter(
        family="omnigen",
        fused_projections=FUSED_PROJECTIONS,
        # hidden_states is (batch, channels, height, width). Input images arrive apart, in input_img_latents.
        latent=LatentLayout(),
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="layers", pattern=ForwardPattern.P3),),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        # The RoPE tables come from the first sample's positions only; a rank computing the second half of the
        # CFG batch must still see the first sample's, so position_ids passes whole.
        cfg_batch_dims={"position_ids": None},
        tiny_pipelines=(
            TinyPipeline(name="t2i", build=tiny_omnigen, call_kwargs=_CALL),
            TinyPipeline(
                name="edit",
                build=tiny_omnigen,
                call_kwargs=LazyKwargs(
                    {
                        **_CALL,
                        "prompt": "<img><|image_1|></img> make the cat red",
                        "input_images": Deferred(_input_images, (_SIZE,)),
                    }
                ),
            ),
        ),
        presets=(
            ModelPreset(
                name="omnigen",
                pipeline_class="diffusers.OmniGenPipeline",
                hub_id="Shitao/OmniGen-v1-diffusers",
                defaults={"num_inference_steps": 50, "guidance_scale": 2.5, "height": 1024, "width": 1024},
            ),
        ),
        notes=(
            "One decoder sequence [condition tokens | time token | output-image tokens], built inside forward; the "
            "processor's mask (causal text, bidirectional images, left padding) becomes an additive (B, 1, S, S) "
            "mask, and RoPE is computed from position_ids inside forward. CFG is batched: [cond, uncond] for "
            "text-to-image, [cond, uncond, image-cond] for editing, which two ranks cannot halve: an editing call "
            "is refused under cfg=2. diffusers' OmniGen pipeline has no KV cache (the original implementation's "
            "use_kv_cache is not ported), so every step recomputes the condition tokens."
        ),
    )
)
