"""Lumina-Image 2.0: ``Lumina2Transformer2DModel``.

Blocks (diffusers 0.42.1): three lists of ``Lumina2TransformerBlock``, all called positionally with
``(hidden_states, attention_mask, image_rotary_emb, temb)`` and returning the hidden states alone (pattern 3).
``context_refiner`` runs on the prompt alone (no modulation), ``noise_refiner`` on the image tokens alone; then the
model packs ``[prompt (unpadded), image]`` into one sequence per sample and runs the main ``layers`` over it. Only
``layers`` is declared as a block group: the refiners are short per-stream embedding stages that always run.
"""

from __future__ import annotations

from fastdit.models.base import BlockGroup, ForwardPattern, LatentLayout, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, SplitInput
from fastdit.parallel.tp_plan import Colwise, Rowwise, Style, TensorParallelPlan
from fastdit.parallel.tp_shapes import modulation, under

TRANSFORMER = "diffusers.models.transformers.transformer_lumina2.Lumina2Transformer2DModel"

_TEXT_DIM = 32


def tiny_transformer(seed: int = 0):
    """A ``Lumina2Transformer2DModel`` with 3 main layers and one refiner layer per stream (2 query / 1 KV head)."""
    from diffusers import Lumina2Transformer2DModel

    from fastdit.testing.components.encoders import build

    return build(
        Lumina2Transformer2DModel,
        seed=seed,
        sample_size=16,
        patch_size=2,
        in_channels=4,
        hidden_size=32,
        num_layers=3,
        num_refiner_layers=1,
        num_attention_heads=2,
        num_kv_heads=1,
        multiple_of=16,
        axes_dim_rope=(4, 6, 6),
        cap_feat_dim=_TEXT_DIM,
    )


