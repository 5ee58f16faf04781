"""Cosmos 3 Omni (joint text / vision / sound / action world model): ``Cosmos3OmniTransformer``.

Blocks (diffusers 0.42.1): one list, ``layers`` (``Cosmos3VLTextMoTDecoderLayer``), a mixture-of-transformers
decoder over two packed 2-D streams: the causal *understanding* prefix (the prompt's tokens, embedded by the model
itself: the pipeline has no text encoder) and the *generation* tokens (vision, and sound / action when enabled). Each
layer is called positionally as ``layer(und_seq, gen_seq, rotary_emb)`` and returns ``(und_seq, gen_seq)``: in the
adapter the generation stream is the hidden stream and the understanding prefix takes the encoder slot (pattern 1).
Its attention runs two pathways: causal self-attention of the prefix and full attention of the generation tokens to
``[prefix, generation]``. Between layers the forward does nothing.

``Cosmos3OmniPipeline`` runs CFG as two calls per step in ``cache_context("cond")`` / ``("uncond")``; the two
branches pack prompts of different lengths. The per-token ``vision_timesteps`` carry the step.
"""

from __future__ import annotations

from fastdit.models.base import BlockGroup, ForwardPattern, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, HeadParallel, SplitInput
from fastdit.parallel.tp_plan import Colwise, Rowwise, Style, TensorParallelPlan
from fastdit.parallel.tp_shapes import under

TRANSFORMER = "diffusers.models.transformers.transformer_cosmos3.Cosmos3OmniTransformer"

_SIZE = 32

# A ChatML template (the tiny tokenizer ships none); the pipeline adds its own end-of-text and vision-start tokens.
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer():
    """A Qwen-style tokenizer with ``<|vision_start|>`` and a ChatML template (a private copy)."""
    import copy

    from fastdit.testing.components.tokenizers import qwen2_tokenizer

    tokenizer = copy.deepcopy(qwen2_tokenizer())
    tokenizer.chat_template = _CHAT_TEMPLATE
    return tokenizer


def tiny_transformer(seed: int = 0, *, vocab_size: int, latent_channels: int):
    """A 3-layer ``Cosmos3OmniTransformer`` (width 32, 4 query heads over 2 KV heads of 8, latent patch 2)."""
    from diffusers import Cosmos3OmniTransformer

    from fastdit.testing.components.encoders import build

    return build(
        Cosmos3OmniTransformer,
        seed=seed,
        head_dim=8,
        hidden_size=32,
        intermediate_size=64,
        latent_channel=latent_channels,
        latent_patch_size=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=3,
        patch_latent_dim=2 * 2 * latent_channels,
        vocab_size=vocab_size,
        # Interleaved 3-D mRoPE sections (temporal, height, width) over head_dim / 2 frequencies.
        rope_axes_dim=(2, 1, 1),
    )


def tiny_cosmos3(seed: int = 0):
    """A complete tiny ``Cosmos3OmniPipeline`` (Wan VAE, flow UniPC; the guardrail off, it downloads models)."""
    from diffusers import Cosmos3OmniPipeline, UniPCMultistepScheduler

    from fastdit.testing.components.autoencoder_kl_wan import autoencoder_kl_wan

    tokenizer = tiny_tokenizer()
    vae = autoencoder_kl_wan(seed=seed)
    transformer = tiny_transformer(seed, vocab_size=len(tokenizer), latent_channels=vae.config.z_dim)
    return Cosmos3OmniPipeline(
        transformer=transformer,
        text_tokenizer=tokenizer,
        vae=vae,
        scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0),
        enable_safety_checker=False,
    )


# Tensor parallelism: both pathways of every attention split by heads, Megatron-style. Cosmos3AttnProcessor views
# q/k/v with attn.num_attention_heads / num_key_value_heads (divided, so GQA keeps its ratio on each rank) and its
# QK-norms and rotary tables are per head (over head_dim): replicated. Both SwiGLU MLPs (the understanding `mlp` and
# the generation `mlp_moe_gen`: two dense experts chosen by stream, not a routed MoE, so each is split like a dense
# MLP) split gate/up column-wise and down row-wise. The token embedding, lm_head, the patch projections, the timestep
# embedder and the final norms stay replicated.
def _mlp(name: str) -> dict[str, Style]:
    return {f"{name}.gate_proj": Colwise(), f"{name}.up_proj": Colwise(), f"{name}.down_proj": Rowwise()}


