"""DreamLite (text-to-image and instruction editing, base and mobile): ``DreamLiteTransformer2DModel``.

DreamLite is a UNet (``DreamLiteUNetModel``, diffusers 0.42.1): ResNet stages with a ``DreamLiteTransformer2DModel``
after each ResNet of the cross-attention stages, at every resolution of the down, mid and up paths. Each of those
transformers runs its ``transformer_blocks`` (``BasicTransformerBlockDreamLite``: optional self-attention, cross-
attention to the text, GEGLU FFN; GQA with ``num_kv_heads`` and RMS QK-norms), called as ``block(hidden_states,
attention_mask=..., encoder_hidden_states=..., ...)`` and returning the hidden states (pattern 2). The family serves
the UNet (the pipelines' denoiser: its transformer stacks are the block lists, found by ``*`` paths since the number
of stages and transformers follows the config) and the bare ``DreamLiteTransformer2DModel`` (its one list).
"""

from __future__ import annotations

from fastdit.models._lazy import LazyKwargs, tiny_image
from fastdit.models.base import BlockGroup, ForwardPattern, LatentLayout, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, SplitInput
from fastdit.parallel.tp_plan import Colwise, Rowwise, Style, TensorParallelPlan
from fastdit.parallel.tp_shapes import feed_forward, under

TRANSFORMER = "diffusers.models.transformers.transformer_2d_dreamlite.DreamLiteTransformer2DModel"
UNET = "diffusers.models.unets.unet_dreamlite.DreamLiteUNetModel"

_TEXT_DIM = 32
_SIZE = 32  # pixels: 4 x 4 latents (VAE factor 8), 4 x 8 with the condition image beside them

# The transformer stacks of the UNet in execution order (down path, mid block, up path), then the bare
# transformer's own list. Stages without a transformer (plain ResNet stages) match nothing.
_UNET_STACKS = (
    "down_blocks.*.attentions.*.transformer_blocks",
    "mid_block.attentions.*.transformer_blocks",
    "up_blocks.*.attentions.*.transformer_blocks",
)
_BARE = "transformer_blocks"


def tiny_unet(seed: int = 0):
    """A two-stage ``DreamLiteUNetModel`` with every DreamLite block kind but the plain ResNet stages.

    Down: a no-self-attention stage, then a self- and cross-attention stage; the mid block; up: the two mirrored
    (2 transformers each): 7 transformer stacks of one block. Depthwise-separable convolutions, RMS QK-norms, one KV
    head (MQA), the ``text_proj_rms`` text projection and the ``time`` (size) embedding, as DreamLite's release.
    """
    from diffusers.models.unets.unet_dreamlite import DreamLiteUNetModel

    from fastdit.testing.components.encoders import build

    return build(
        DreamLiteUNetModel,
        seed=seed,
        in_channels=4,
        out_channels=4,
        down_block_types=("DreamLiteCrossAttnNoSelfAttnDownBlock2D", "DreamLiteCrossAttnDownBlock2D"),
        mid_block_type="DreamLiteUNetMidBlock2DCrossAttn",
        up_block_types=("DreamLiteCrossAttnUpBlock2D", "DreamLiteCrossAttnNoSelfAttnUpBlock2D"),
        block_out_channels=(16, 32),
        layers_per_block=1,
        norm_num_groups=4,
        cross_attention_dim=_TEXT_DIM,
        attention_head_dim=2,  # diffusers' UNet name for the head count
        encoder_hid_dim_type="text_proj_rms",
        encoder_hid_dim=_TEXT_DIM,
        addition_embed_type="time",
        addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=16,  # two size values (width, height) x 8
        qk_norm="rms_norm",
        use_sep_conv=True,
        ff_mult=2,
        num_kv_heads=1,
    )


def tiny_vae(seed: int = 0):
    """An ``AutoencoderTiny`` (TAESD) of 8 channels per level, one block each (factor 8)."""
    from diffusers import AutoencoderTiny

    from fastdit.testing.components.encoders import build

    return build(
        AutoencoderTiny,
        seed=seed,
        encoder_block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8),
        num_encoder_blocks=(1, 1, 1, 1),
        num_decoder_blocks=(1, 1, 1, 1),
        latent_channels=4,
    )


def _components(seed: int) -> dict:
    from diffusers import FlowMatchEulerDiscreteScheduler

    from fastdit.testing.components.qwen3_vl import qwen3_vl_generation_model, qwen3_vl_processor

    # One decoder layer: the pipelines read the last hidden states, and the chat template makes the prompts long.
    text_encoder, tokenizer = qwen3_vl_generation_model(hidden_size=_TEXT_DIM, num_layers=1, seed=seed)
    return {
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "processor": qwen3_vl_processor(tokenizer),
        "vae": tiny_vae(seed),
        "unet": tiny_unet(seed),
        "scheduler": FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True),
    }


