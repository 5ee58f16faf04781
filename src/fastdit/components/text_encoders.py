"""Tensor-parallel plans of the text encoders, keyed by exact class, for ``Parallel(text_encoder=True)``.

Every plan is a :class:`~fastdit.parallel.tp_plan.TensorParallelPlan`, applied by the same
:func:`~fastdit.parallel.tensor_parallel.apply_tensor_parallel` as the transformer's, over a 1-D mesh of all ranks.

Where transformers ships a plan — ``base_model_tp_plan`` on the (text) config class, ``_tp_plan`` on the model class
(the language-model head) — it is read and translated into our styles (:data:`TRANSFORMERS_STYLES`), rather than
restated. Where it ships none (T5, UMT5, CLIP, BERT) the plan is written here. The translation adds what
transformers leaves implicit:

* attention projections split in whole heads (``unit="head_dim"``), so a GQA model with 8 KV heads refuses
  ``tp=16`` instead of cutting a head in half;
* a fused ``[gate|up]`` projection transformers gathers then splits again (``colwise_gather_output`` followed by
  ``rowwise_split_input``) stays split, each half on its own (``segments=(1, 1)``);
* an ``mlp-only`` fallback for a degree the heads do not divide.

Transformers' Llama-style attention reshapes with ``(-1, head_dim)``, so no attribute needs dividing; T5 / UMT5
reshape with ``n_heads`` and are divided (the equality tests fail without).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from fastdit.models.base import qualified_name
from fastdit.parallel.tp_plan import Colwise, LocalSlice, Rowwise, Style, TensorParallelPlan

__all__ = [
    "TRANSFORMERS_STYLES",
    "plan_for_class",
    "planned_classes",
    "text_encoder_plan",
    "translate_transformers_plan",
]

# transformers' style strings → what they become here (``None``: the module stays whole on every rank).
TRANSFORMERS_STYLES: dict[str, str | None] = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    # Gathered then split again by the next layer: kept split (a fused weight's segments say how), except for a
    # layer nothing re-splits (the language-model head), whose output is gathered.
    "colwise_gather_output": "colwise_gather_output",
    "rowwise_split_input": "rowwise",
    "packed_colwise": "colwise",
    # Per-head norms (Qwen3's, Gemma3's QK-norm over head_dim) hold a few hundred numbers: whole on every rank.
    "replicated_with_grad_allreduce": None,
    # A vocabulary-split embedding needs a masked lookup and an all-reduce for a table read once per prompt token;
    # it stays whole.
    "embedding_rowwise": None,
    "embedding_colwise": None,
}


def translate_transformers_plan(
    plan: Mapping[str, str], prefix: str = "", fused: Mapping[str, tuple[int, ...]] | None = None
) -> dict[str, Style]:
    """Our styles for a transformers tensor-parallel plan (``{"layers.*.self_attn.q_proj": "colwise", ...}``).

    Args:
        plan: transformers' plan (``base_model_tp_plan`` or a model class's ``_tp_plan``).
        prefix: The base model's path inside the encoder (``"model.language_model."``).
        fused: transformers' path → the segments of a fused weight (``{"layers.*.mlp.gate_up_proj": (1, 1)}``).

    Raises:
        ValueError: a style that has no translation (expert parallelism, MLA projections), or a packed layer whose
            segments ``fused`` does not give.
    """
    fused = fused or {}
    out: dict[str, Style] = {}
    for path, style in plan.items():
        if style not in TRANSFORMERS_STYLES:
            raise ValueError(f"transformers tensor-parallel style {style!r} of {path!r} has no fastdit translation")
        ours = TRANSFORMERS_STYLES[style]
        if ours is None:
            continue
        # Attention projections split in whole heads: the layer's owner knows its head size.
        unit = "head_dim" if ".self_attn." in f".{path}" else None
        segments = fused.get(path, ())
        if style == "packed_colwise" and not segments:
            raise ValueError(f"transformers style 'packed_colwise' of {path!r}: its segments are not known")
        if ours == "rowwise":
            out[prefix + path] = Rowwise(unit=unit)
        elif ours == "colwise_gather_output" and not segments:
            out[prefix + path] = Colwise(gather_output=True)
        else:
            out[prefix + path] = Colwise(segments=segments, unit=unit)
    return out


def _import(qualified: str) -> type:
    module, _, name = qualified.rpartition(".")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class _FromTransformers:
    """A plan read from transformers: the config class whose ``base_model_tp_plan`` applies, and where.

    Attributes:
        config: Qualified config class carrying ``base_model_tp_plan`` (the text config of a multimodal model).
        prefix: Path of that base model inside the encoder.
        fused: Fused layers' segments, by transformers' path.
        reason: Why ``config`` is not the encoder's own text config, when it is not.
    """

    config: str
    prefix: str = ""
    fused: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    reason: str = ""


def _mlp_only(layers: Mapping[str, Style]) -> dict[str, Style]:
    return {path: style for path, style in layers.items() if ".mlp." in f".{path}"}


def _translated(class_name: str, spec: _FromTransformers, tied_head: bool) -> TensorParallelPlan:
    cls = _import(class_name)
    config = _import(spec.config)
    layers = translate_transformers_plan(config.base_model_tp_plan or {}, spec.prefix, spec.fused)
    head = translate_transformers_plan(getattr(cls, "_tp_plan", None) or {})  # the LM head, if the class has one
    notes = f"attention by heads, MLP by width, from {config.__name__}.base_model_tp_plan"
    notes += f" ({spec.reason})" if spec.reason else ""
    for path, segments in spec.fused.items():
        notes += f"; fused {path.rpartition('.')[2]} split per part {segments}"
    notes += "; embeddings and norms whole"
    if head and tied_head:
        # A head tied to the token embedding would be held twice (a slice, and whole in the embedding): more bytes
        # per rank than not splitting it.
        head = {}
        notes += "; LM head tied to the embedding: whole"
    elif head:
        notes += f"; {', '.join(head)} from {cls.__name__}._tp_plan (output gathered)"
    fallback = TensorParallelPlan(
        layers=_mlp_only(layers), name="mlp-only", notes="the MLPs only, for a degree the (KV) heads do not divide"
    )
    if head:
        # The head splits by vocabulary, whatever the heads: kept in the first fallback (Qwen2.5-VL-7B's 28 heads
        # at 8 ranks still split its 0.5 B-parameter head).
        fallback = TensorParallelPlan(
            layers={**fallback.layers, **head}, name="mlp+head", notes="the MLPs and the LM head", fallback=fallback
        )
    return TensorParallelPlan(layers={**layers, **head}, notes=notes, fallback=fallback)


# --- our own plans, for the encoders transformers ships none for ---

_T5_FFN = {
    # T5 v1.0 has one input projection, v1.1 / FLAN / UMT5 a gated pair: a checkpoint has one kind or the other.
    "encoder.block.*.layer.1.DenseReluDense.wi": Colwise(),
    "encoder.block.*.layer.1.DenseReluDense.wi_0": Colwise(),
    "encoder.block.*.layer.1.DenseReluDense.wi_1": Colwise(),
    "encoder.block.*.layer.1.DenseReluDense.wo": Rowwise(),
}
_T5_OPTIONAL = tuple(f"encoder.block.*.layer.1.DenseReluDense.{name}" for name in ("wi", "wi_0", "wi_1"))


def _t5_plan(name: str) -> TensorParallelPlan:
    attn = "encoder.block.*.layer.0.SelfAttention"
    head = "key_value_proj_dim"
    layers: dict[str, Style] = {
        f"{attn}.q": Colwise(unit=head),
        f"{attn}.k": Colwise(unit=head),
        f"{attn}.v": Colwise(unit=head),
        f"{attn}.o": Rowwise(unit=head),
        # nn.Embedding(num_buckets, n_heads): its output's last dim is the heads; each rank keeps its heads' bias.
        # T5 has it in the first block only (later blocks reuse that bias), UMT5 in every block.
        f"{attn}.relative_attention_bias": LocalSlice(dim=-1),
        **_T5_FFN,
    }
    fallback = TensorParallelPlan(
        layers=_T5_FFN, optional=_T5_OPTIONAL, name="ffn-only", notes="the feed-forward layers only"
    )
    return TensorParallelPlan(
        layers=layers,
        # The attention reshapes with n_heads and inner_dim (and sizes a zero bias with n_heads).
        divide=(f"{attn}.n_heads", f"{attn}.inner_dim"),
        optional=_T5_OPTIONAL,
        notes=f"{name}: attention by heads (relative attention bias sliced by head), feed-forward by width",
        fallback=fallback,
    )


def _clip_plan(prefix: str) -> TensorParallelPlan:
    block = f"{prefix}encoder.layers.*"
    mlp = {f"{block}.mlp.fc1": Colwise(), f"{block}.mlp.fc2": Rowwise()}
    layers: dict[str, Style] = {
        f"{block}.self_attn.q_proj": Colwise(unit="head_dim"),
        f"{block}.self_attn.k_proj": Colwise(unit="head_dim"),
        f"{block}.self_attn.v_proj": Colwise(unit="head_dim"),
        f"{block}.self_attn.out_proj": Rowwise(unit="head_dim"),
        **mlp,
    }
    return TensorParallelPlan(
        layers=layers,
        divide=(f"{block}.self_attn.num_heads",),  # the local head count, for anything reading it
        notes="CLIP text: attention by heads, MLP by width; embeddings, final norm and projection whole",
        fallback=TensorParallelPlan(layers=mlp, name="mlp-only", notes="the MLPs only"),
    )


def _bert_plan() -> TensorParallelPlan:
    block = "encoder.layer.*"
    mlp = {f"{block}.intermediate.dense": Colwise(), f"{block}.output.dense": Rowwise()}
    attn = f"{block}.attention.self"
    layers: dict[str, Style] = {
        f"{attn}.query": Colwise(unit="attention_head_size"),
        f"{attn}.key": Colwise(unit="attention_head_size"),
        f"{attn}.value": Colwise(unit="attention_head_size"),
        f"{block}.attention.output.dense": Rowwise(),
        **mlp,
    }
    return TensorParallelPlan(
        layers=layers,
        divide=(f"{attn}.num_attention_heads", f"{attn}.all_head_size"),
        notes="BERT: attention by heads, MLP by width; embeddings and pooler whole",
        fallback=TensorParallelPlan(layers=mlp, name="mlp-only", notes="the MLPs only"),
    )


_T = "transformers.models"
_LM = "model.language_model."  # the language model of a multimodal encoder (transformers 5 layout)

_FROM_TRANSFORMERS: dict[str, _FromTransformers] = {
    f"{_T}.llama.modeling_llama.LlamaModel": _FromTransformers(f"{_T}.llama.configuration_llama.LlamaConfig"),
    f"{_T}.llama.modeling_llama.LlamaForCausalLM": _FromTransformers(
        f"{_T}.llama.configuration_llama.LlamaConfig", "model."
    ),
    # HunyuanVideo's llava-llama-3 encoder: a Llama language model.
    f"{_T}.llava.modeling_llava.LlavaForConditionalGeneration": _FromTransformers(
        f"{_T}.llama.configuration_llama.LlamaConfig", _LM, reason="a Llava's text config is a Llama's"
    ),
    f"{_T}.gemma2.modeling_gemma2.Gemma2Model": _FromTransformers(f"{_T}.gemma2.configuration_gemma2.Gemma2Config"),
    f"{_T}.gemma3.modeling_gemma3.Gemma3ForConditionalGeneration": _FromTransformers(
        f"{_T}.gemma3.configuration_gemma3.Gemma3TextConfig", _LM
    ),
    f"{_T}.glm.modeling_glm.GlmModel": _FromTransformers(
        f"{_T}.glm.configuration_glm.GlmConfig", fused={"layers.*.mlp.gate_up_proj": (1, 1)}
    ),
    f"{_T}.mistral3.modeling_mistral3.Mistral3ForConditionalGeneration": _FromTransformers(
        f"{_T}.mistral.configuration_mistral.MistralConfig", _LM, reason="Mistral Small 3's text config is a Mistral's"
    ),
    # The bare model (ERNIE-Image's pipeline reads its hidden states): the same language model, one level up.
    f"{_T}.mistral3.modeling_mistral3.Mistral3Model": _FromTransformers(
        f"{_T}.mistral.configuration_mistral.MistralConfig",
        "language_model.",
        reason="Mistral Small 3's text config is a Mistral's",
    ),
    f"{_T}.qwen2_vl.modeling_qwen2_vl.Qwen2VLForConditionalGeneration": _FromTransformers(
        f"{_T}.qwen2_vl.configuration_qwen2_vl.Qwen2VLTextConfig", _LM
    ),
    f"{_T}.qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VLForConditionalGeneration": _FromTransformers(
        f"{_T}.qwen2_5_vl.configuration_qwen2_5_vl.Qwen2_5_VLTextConfig", _LM
    ),
    f"{_T}.qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VLTextModel": _FromTransformers(
        f"{_T}.qwen2_5_vl.configuration_qwen2_5_vl.Qwen2_5_VLTextConfig"
    ),
    f"{_T}.qwen3.modeling_qwen3.Qwen3Model": _FromTransformers(f"{_T}.qwen3.configuration_qwen3.Qwen3Config"),
    f"{_T}.qwen3.modeling_qwen3.Qwen3ForCausalLM": _FromTransformers(
        f"{_T}.qwen3.configuration_qwen3.Qwen3Config", "model."
    ),
    # Qwen3VLTextConfig's plan names only its embedding; its decoder layers are Qwen3's (QK-norm included).
    f"{_T}.qwen3_vl.modeling_qwen3_vl.Qwen3VLModel": _FromTransformers(
        f"{_T}.qwen3.configuration_qwen3.Qwen3Config", "language_model.", reason="Qwen3-VL's text layers are Qwen3's"
    ),
    f"{_T}.qwen3_vl.modeling_qwen3_vl.Qwen3VLForConditionalGeneration": _FromTransformers(
        f"{_T}.qwen3.configuration_qwen3.Qwen3Config", _LM, reason="Qwen3-VL's text layers are Qwen3's"
    ),
    f"{_T}.smollm3.modeling_smollm3.SmolLM3ForCausalLM": _FromTransformers(
        f"{_T}.smollm3.configuration_smollm3.SmolLM3Config", "model."
    ),
}

_OWN: dict[str, Callable[[], TensorParallelPlan]] = {
    f"{_T}.t5.modeling_t5.T5EncoderModel": functools.partial(_t5_plan, "T5"),
    f"{_T}.umt5.modeling_umt5.UMT5EncoderModel": functools.partial(_t5_plan, "UMT5"),
    # transformers 5's CLIPTextModel is the text transformer itself; the projection model holds one as text_model.
    f"{_T}.clip.modeling_clip.CLIPTextModel": functools.partial(_clip_plan, ""),
    f"{_T}.clip.modeling_clip.CLIPTextModelWithProjection": functools.partial(_clip_plan, "text_model."),
    f"{_T}.bert.modeling_bert.BertModel": _bert_plan,
}

# What a multimodal encoder's plan leaves whole, for docs/models.md and summaries.
_WHOLE = {
    "Gemma3ForConditionalGeneration": "vision tower and projector whole",
    "LlavaForConditionalGeneration": "vision tower and projector whole",
    "Mistral3ForConditionalGeneration": "vision tower and projector whole",
    "Mistral3Model": "vision tower and projector whole",
    "Qwen2VLForConditionalGeneration": "vision tower whole",
    "Qwen2_5_VLForConditionalGeneration": "vision tower whole",
    "Qwen3VLModel": "vision tower whole",
    "Qwen3VLForConditionalGeneration": "vision tower whole",
}


def planned_classes() -> tuple[str, ...]:
    """The qualified names of every text-encoder class that has a plan."""
    return (*_OWN, *_FROM_TRANSFORMERS)


@functools.cache
def plan_for_class(class_name: str, tied_head: bool = False) -> TensorParallelPlan | None:
    """The plan of the text-encoder class ``class_name`` (qualified, matched exactly), or ``None``.

    Plans read from transformers are built at the first call (importing the config class).

    Args:
        class_name: The encoder's qualified class name.
        tied_head: Whether the language-model head shares its weight with the token embedding (then it stays
            whole).
    """
    own = _OWN.get(class_name)
    if own is not None:
        return own()
    spec = _FROM_TRANSFORMERS.get(class_name)
    if spec is None:
        return None
    plan = _translated(class_name, spec, tied_head)
    whole = _WHOLE.get(class_name.rpartition(".")[2])
    if whole:
        plan = TensorParallelPlan(
            layers=plan.layers, notes=f"{plan.notes}; {whole}", fallback=plan.fallback, name=plan.name
        )
    return plan


def _tied_head(module: torch.nn.Module) -> bool:
    get_head = getattr(module, "get_output_embeddings", None)
    get_embedding = getattr(module, "get_input_embeddings", None)
    if not callable(get_head) or not callable(get_embedding):
        return False
    try:
        head, embedding = get_head(), get_embedding()
    except (NotImplementedError, AttributeError):  # a model that does not say
        return False
    weight = getattr(head, "weight", None)
    return weight is not None and weight is getattr(embedding, "weight", None)


def text_encoder_plan(module: torch.nn.Module) -> TensorParallelPlan:
    """The plan of ``module``'s exact class.

    Raises:
        ValueError: the class has no plan (naming it).
    """
    name = qualified_name(type(module))
    plan = plan_for_class(name, _tied_head(module))
    if plan is None:
        raise ValueError(f"text encoder class {name} has no tensor-parallel plan")
    return plan