_ATTENTION: dict[str, Style] = {
    **{f"self_attn.{p}": Colwise() for p in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")},
    "self_attn.to_out": Rowwise(),
    "self_attn.to_add_out": Rowwise(),
}
TP_PLAN = TensorParallelPlan(
    layers=under("layers.*", {**_ATTENTION, **_mlp("mlp"), **_mlp("mlp_moe_gen")}),
    divide=("layers.*.self_attn.num_attention_heads", "layers.*.self_attn.num_key_value_heads"),
    # ReLU² (Nemotron) MLPs have no gate projection.
    optional=("layers.*.mlp.gate_proj", "layers.*.mlp_moe_gen.gate_proj"),
    notes="Both attention pathways split by (query and KV) heads, both stream MLPs (dense, per stream: no routed "
    "experts) split; per-head QK-norms, the token embedding, lm_head and the patch / timestep projections "
    "replicated.",
)

# Context parallelism: both packed 2-D streams (S, D) split along their tokens at layers.0 and gathered after the
# last layer (forward reads the predictions by global index from the joined sequence). The attention works on the
# global sequence: the prefix pathway is causal over the whole prefix and the generation queries attend to
# [prefix keys, generation keys], so it is head-parallel with two pathways: the six projections leave as the whole
# stream of this rank's heads (the QK-norms are per head, after them; k/v have num_key_value_heads, kept in step
# with the query heads so every rank's GQA groups match), each pathway's result returns to its own stream's shard
# before to_out / to_add_out. The rotary tables (S, head_dim) are per stream and pass whole.
_PATHWAYS = HeadParallel(
    inputs=("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"),
    output=("to_out", "to_add_out"),
    queries=("to_q", "add_q_proj"),
    heads="num_attention_heads",
    divide=("num_attention_heads", "num_key_value_heads"),
    input_heads={p: "num_key_value_heads" for p in ("to_k", "to_v", "add_k_proj", "add_v_proj")},
)
CP_PLAN = ContextParallelPlan(
    inputs={
        "layers.0": {
            "und_seq": SplitInput(dim=0, expected_dims=2),
            "gen_seq": SplitInput(dim=0, expected_dims=2),
        }
    },
    gather={"layers.-1": GatherOutput(dim=0, expected_dims=2, index=(0, 1))},
    attention=AttentionRouting(head_parallel={"layers.*.self_attn": _PATHWAYS}),
    notes="Prefix and generation streams split at layers.0; both attention pathways head-parallel (the causal "
    "prefix and the generation attention to [prefix, generation] on the whole streams of the rank's query and KV "
    "heads); gathered after the last layer.",
)

_CALL = {
    "prompt": "a cat holding a sign",
    "negative_prompt": "blue",
    "num_frames": 5,  # 2 latent frames (the tiny Wan VAE compresses time by 4)
    "height": _SIZE,
    "width": _SIZE,
    "fps": 24.0,
    "num_inference_steps": 2,
    "guidance_scale": 3.0,
    # The system prompts are long; without them the tiny prefix stays a few dozen tokens.
    "use_system_prompt": False,
    # The pipeline returns decoded frames without a batch dim ((frames, H, W, 3)); latents keep it.
    "output_type": "latent",
}

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "layers": (
        ("self_attn.to_q", "self_attn.to_k", "self_attn.to_v"),
        ("self_attn.add_q_proj", "self_attn.add_k_proj", "self_attn.add_v_proj"),
        ("mlp.gate_proj", "mlp.up_proj"),
        ("mlp_moe_gen.gate_proj", "mlp_moe_gen.up_proj"),
    ),
}

ADAPTER = register(
    ModelAdapter(
        family="cosmos3",
        fused_projections=FUSED_PROJECTIONS,
        transformer_classes=(TRANSFORMER,),
        block_groups=(
            BlockGroup(path="layers", pattern=ForwardPattern.P1, hidden_arg="gen_seq", encoder_arg="und_seq"),
        ),
        timestep_arg="vision_timesteps",
        tiny_pipelines=(TinyPipeline(name="t2v", build=tiny_cosmos3, call_kwargs=_CALL),),
        presets=(
            ModelPreset(
                name="cosmos3-omni",
                pipeline_class="diffusers.Cosmos3OmniPipeline",
                hub_id="nvidia/Cosmos3-Omni",
                defaults={
                    "num_inference_steps": 35,
                    "guidance_scale": 6.0,
                    "num_frames": 189,
                    "height": 720,
                    "width": 1280,
                },
            ),
        ),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        notes=(
            "The prompt is embedded by the transformer itself (no text encoder); the understanding prefix and the "
            "generation tokens are packed 2-D streams (no batch dim) with mRoPE position ids over the joint "
            "sequence. CFG: cond / uncond calls in cache contexts. The pipeline's default guardrail downloads its "
            "models (the tiny pipeline turns it off). T2I (num_frames=1), I2V, V2V, sound and action generation "
            "run the same transformer call. Context parallelism splits both packed streams (prefix and generation) "
            "along their tokens; the prefix pathway is causal attention (is_causal=True) and its keys also feed the "
            "generation pathway, so the attention is head-parallel with two pathways: each runs unchanged on the "
            "whole streams of the rank's query heads and their KV heads (a Ulysses degree that would split the GQA "
            "groups unevenly is refused). The model's own CP seams (_cp_shard_fn / _cp_gather_fn) stay unset."
            " No spectral signal: the latent arrives as a list of per-sample vision tensors (vision_tokens), not one "
            "tensor on a grid."
        ),
    )
)