def tiny_dreamlite(seed: int = 0):
    """A complete tiny ``DreamLitePipeline`` (Qwen3-VL encoder, TAESD, flow matching with dynamic shift)."""
    from diffusers import DreamLitePipeline

    return DreamLitePipeline(**_components(seed))


def tiny_dreamlite_mobile(seed: int = 0):
    """A complete tiny ``DreamLiteMobilePipeline`` (the guidance-distilled few-step variant, same components)."""
    from diffusers import DreamLiteMobilePipeline

    return DreamLiteMobilePipeline(**_components(seed))


_CALL = {
    "prompt": "a cat holding a sign",
    "height": _SIZE,
    "width": _SIZE,
    "num_inference_steps": 2,
    "max_sequence_length": 16,
}

# Context parallelism inside the transformer stacks only. Between them the UNet runs 3x3 (or depthwise-separable)
# convolutions, strided down/upsampling and GroupNorms over the whole feature map, and each stack's own GroupNorm,
# proj_in / proj_out (1x1 convolutions over the (B, C, H, W) map) and residual do too; so the (B, H*W, C) tokens are
# split where the stack's first block takes them and gathered where its last block returns them, every rank running
# everything outside the blocks on the whole map as on one device. Inside a block every other operation is per token:
# LayerNorms over channels, the GEGLU FFN, no positional embedding (positional_embeddings is never set); the
# pipelines pass no self-attention mask, one passed to the model is split with the keys. The self-attention (attn1) is
# context-parallel: the UNet installs DreamLiteAttnProcessor2_0 (unet_dreamlite: dispatch_attention_fn with a
# parallel_config; GQA heads repeated before the call, RMS QK-norms per head), the bare transformer keeps diffusers'
# AttnProcessor2_0 (attention_processor: F's SDPA). The cross-attention (attn2) reads the replicated text: local, its
# text mask applying to the local queries as on one device. A stack's paths exist either in the UNet or in the bare
# transformer: all optional.
_STACK_LISTS = (_BARE, *_UNET_STACKS)
CP_PLAN = ContextParallelPlan(
    inputs={
        **{f"{stack}.0": {"hidden_states": SplitInput(dim=1, expected_dims=3)} for stack in _STACK_LISTS},
        # A self-attention mask over the keys ((B, S) bool in the bare transformer, a (B, 1, S) bias from the UNet),
        # which the transformer passes whole to every block: each block's copy split like the tokens, a key-padding
        # mask over the local keys (whole, the processor would pad it to its local query length).
        **{f"{stack}.*": {"attention_mask": SplitInput(dim=-1)} for stack in _STACK_LISTS},
    },
    gather={f"{stack}.-1": GatherOutput(dim=1, expected_dims=3) for stack in _STACK_LISTS},
    attention=AttentionRouting(
        modules=("diffusers.models.unets.unet_dreamlite",),
        sdpa_modules=("diffusers.models.attention_processor",),
        local=tuple(f"{stack}.*.attn2" for stack in _STACK_LISTS),
    ),
    optional=(
        *(f"{stack}.0" for stack in _STACK_LISTS),
        *(f"{stack}.*" for stack in _STACK_LISTS),
        *(f"{stack}.-1" for stack in _STACK_LISTS),
        *(f"{stack}.*.attn2" for stack in _STACK_LISTS),
    ),
    notes="Tokens split inside each transformer stack only (at its first block, gathered after its last): the "
    "convolutions, GroupNorms and resamplers between and around the stacks run on the whole map; one all-gather per "
    "stack. No positional embedding; cross-attention to the replicated text local.",
)

# Tensor parallelism, in every transformer stack (the UNet's and the bare transformer's; a pattern a model lacks, such
# as attn1 of the no-self-attention stages, is optional). DreamLiteAttnProcessor2_0 reshapes q with attn.heads
# (divided) and derives the KV heads from the local key width, then repeats each over heads // kv_heads query heads:
# with q and k/v split by the same degree, rank r's query heads are those its KV heads serve, so k/v split in whole
# heads (a unit of inner_dim / heads). The QK-norms are RMS over head_dim (per head): replicated. The GEGLU FFN is
# split per half. ResNets, convolutions, GroupNorms, proj_in / proj_out and the embeddings stay replicated. When the
# degree does not divide the KV heads (DreamLite's single KV head), attention stays replicated too.
_HEAD = ("inner_dim", "heads")  # head_dim, read on the Attention before its heads are divided
_ATTENTION: dict[str, Style] = {
    **{
        f"{attn}.{name}": style
        for attn in ("attn1", "attn2")
        for name, style in (
            ("to_q", Colwise()),
            ("to_k", Colwise(unit=_HEAD)),
            ("to_v", Colwise(unit=_HEAD)),
            ("to_out.0", Rowwise()),
        )
    }
}
_STACKS = tuple(f"{path}.*" for path in (_BARE, *_UNET_STACKS))


def _layers(attention: dict[str, Style]) -> dict[str, Style]:
    layers: dict[str, Style] = {}
    for stack in _STACKS:
        layers.update(under(stack, {**attention, **feed_forward("ff", gated=True)}))
    return layers