def tiny_lumina2(seed: int = 0):
    """A complete tiny ``Lumina2Pipeline`` (Gemma 2 text encoder, Flux-style VAE)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Lumina2Pipeline

    from fastdit.testing.components.autoencoder_kl import autoencoder_kl
    from fastdit.testing.components.gemma2 import gemma2_model

    text_encoder, tokenizer = gemma2_model(hidden_size=_TEXT_DIM, seed=seed + 1)
    return Lumina2Pipeline(
        transformer=tiny_transformer(seed),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=6.0),
        # The pipeline hard-codes a VAE scale factor of 8, so the VAE needs four levels.
        vae=autoencoder_kl(
            latent_channels=4, num_levels=4, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False
        ),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
    )


# forward packs the joint sequence [prompt without padding, image] per sample and builds its RoPE (B, S, ...) after
# the refiners, so the tokens are split at the first of `layers` and the RoPE table at every layer. The key-padding mask
# (B, S) stays whole: it indexes the global keys, which context-parallel attention sees in split order. The
# refiners run on whole, replicated sequences before the split and stay local. The output is gathered at norm_out,
# before forward unpacks each sample's image tokens. Lumina2AttnProcessor2_0 calls F.scaled_dot_product_attention
# itself: its module's F is routed.
CP_PLAN = ContextParallelPlan(
    inputs={
        "layers.0": {"hidden_states": SplitInput(dim=1, expected_dims=3)},
        # forward passes its whole RoPE variable to every layer.
        "layers.*": {"image_rotary_emb": SplitInput(dim=1, expected_dims=3)},
    },
    gather={"norm_out": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(
        sdpa_modules=("diffusers.models.transformers.transformer_lumina2",), local=("context_refiner", "noise_refiner")
    ),
    notes="Joint tokens and their RoPE split at layers.0 (after the local refiners); the padding mask stays whole.",
)

# Tensor parallelism. Lumina2AttnProcessor2_0 reshapes q with ``attn.heads`` (divided) and derives the KV head count
# from the local key width (key.shape[-1] // head_dim), then repeats each KV head over its heads // kv_heads query
# heads: with q and k/v split by the same degree, rank r's query heads are exactly those its KV heads serve. No module
# holds the KV head count (Attention keeps only inner_kv_dim), so k/v carry a unit of one head (inner_dim / heads) and
# a degree that would cut through a KV head is refused by the full plan. The QK-norms are per head (replicated). The
# SwiGLU FFN (linear_1 / linear_3 up, linear_2 down) of every block is split, and so is the per-block AdaLN linear
# (LuminaRMSNormZero: min(dim, 1024) -> 4·dim, ~14 % of a block; the context refiner has none), with a gathered
# output: its chunk(4) runs over the whole vector. Embedders, the caption embedder and norm_out stay whole. When the
# degree does not divide the KV heads (the tiny model's single one), attention stays replicated.
_FFN: dict[str, Style] = {
    "feed_forward.linear_1": Colwise(),
    "feed_forward.linear_3": Colwise(),
    "feed_forward.linear_2": Rowwise(),
}
_HEAD = ("inner_dim", "heads")  # head_dim, read on the Attention before its heads are divided
_ATTENTION: dict[str, Style] = {
    "attn.to_q": Colwise(),
    "attn.to_k": Colwise(unit=_HEAD),
    "attn.to_v": Colwise(unit=_HEAD),
    "attn.to_out.0": Rowwise(),
}
_BLOCKS = ("layers", "noise_refiner", "context_refiner")


def _lumina2_layers(attention: dict[str, Style]) -> dict[str, Style]:
    return {
        **under("layers.*", {**attention, **_FFN, **modulation("norm1.linear")}),
        **under("noise_refiner.*", {**attention, **_FFN, **modulation("norm1.linear")}),
        **under("context_refiner.*", {**attention, **_FFN}),
    }


TP_PLAN = TensorParallelPlan(
    layers=_lumina2_layers(_ATTENTION),
    divide=tuple(f"{blocks}.*.attn.heads" for blocks in _BLOCKS),
    notes="Q and KV heads split together (GQA groups stay whole, k/v in whole heads), SwiGLU FFNs and per-block AdaLN "
    "(gathered) split; attention replicated (no-attention fallback) when tp does not divide the KV heads.",
    fallback=TensorParallelPlan(
        layers=_lumina2_layers({}),
        notes="SwiGLU FFNs and per-block AdaLN (gathered) split; attention replicated: tp does not divide the KV "
        "heads.",
        name="no-attention",
    ),
)

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "layers": (
        ("attn.to_q", "attn.to_k", "attn.to_v"),
        ("feed_forward.linear_1", "feed_forward.linear_3"),
    ),
}

ADAPTER = register(
    ModelAdapter(
        family="lumina2",
        fused_projections=FUSED_PROJECTIONS,
        # hidden_states is (batch, channels, height, width).
        latent=LatentLayout(),
        # CFG as two unannounced calls per step, each output used only after both: paired by timestep.
        cfg_pairs_by_timestep=True,
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="layers", pattern=ForwardPattern.P3),),
        # The RoPE embedder reads the prompt mask's lengths on the host (.tolist()) to lay out the positions.
        host_reading_modules=("rope_embedder",),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        tiny_pipelines=(
            TinyPipeline(
                name="lumina2",
                build=tiny_lumina2,
                call_kwargs={
                    "prompt": "a cat holding a sign",
                    # 64 px -> 8x8 latents -> 16 image tokens.
                    "height": 64,
                    "width": 64,
                    "num_inference_steps": 2,
                    "guidance_scale": 4.0,
                    # The pipeline prepends a long system prompt: 192 tokens keep it and the prompt untruncated.
                    "max_sequence_length": 192,
                },
            ),
        ),
        presets=(
            ModelPreset(
                name="lumina2",
                pipeline_class="diffusers.Lumina2Pipeline",
                hub_id="Alpha-VLLM/Lumina-Image-2.0",
                defaults={"num_inference_steps": 50, "guidance_scale": 4.0, "height": 1024, "width": 1024},
            ),
        ),
        notes=(
            "The joint sequence of `layers` is [prompt without padding, image], so its length and the 3-axis RoPE "
            "(computed inside forward from the latent shape and the prompt mask) depend on the prompt; samples of "
            "different prompt lengths are right-padded and get an attention mask. Attention is GQA (num_kv_heads). "
            "The timestep rises during a run (0 = noise, 1 = image). True CFG: a second forward per step for the "
            "negative prompt, same timestep, no cache_context, dropped after `cfg_trunc_ratio`. The refiner lists "
            "(context_refiner, noise_refiner) run before `layers`."
        ),
    )
)
