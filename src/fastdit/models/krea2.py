"""Krea 2 (base and distilled turbo): ``Krea2Transformer2DModel``, a single-stream MMDiT with GQA.

Blocks (diffusers 0.42.1): one list, ``transformer_blocks`` (28 ``Krea2TransformerBlock``), called positionally with
``(hidden_states, temb, image_rotary_emb, attention_mask)`` on the concatenated ``[text | image]`` sequence and
returning one tensor (pattern 3). Before the loop a small text-fusion transformer
(``text_fusion.layerwise_blocks`` across tapped encoder layers, then ``text_fusion.refiner_blocks`` across tokens)
prepares the text; it runs once per call and is not declared. Nothing runs between blocks.
"""

from __future__ import annotations

from fastdit.models.base import BlockGroup, ForwardPattern, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, SplitInput, SplitOutput
from fastdit.parallel.tp_plan import Colwise, Rowwise, Style, TensorParallelPlan
from fastdit.parallel.tp_shapes import under

TRANSFORMER = "diffusers.models.transformers.transformer_krea2.Krea2Transformer2DModel"

_LATENT_CHANNELS = 4
_TEXT_LAYERS = (0, 1, 2)  # every hidden state of the 2-layer tiny encoder (embeddings included)


def tiny_transformer(seed: int = 0, *, num_layers: int = 3):
    """A 3-block ``Krea2Transformer2DModel``: 4 query heads over 1 KV head of 16 (GQA 4:1, as 48:12 in Krea 2)."""
    from diffusers import Krea2Transformer2DModel

    from fastdit.testing.components.encoders import build

    return build(
        Krea2Transformer2DModel,
        seed=seed,
        in_channels=_LATENT_CHANNELS * 4,
        num_layers=num_layers,
        attention_head_dim=16,
        num_attention_heads=4,
        num_key_value_heads=1,
        intermediate_size=128,
        timestep_embed_dim=32,
        text_hidden_dim=32,
        num_text_layers=len(_TEXT_LAYERS),
        text_num_attention_heads=2,
        text_num_key_value_heads=2,
        text_intermediate_size=64,
        num_layerwise_text_blocks=1,
        num_refiner_text_blocks=1,
        axes_dims_rope=(4, 6, 6),
    )


def _pipeline(seed: int, distilled: bool):
    from diffusers import FlowMatchEulerDiscreteScheduler, Krea2Pipeline

    from fastdit.testing.components.autoencoder_kl_qwenimage import autoencoder_kl_qwenimage
    from fastdit.testing.components.qwen3_vl import qwen3_vl_model

    text_encoder, tokenizer = qwen3_vl_model(seed=seed)
    return Krea2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=autoencoder_kl_qwenimage(latent_channels=_LATENT_CHANNELS, seed=seed),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=tiny_transformer(seed),
        text_encoder_select_layers=_TEXT_LAYERS,
        is_distilled=distilled,
    )


def tiny_krea2(seed: int = 0):
    """A complete tiny ``Krea2Pipeline`` (Qwen3-VL text encoder, Qwen-Image VAE with scale factor 8)."""
    return _pipeline(seed, distilled=False)


def tiny_krea2_turbo(seed: int = 0):
    """A complete tiny distilled ``Krea2Pipeline`` (fixed timestep shift, no CFG)."""
    return _pipeline(seed, distilled=True)


_CALL = {
    "prompt": "a cat holding a sign",
    "height": 32,
    "width": 32,
    "num_inference_steps": 2,
    "max_sequence_length": 16,
}

