"""Text-encoder tensor parallelism: every encoder class with a plan, split over gloo ranks, equals one process.

Each class is built tiny (4 query heads over 2 KV heads where it has GQA, so the full plan applies at 2 ranks), run
whole, split over all ranks with :meth:`ParallelRuntime.world_mesh`, run again (every output the pipelines read:
last hidden state, the hidden states of all layers, pooled outputs, logits), and restored. Several classes are
checked in one worker call: pools start once, each call costs a round trip.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import fastdit
from fastdit.components import walk
from fastdit.components.registry import _REGISTRY, TEXT_ENCODER
from fastdit.components.text_encoders import (
    plan_for_class,
    planned_classes,
    text_encoder_plan,
    translate_transformers_plan,
)
from fastdit.errors import ArgumentError
from fastdit.models.base import qualified_name
from fastdit.parallel.tp_plan import Colwise, Rowwise, resolve_tp_plan
from fastdit.testing.components import encoders as enc
from fastdit.testing.distributed import get_pool
from fastdit.testing.pipelines import build_tiny, run_tiny

TOLERANCE = 1e-5


def _rebuilt(model: torch.nn.Module, kv_heads: int | None = None) -> torch.nn.Module:
    """``model``'s class rebuilt with ``kv_heads`` KV heads and a vocabulary that 4 divides (the LM head splits)."""
    config = model.config
    text = getattr(config, "text_config", None) or config
    if kv_heads is not None:
        text.num_key_value_heads = kv_heads
    text.vocab_size = -(-text.vocab_size // 4) * 4
    return enc.build(type(model), config)


def _llm(module: str, fn: str, kv_heads: int | None = 2, config: bool = False) -> Callable[[], torch.nn.Module]:
    def make() -> torch.nn.Module:
        import importlib

        builder = getattr(importlib.import_module(f"fastdit.testing.components.{module}"), fn)
        out = builder(hidden_size=64)
        model = out[0] if isinstance(out, tuple) else out
        return _rebuilt(model, kv_heads)

    return make


def _from_config(module: str, fn: str, cls: str, kv_heads: int = 2) -> Callable[[], torch.nn.Module]:
    def make() -> torch.nn.Module:
        import importlib

        import transformers

        config = getattr(importlib.import_module(f"fastdit.testing.components.{module}"), fn)(hidden_size=64)
        config.num_key_value_heads = kv_heads
        config.vocab_size = -(-config.vocab_size // 4) * 4
        return enc.build(getattr(transformers, cls), config)

    return make


def _qwen2_5_vl_text() -> torch.nn.Module:
    from transformers import Qwen2_5_VLTextModel

    model, _ = enc.qwen2_5_vl_model(hidden_size=64)
    return enc.build(Qwen2_5_VLTextModel, model.config.text_config)


def _qwen3_vl_conditional() -> torch.nn.Module:
    from transformers import Qwen3VLForConditionalGeneration

    from fastdit.testing.components.qwen3_vl import qwen3_vl_model

    model, _ = qwen3_vl_model(hidden_size=64)
    model.config.text_config.num_key_value_heads = 2
    model.config.text_config.vocab_size = -(-model.config.text_config.vocab_size // 4) * 4
    return enc.build(Qwen3VLForConditionalGeneration, model.config)


# Class name → a builder of a tiny instance (built the same in every process: seeded).
BUILDERS: dict[str, Callable[[], torch.nn.Module]] = {
    "T5EncoderModel": lambda: enc.t5_encoder(d_model=32)[0],  # 4 heads, relu FFN (wi)
    "UMT5EncoderModel": lambda: enc.umt5_encoder(d_model=32)[0],  # 4 heads, gated FFN (wi_0, wi_1), bias per layer
    "CLIPTextModel": lambda: enc.clip_text_model()[0],
    "CLIPTextModelWithProjection": lambda: enc.clip_text_model_with_projection()[0],
    "BertModel": _llm("bert", "bert_model", kv_heads=None),
    "LlamaModel": _llm("llama", "llama_model"),
    "LlamaForCausalLM": _from_config("llama", "llama_config", "LlamaForCausalLM"),
    "LlavaForConditionalGeneration": _llm("llava", "llava_model"),
    "Gemma2Model": _llm("gemma2", "gemma2_model"),
    "Gemma3ForConditionalGeneration": _llm("gemma3", "gemma3_model"),
    "GlmModel": _llm("glm", "glm_model"),
    "Mistral3ForConditionalGeneration": _llm("mistral3", "mistral3_model"),
    "Mistral3Model": lambda: _llm("mistral3", "mistral3_model")().model,
    "Qwen2VLForConditionalGeneration": _llm("qwen2_vl", "qwen2_vl_model"),
    "Qwen2_5_VLForConditionalGeneration": lambda: _rebuilt(enc.qwen2_5_vl_model(hidden_size=64)[0], 2),
    "Qwen2_5_VLTextModel": _qwen2_5_vl_text,
    "Qwen3Model": _llm("qwen3", "qwen3_model"),
    "Qwen3ForCausalLM": _from_config("qwen3", "qwen3_config", "Qwen3ForCausalLM"),
    "Qwen3VLModel": _llm("qwen3_vl", "qwen3_vl_model"),
    "Qwen3VLForConditionalGeneration": _qwen3_vl_conditional,
    "SmolLM3ForCausalLM": _llm("smollm3", "smollm3_model"),
}


@functools.cache
def _built(name: str) -> torch.nn.Module:
    return BUILDERS[name]().eval()


def _inputs(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Two prompts of 7 tokens, the second padded (pipelines pass masks), ids below every tiny vocabulary."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 60, (2, 7), generator=generator)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _outputs(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of the encoder's output: hidden states of each layer, last hidden state, pooled, logits."""
    with torch.no_grad():
        out = model(**_inputs(model), output_hidden_states=True, return_dict=True)
    flat: dict[str, torch.Tensor] = {}
    for key, value in out.items():
        if isinstance(value, torch.Tensor):
            flat[key] = value.detach().clone()
        elif isinstance(value, tuple) and value and all(isinstance(v, torch.Tensor) for v in value):
            flat.update({f"{key}.{i}": v.detach().clone() for i, v in enumerate(value)})
    return flat


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items()}


def _split_and_compare(rank: int, world_size: int, names: list[str]) -> dict[str, dict[str, Any]]:
    """For each class: whole outputs, split outputs, stats, and whether undo is bit-identical."""
    from fastdit.config import Parallel
    from fastdit.parallel.runtime import ParallelRuntime
    from fastdit.parallel.tensor_parallel import apply_tensor_parallel, parameter_bytes, planned_bytes

    mesh = ParallelRuntime.from_config(Parallel(ulysses=world_size)).world_mesh()
    results = {}
    for name in names:
        model = _built(name)
        plan = text_encoder_plan(model)
        expected, before = _outputs(model), _state(model)
        planned = planned_bytes(model, plan, world_size, name)
        applied = apply_tensor_parallel(model, plan, mesh, device=torch.device("cpu"), family=name)
        try:
            got = _outputs(model)
        finally:
            applied.undo()
        after = _state(model)
        restored = after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
        results[name] = {
            "keys": sorted(expected),
            "missing": sorted(set(expected) - set(got)),
            "error": max((got[k] - v).abs().max().item() for k, v in expected.items() if k in got),
            "stats": applied.state.stats(),
            "planned": planned,
            "whole_bytes": parameter_bytes(model),
            "restored": restored,
            "same_after": all(torch.equal(_outputs(model)[k], v) for k, v in expected.items()),
        }
    return results


def _check(results: dict[str, dict[str, Any]], degree: int, plans: dict[str, str]) -> None:
    for name, r in results.items():
        assert not r["missing"], f"{name}: outputs missing when split: {r['missing']}"
        assert r["error"] < TOLERANCE, f"{name}: max abs error {r['error']:.2e} over {r['keys']}"
        stats = r["stats"]
        assert stats["plan"] == plans.get(name, "full"), name
        assert stats["degree"] == degree and stats["split_layers"] > 0, name
        assert stats["parameter_bytes_per_rank"] < r["whole_bytes"], name
        # Per-rank bytes are what planned_bytes computes on shapes alone.
        assert stats["parameter_bytes_per_rank"] == r["planned"]["parameter_bytes_per_rank"], name
        assert stats["parameter_bytes_per_rank"] == stats["split_bytes"] // degree + stats["replicated_bytes"], name
        assert r["restored"], f"{name}: undo did not give back the original weights"
        assert r["same_after"], f"{name}: the restored encoder is not bit-identical to the original"


@pytest.mark.distributed
def test_every_encoder_class_split_over_2_ranks_equals_one_process() -> None:
    results = get_pool(2).run(_split_and_compare, list(BUILDERS), timeout=600)
    for result in results:
        _check(result, 2, {})
    # The pipelines' outputs are compared: hidden states of every layer, pooled outputs, logits.
    assert "hidden_states.0" in results[0]["T5EncoderModel"]["keys"]
    assert "pooler_output" in results[0]["CLIPTextModel"]["keys"]
    assert "logits" in results[0]["Qwen2_5_VLForConditionalGeneration"]["keys"]


# At 4 ranks: T5 (4 heads) and BERT split whole; the GQA models' 2 KV heads do not divide, so their MLPs only.
FOUR_RANKS = {"T5EncoderModel": "full", "BertModel": "full", "Qwen2_5_VLTextModel": "full", "LlamaModel": "mlp-only"}


@pytest.mark.slow  # a pool of 4 ranks to start
@pytest.mark.distributed
def test_split_over_4_ranks_equals_one_process() -> None:
    for result in get_pool(4).run(_split_and_compare, list(FOUR_RANKS), timeout=600):
        _check(result, 4, FOUR_RANKS)


# --- the plans as data, on the meta device ---


def test_every_registered_text_encoder_class_has_a_plan() -> None:
    registered = {name for name, entry in _REGISTRY.items() if entry.kind == TEXT_ENCODER}
    assert registered == set(planned_classes())
    assert {qualified_name(type(_built(name))) for name in BUILDERS} == registered  # and each one is tested here


@pytest.mark.parametrize("name", list(BUILDERS))
def test_plan_fits_on_meta_and_a_bad_degree_is_refused(name: str) -> None:
    meta = BUILDERS[name]().to("meta")  # no weight exists: nothing can move
    plan = text_encoder_plan(meta)
    assert resolve_tp_plan(meta, plan, 2, name).name == "full"
    with pytest.raises(ValueError, match=rf"tensor-parallel plan of {name!r}: .* is not divisible by tp=7; valid"):
        resolve_tp_plan(meta, plan, 7, name)


def test_plans_read_transformers_base_model_tp_plan() -> None:
    from transformers import LlamaConfig

    plan = plan_for_class("transformers.models.llama.modeling_llama.LlamaForCausalLM")
    for path, style in LlamaConfig.base_model_tp_plan.items():
        ours = plan.layers[f"model.{path}"]
        assert isinstance(ours, Colwise if style == "colwise" else Rowwise), path
        assert ours.unit == ("head_dim" if ".self_attn." in path else None), path
    assert plan.layers["lm_head"] == Colwise(gather_output=True)  # LlamaForCausalLM._tp_plan
    mlp = {f"model.layers.*.mlp.{n}" for n in ("gate_proj", "up_proj", "down_proj")}
    assert (plan.fallback.name, set(plan.fallback.layers)) == ("mlp+head", {*mlp, "lm_head"})
    assert (plan.fallback.fallback.name, set(plan.fallback.fallback.layers)) == ("mlp-only", mlp)
    # GLM's fused [gate|up] projection, which transformers gathers and splits again, stays split by halves.
    glm = plan_for_class("transformers.models.glm.modeling_glm.GlmModel")
    assert glm.layers["layers.*.mlp.gate_up_proj"] == Colwise(segments=(1, 1))
    assert glm.layers["layers.*.mlp.down_proj"] == Rowwise()
    # Per-head QK-norms and embeddings stay whole; an unknown style is refused by name.
    qwen3 = plan_for_class("transformers.models.qwen3.modeling_qwen3.Qwen3Model")
    assert not any("norm" in path or "embed" in path for path in qwen3.layers)
    with pytest.raises(ValueError, match=r"'ep_dispatch_experts' of 'layers\.\*\.mlp\.experts' has no fastdit"):
        translate_transformers_plan({"layers.*.mlp.experts": "ep_dispatch_experts"})


def test_a_tied_language_model_head_stays_whole() -> None:
    model = _built("SmolLM3ForCausalLM")  # ties its head to the token embedding
    assert model.lm_head.weight is model.get_input_embeddings().weight
    assert "lm_head" not in text_encoder_plan(model).layers
    assert "lm_head" in text_encoder_plan(_built("LlamaForCausalLM")).layers


# --- the technique's checks, before anything is touched ---


def _check_request(pipe: Any, **layout: Any) -> None:
    from fastdit.context import Request
    from fastdit.techniques import TECHNIQUES

    (technique,) = [t for t in TECHNIQUES if t.name == "text_encoder_parallel"]
    request = Request(parallel=fastdit.Parallel(**layout, text_encoder=True))
    assert technique.requested(request)
    technique.check(request, walk(pipe))


def test_checks_refuse_before_any_weight_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    pipe, _ = build_tiny("flux")
    before = {name: _state(module) for name, module in pipe.components.items() if isinstance(module, torch.nn.Module)}
    with pytest.raises(ArgumentError, match=r"text_encoder=True .* one rank \(world size 1\): there is nothing"):
        fastdit.accelerate(pipe, parallel=fastdit.Parallel(text_encoder=True))
    # CLIP's 2 heads and 64-wide MLP do not split over 3 ranks: the message says which size and why.
    with pytest.raises(
        ArgumentError, match=r"over all 3 ranks: text_encoder: .*'CLIPTextModel'.* is not divisible by tp=3; valid"
    ):
        _check_request(pipe, ulysses=3)
    _check_request(pipe, ulysses=2)  # every encoder fits 2 ranks
    # A registered encoder class without a plan is named.
    entry = _REGISTRY["transformers.models.t5.modeling_t5.T5EncoderModel"]
    from fastdit.components import text_encoders

    monkeypatch.delitem(text_encoders._OWN, entry.class_name)
    plan_for_class.cache_clear()
    try:
        with pytest.raises(ArgumentError, match=f"text encoder class {entry.class_name} has no tensor-parallel plan"):
            _check_request(pipe, ulysses=2)
    finally:
        monkeypatch.undo()
        plan_for_class.cache_clear()
    after = {name: _state(module) for name, module in pipe.components.items() if isinstance(module, torch.nn.Module)}
    for name, state in before.items():
        assert all(torch.equal(after[name][k], v) for k, v in state.items()), name


# --- end to end: tiny pipelines, the text encoders split alongside the transformer ---

PIPELINE_TOLERANCE = 1e-4
LAYOUTS: dict[str, list[dict[str, int]]] = {
    "flux": [{"ulysses": 2}, {"tp": 2}],  # CLIP + T5
    "qwenimage": [{"ulysses": 2}, {"tp": 2}, {"cfg": 2}],  # Qwen2.5-VL; CFG ranks encode the same prompts
    "hunyuan_video": [{"ulysses": 2}],  # Llama with 1 KV head (its MLPs only) + CLIP
}


@functools.cache
def _pipeline(family: str) -> tuple[Any, Any]:
    return build_tiny(family)


def _run_pipeline(rank: int, world_size: int, family: str, layouts: list[dict[str, int]]) -> list[dict[str, Any]]:
    pipe, tiny = _pipeline(family)
    encoders = {c.name: c.module for c in walk(pipe).of(TEXT_ENCODER)}
    before = {name: _state(module) for name, module in encoders.items()}
    results = []
    for layout in layouts:
        fastdit.accelerate(pipe, parallel=fastdit.Parallel(**layout, text_encoder=True))
        try:
            out = run_tiny(pipe, tiny)
            summary = fastdit.summary(pipe)
            stats = {name: info["text_encoder_parallel"] for name, info in summary.text_encoders.items()}
            text = str(summary)
        finally:
            fastdit.disable(pipe)
        restored = all(
            all(torch.equal(encoders[name].state_dict()[k], v) for k, v in state.items())
            for name, state in before.items()
        )
        results.append({"out": out, "stats": stats, "restored": restored, "text": text})
    return results


@pytest.mark.distributed
@pytest.mark.parametrize("family", list(LAYOUTS))
def test_pipeline_with_split_text_encoders_matches_one_process(family: str) -> None:
    pipe, tiny = _pipeline(family)
    expected = run_tiny(pipe, tiny)
    names = {c.name for c in walk(pipe).of(TEXT_ENCODER)}
    for per_rank in get_pool(2).run(_run_pipeline, family, LAYOUTS[family], timeout=600):
        for layout, result in zip(LAYOUTS[family], per_rank, strict=True):
            err = np.abs(result["out"] - expected).max()
            assert err < PIPELINE_TOLERANCE, f"{layout}: max abs error {err:.2e}"
            assert set(result["stats"]) == names, layout  # every encoder was split
            for stats in result["stats"].values():
                assert (
                    stats["degree"] == 2
                    and stats["parameter_bytes_per_rank"] < stats["split_bytes"] + stats["replicated_bytes"]
                )
            assert result["restored"], f"{layout}: disable did not restore the text encoders"
            for name, stats in result["stats"].items():
                assert f"{name}: {stats['plan']} plan over 2 ranks" in result["text"], result["text"]
    if family == "hunyuan_video":  # one KV head does not split: the fallback
        assert {s["plan"] for s in per_rank[0]["stats"].values()} == {"mlp-only", "full"}
    assert np.array_equal(run_tiny(pipe, tiny), expected)
