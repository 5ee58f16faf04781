"""PRX (Photoroom) latent and pixel-space text-to-image: ``PRXTransformer2DModel``.

Blocks (diffusers 0.42.1): one list ``blocks`` of ``PRXBlock``, called by keyword as ``block(hidden_states=img,
encoder_hidden_states=txt, temb=vec, image_rotary_emb=pe, attention_mask=mask)`` and returning the image tokens only
(pattern 2): the text is projected once (``txt_in``) and every block reads it as keys and values beside the image
tokens (``PRXAttention``: image queries over ``[text, image]`` keys), the text itself is never updated. RoPE
(``pe_embedder``) covers the image tokens, as a ``(B, 1, S, d/2, 2, 2)`` table computed from the latent grid inside
forward. The text padding mask ``(B, S_txt)`` is widened by the processor to a key-padding mask over its
``[text, image]`` keys. Nothing runs between blocks.

``PRXPipeline`` (latent, AutoencoderKL or DC-AE) and ``PRXPixelPipeline`` (pixel space: ``in_channels=3``, a two-layer
bottleneck ``img_in`` and resolution embeddings, x0 prediction) share the transformer and batch CFG as ``[uncond;
cond]`` in one call.
"""

from __future__ import annotations

from fastdit.models.base import BlockGroup, ForwardPattern, LatentLayout, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, SplitInput, SplitOutput
from fastdit.parallel.tp_plan import Colwise, Rowwise, TensorParallelPlan
from fastdit.parallel.tp_shapes import modulation, under

TRANSFORMER = "diffusers.models.transformers.transformer_prx.PRXTransformer2DModel"
_MODULE = "diffusers.models.transformers.transformer_prx"

_LATENT_CHANNELS = 4
_TEXT_DIM = 32
_TEXT_TOKENS = 12  # both pipelines pad the prompt to a fixed token count


def tiny_transformer(seed: int = 0, *, pixel: bool = False):
    """A 3-block ``PRXTransformer2DModel`` (2 heads x 16, RoPE axes 8 + 8).

    Args:
        seed: Seed of the random weights.
        pixel: The pixel-space layout (RGB input, bottleneck ``img_in``, resolution embeddings).
    """
    from diffusers import PRXTransformer2DModel

    from fastdit.testing.components.encoders import build

    extra = {"in_channels": 3, "bottleneck_size": 16, "resolution_embeds": True} if pixel else {}
    return build(
        PRXTransformer2DModel,
        seed=seed,
        **{"in_channels": _LATENT_CHANNELS, **extra},
        patch_size=2,
        context_in_dim=_TEXT_DIM,
        hidden_size=32,
        mlp_ratio=2.0,
        num_heads=2,
        depth=3,
        axes_dim=[8, 8],
    )


def _text_encoder(seed: int):
    """A tiny ``T5GemmaEncoder`` (the encoder half of T5Gemma) and a Gemma tokenizer padded to a short length."""
    import copy

    from transformers import T5GemmaConfig
    from transformers.models.t5gemma.modeling_t5gemma import T5GemmaEncoder

    from fastdit.testing.components.decoder_lm import decoder_lm_kwargs
    from fastdit.testing.components.encoders import build
    from fastdit.testing.components.gemma2 import gemma_tokenizer

    tokenizer = copy.deepcopy(gemma_tokenizer(model_max_length=_TEXT_TOKENS))
    module = decoder_lm_kwargs(tokenizer, _TEXT_DIM, 2, sliding_window=64)
    # The encoder's config is the composite's encoder part (the composite fills in its dropout fields).
    config = T5GemmaConfig(encoder=module, decoder=module, vocab_size=module["vocab_size"])
    return build(T5GemmaEncoder, config.encoder, seed=seed), tokenizer


def tiny_prx(seed: int = 0):
    """A complete tiny ``PRXPipeline`` (T5Gemma encoder, 4-channel KL VAE with scale factor 2)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, PRXPipeline

    from fastdit.testing.components.autoencoder_kl import autoencoder_kl

    text_encoder, tokenizer = _text_encoder(seed)
    return PRXPipeline(
        transformer=tiny_transformer(seed),
        scheduler=FlowMatchEulerDiscreteScheduler(),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        # The pipeline decodes with latents / scaling_factor + shift_factor: the shift must be a number.
        vae=autoencoder_kl(latent_channels=_LATENT_CHANNELS, num_levels=2, shift_factor=0.0, seed=seed),
        default_sample_size=32,
    )


def tiny_prx_pixel(seed: int = 0):
    """A complete tiny ``PRXPixelPipeline`` (pixel space: no VAE; T5Gemma encoder)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, PRXPixelPipeline

    text_encoder, tokenizer = _text_encoder(seed)
    return PRXPixelPipeline(
        transformer=tiny_transformer(seed, pixel=True),
        scheduler=FlowMatchEulerDiscreteScheduler(),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        default_sample_size=32,
        prompt_max_tokens=_TEXT_TOKENS,
    )