# Context parallelism: forward concatenates [text | image] itself, so the joint sequence is split (one contiguous split)
# at the first block, and `rotary_emb`'s (cos, sin) tables over the same joint sequence (S, D) are split on dim 0. The
# key-padding mask (B, 1, 1, S) indexes the global joint sequence in that order. Forward drops the text tokens by a
# global slice right after the last block, so the sequence is gathered at that block's output. The text-fusion
# blocks (across encoder layers, then across the whole text) run before the split on replicated text: local.
CP_PLAN = ContextParallelPlan(
    inputs={"transformer_blocks.0": {"hidden_states": SplitInput(dim=1, expected_dims=3)}},
    outputs={
        "rotary_emb": (SplitOutput(dim=0, expected_dims=2, index=0), SplitOutput(dim=0, expected_dims=2, index=1))
    },
    gather={"transformer_blocks.-1": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(modules=("diffusers.models.transformers.transformer_krea2",), local=("text_fusion",)),
    notes=(
        "Joint [text | image] sequence split at transformer_blocks.0, RoPE tables from `rotary_emb` on dim 0, "
        "gathered at the last block (before the text slice); text-fusion attention local."
    ),
)

# Tensor parallelism. Krea2AttnProcessor reshapes q with ``attn.num_heads`` and k/v with ``attn.num_kv_heads`` (both
# divided), then repeats each KV head over its ``num_heads // num_kv_heads`` query heads: with both head counts split
# by the same degree, rank r's query heads are exactly the ones its KV heads serve, and the ratio stays. The sigmoid
# output gate (to_gate) multiplies the flattened heads, so it is split like q; to_out is row-wise. The SwiGLU FFN is
# gate/up column-wise, down row-wise. QK-norms are per head (replicated). Modulation is one shared root projection
# (time_mod_proj) plus a small per-block table (scale_shift_table parameter): both replicated, like the text fusion
# stage, the embedders and the final layer. When the degree does not divide the KV heads (Krea 2: 12, so tp=8; the
# tiny model: 1), only the FFN is split and attention stays replicated.
_FFN: dict[str, Style] = {"ff.gate": Colwise(), "ff.up": Colwise(), "ff.down": Rowwise()}
TP_PLAN = TensorParallelPlan(
    layers=under(
        "transformer_blocks.*",
        {
            **{f"attn.to_{name}": Colwise() for name in ("q", "k", "v", "gate")},
            "attn.to_out.0": Rowwise(),
            **_FFN,
        },
    ),
    divide=("transformer_blocks.*.attn.num_heads", "transformer_blocks.*.attn.num_kv_heads"),
    notes="Q and KV heads split together (GQA groups stay whole), output gate like q; FFN-only fallback when tp does "
    "not divide the KV heads; shared modulation and per-block tables replicated.",
    fallback=TensorParallelPlan(
        layers=under("transformer_blocks.*", _FFN),
        notes="FFN only: tp does not divide the KV heads, attention replicated.",
        name="ffn-only",
    ),
)

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "transformer_blocks": (
        ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_gate"),
        ("ff.gate", "ff.up"),
    ),
}

ADAPTER = register(
    ModelAdapter(
        family="krea2",
        fused_projections=FUSED_PROJECTIONS,
        # CFG as two unannounced calls per step, each output used only after both: paired by timestep.
        cfg_pairs_by_timestep=True,
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="transformer_blocks", pattern=ForwardPattern.P3),),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        tiny_pipelines=(
            # guidance_scale > 0 turns on CFG: a cond then an uncond call per step, without cache contexts.
            TinyPipeline(
                name="krea2", build=tiny_krea2, call_kwargs={**_CALL, "negative_prompt": "blue", "guidance_scale": 4.5}
            ),
            TinyPipeline(name="turbo", build=tiny_krea2_turbo, call_kwargs={**_CALL, "guidance_scale": 0.0}),
        ),
        presets=(
            ModelPreset(
                name="krea2",
                pipeline_class="diffusers.Krea2Pipeline",
                # No public diffusers-format repository: point KREA2_DIR at a converted checkpoint.
                hub_id="",
                defaults={"num_inference_steps": 28, "guidance_scale": 4.5, "height": 1024, "width": 1024},
            ),
            ModelPreset(
                name="krea2-turbo",
                pipeline_class="diffusers.Krea2Pipeline",
                hub_id="",
                defaults={"num_inference_steps": 8, "guidance_scale": 0.0, "height": 1024, "width": 1024},
            ),
        ),
        notes=(
            "GQA: 48 query / 12 KV heads (the processor repeats K/V to 48 heads before attention, so Ulysses splits "
            "the 48 query heads, padded when uneven). Blocks see "
            "[text | image] with a key-padding mask over the fixed-length text (max_sequence_length) and RoPE from "
            "position_ids built by the pipeline; the output keeps only the image tokens. The pipeline opens no "
            "cache contexts: CFG is two calls per step with the same timestep."
            " No spectral signal: the latent arrives packed into a token sequence (batch, tokens, channels): no grid "
            "to filter."
        ),
    )
)