def _plan(attention: dict[str, Style], **kwargs) -> TensorParallelPlan:
    layers = _layers(attention)
    divide = tuple(f"{stack}.{attn}.heads" for stack in _STACKS for attn in ("attn1", "attn2")) if attention else ()
    # Every pattern is optional: the UNet lacks the bare transformer's list and the bare transformer the UNet's,
    # and attn1 is absent from the no-self-attention stages.
    optional = (*layers, *(path.rpartition(".")[0] for path in divide))
    return TensorParallelPlan(layers=layers, divide=divide, optional=optional, **kwargs)


TP_PLAN = _plan(
    _ATTENTION,
    notes="In every transformer stack: Q and KV heads split together (k/v in whole heads), the GEGLU FFN split per "
    "half; attention replicated (no-attention fallback) when tp does not divide the KV heads (DreamLite's one); "
    "ResNets, convolutions and embeddings replicated.",
    fallback=_plan(
        {},
        notes="The GEGLU FFN of every transformer stack split per half; attention replicated: tp does not divide the "
        "KV heads.",
        name="no-attention",
    ),
)

_DEFAULTS = {"num_inference_steps": 30, "guidance_scale": 3.5, "height": 1024, "width": 1024}

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "down_blocks.*.attentions.*.transformer_blocks": (("attn2.to_k", "attn2.to_v"),),
    "mid_block.attentions.*.transformer_blocks": (
        ("attn1.to_q", "attn1.to_k", "attn1.to_v"),
        ("attn2.to_k", "attn2.to_v"),
    ),
    "up_blocks.*.attentions.*.transformer_blocks": (("attn2.to_k", "attn2.to_v"),),
}

ADAPTER = register(
    ModelAdapter(
        family="dreamlite",
        fused_projections=FUSED_PROJECTIONS,
        # The UNet's sample is (batch, channels, height, width). The bare transformer (a UNet stage: its
        # hidden_states are features, not the latent) takes no sample, and the spectral signal refuses its calls.
        latent=LatentLayout(arg="sample"),
        transformer_classes=(UNET, TRANSFORMER),
        block_groups=(
            BlockGroup(path=_BARE, pattern=ForwardPattern.P2, optional=True),
            *(BlockGroup(path=path, pattern=ForwardPattern.P2) for path in _UNET_STACKS),
        ),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        tiny_pipelines=(
            # One per pipeline class: the base pipeline's text-to-image (batched CFG) and the mobile pipeline's
            # editing (the processor's image-and-text prompt, the condition image beside the latent).
            TinyPipeline(name="t2i", build=tiny_dreamlite, call_kwargs={**_CALL, "guidance_scale": 3.5}),
            TinyPipeline(
                name="mobile-edit",
                build=tiny_dreamlite_mobile,
                call_kwargs=LazyKwargs({**_CALL, "prompt": "make it red", "image": tiny_image(_SIZE)}),
            ),
        ),
        presets=(
            ModelPreset(
                name="dreamlite",
                pipeline_class="diffusers.DreamLitePipeline",
                hub_id="carlofkl/DreamLite-base",
                defaults=_DEFAULTS,
            ),
            ModelPreset(
                name="dreamlite-mobile",
                pipeline_class="diffusers.DreamLiteMobilePipeline",
                hub_id="carlofkl/DreamLite-mobile",
                defaults={**_DEFAULTS, "num_inference_steps": 4},
            ),
        ),
        notes=(
            "A UNet: the block lists are the transformer stacks of its down, mid and up stages (one cache segment "
            "each, in execution order; the ResNets, down/upsamplers and skip connections between them run on "
            "every step, a cached step reusing each stack's residual). The self-attention-free stages keep norm1's "
            "output instead of a residual. The denoised latent sits beside the condition image on the width "
            "(a diptych; zeros for text-to-image). CFG is batched: [uncond, cond] for text-to-image, [uncond, "
            "image, text] for editing (which two ranks cannot halve: refused under cfg=2); the mobile pipeline is "
            "guidance-distilled (one call per step: refused). "
            "Context parallelism splits the tokens inside each transformer stack only: the stack's first block "
            "takes its rank's shard of the (B, H*W, C) tokens and its last block's output is all-gathered, so the "
            "3x3 convolutions, strided down- and upsampling and GroupNorms between the stacks (and each stack's "
            "GroupNorm, 1x1 proj_in / proj_out and residual) run on the whole feature map on every rank, as on one "
            "device. Only the blocks' self-attention (context-parallel), cross-attention to the replicated text "
            "(local) and GEGLU FFN are divided; the ResNets and resamplers are not, and every stack costs one "
            "all-gather of its output (7 per UNet call in the tiny config, one per transformer in DreamLite's). "
            "A stack's map must hold at least one token per rank (the deepest resolution bounds the degree)."
        ),
    )
)