# guidance_scale > 1: CFG batched as [uncond; cond] in one transformer call. Resolution binning is off: its bins are
# for real resolutions (512 px and up).
_CALL = {
    "prompt": "a cat holding a sign",
    "guidance_scale": 4.0,
    "height": 32,
    "width": 32,
    "num_inference_steps": 2,
    "use_resolution_binning": False,
}

# Context parallelism: forward patchifies the latent and builds the image RoPE table from its grid, so the image tokens
# are split at the first block and the table at pe_embedder's output (dim 2 of (B, 1, S, d/2, 2, 2)). The text is
# projected token by token (txt_in) and then only read as keys and values: it is split at the root with its padding
# mask, so each rank's keys are [text shard, image shard] and the exchange gathers every key once (a replicated text
# would be attended once per rank). The processor widens the mask shard to a key-padding mask over the rank's local
# keys, which attention gathers in the keys' order. The final layer's output is gathered before the un-patchify.
CP_PLAN = ContextParallelPlan(
    inputs={
        "": {
            "encoder_hidden_states": SplitInput(dim=1, expected_dims=3),
            "attention_mask": SplitInput(dim=1, expected_dims=2),
        },
        "blocks.0": {"hidden_states": SplitInput(dim=1, expected_dims=3)},
    },
    outputs={"pe_embedder": SplitOutput(dim=2, expected_dims=6)},
    gather={"final_layer": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(modules=(_MODULE,)),
    notes="Image tokens split at blocks.0 with the RoPE table (pe_embedder's output); the text and its padding mask "
    "split at the root (keys and values only); gathered after final_layer.",
)

# Tensor parallelism: the fused image [Q|K|V] projection split per part and the fused text [K|V] projection alike (the
# processor reshapes each into (3 or 2, attn.heads, attn.head_dim): heads divided; QK-norms over head_dim, per head,
# whole), to_out row-wise; the gated MLP's gate and up column-wise, down row-wise; the per-block modulation (6 x dim)
# split with a gathered output. Embedders, RoPE and the final layer whole.
TP_PLAN = TensorParallelPlan(
    layers=under(
        "blocks.*",
        {
            "attention.img_qkv_proj": Colwise(segments=(1, 1, 1)),
            "attention.txt_kv_proj": Colwise(segments=(1, 1)),
            "attention.to_out.0": Rowwise(),
            "gate_proj": Colwise(),
            "up_proj": Colwise(),
            "down_proj": Rowwise(),
            **modulation("modulation.lin"),
        },
    ),
    divide=("blocks.*.attention.heads",),
    notes="Fused image QKV and text KV projections split per part (by heads), gated MLP by hidden size, per-block "
    "modulation split with a gathered output; QK-norms per head; embedders and final layer whole.",
)

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "blocks": (("gate_proj", "up_proj"),),
}

ADAPTER = register(
    ModelAdapter(
        family="prx",
        fused_projections=FUSED_PROJECTIONS,
        # hidden_states is (batch, channels, height, width). The pixel-space variant's grid is the image itself.
        latent=LatentLayout(),
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="blocks", pattern=ForwardPattern.P2),),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        tiny_pipelines=(
            TinyPipeline(name="t2i", build=tiny_prx, call_kwargs=_CALL),
            TinyPipeline(name="pixel", build=tiny_prx_pixel, call_kwargs=_CALL),
        ),
        presets=(
            ModelPreset(
                name="prx",
                pipeline_class="diffusers.PRXPipeline",
                hub_id="Photoroom/prx-512-t2i-sft",
                defaults={"num_inference_steps": 28, "guidance_scale": 4.0, "height": 512, "width": 512},
            ),
            ModelPreset(
                name="prx-pixel",
                pipeline_class="diffusers.PRXPixelPipeline",
                hub_id="Photoroom/prxpixel-t2i",
                defaults={"num_inference_steps": 28, "guidance_scale": 4.0, "height": 1024, "width": 1024},
            ),
        ),
        notes=(
            "Image tokens attend over [text, image] keys; the text stream is projected once and never updated (blocks "
            "return the image tokens only). The prompt is padded to a fixed length with a key-padding mask. CFG is "
            "batched as [uncond; cond] in one call. The pixel-space variant (PRXPixelPipeline) has no VAE, predicts "
            "x0 and adds a resolution embedding to the timestep vector. No expert layers."
        ),
    )
)
