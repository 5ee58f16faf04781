"""``fastdit.diagnostics``: inspection agrees with every registered adapter, and finds the known facts."""

from __future__ import annotations

import json

import pytest
import torch

import fastdit
from fastdit.diagnostics.decide import main_attention
from fastdit.diagnostics.inspect import declared_groups, inspect_target
from fastdit.diagnostics.report import render_text
from fastdit.diagnostics.target import TargetError
from fastdit.models.registry import all_adapters
from tests.diagnostics.reports import report_for, target_for
from tests.diagnostics.toy_mmdit import ToyMMDiT

FAMILIES = [adapter.family for adapter in all_adapters()]
_HEADS = ("num_attention_heads", "n_heads")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")
TOY = "tests.diagnostics.toy_mmdit:ToyMMDiT"


def _declared(adapter, report):
    for group in declared_groups(adapter, [g.path for g in report.groups]):
        yield group
        if group.interleaved is not None:
            yield group.interleaved


# Families whose block calls the pattern detector reads wrong, with why (the adapters are checked by their family
# suites' probes of every block call instead).
DETECTOR_LIMITS = {
    # The layers take packed 2-D (tokens, width) streams without a batch dim, which the detector does not see as
    # token sequences.
    "cosmos3": "2-D token streams",
    # The blocks take a second (B, N, C) tensor of the hidden stream's shape (the Plucker embedding), which the
    # detector takes for the hidden states.
    "sana_wm": "a second stream-shaped argument",
}


@pytest.mark.parametrize(
    "family",
    [
        pytest.param(f, marks=pytest.mark.xfail(reason=DETECTOR_LIMITS[f], strict=True)) if f in DETECTOR_LIMITS else f
        for f in FAMILIES
    ],
)
def test_detected_patterns_and_heads_match_the_adapter(family: str) -> None:
    adapter = next(a for a in all_adapters() if a.family == family)
    report = report_for(family)
    assert report.forward_error is None, report.forward_error
    assert report.structure_note is None, report.structure_note
    for group in _declared(adapter, report):
        found = report.group(group.path)
        assert found.pattern == group.pattern.value, (group.path, found.evidence)
        assert found.hidden_arg == group.hidden_arg, group.path
        if group.pattern.takes_encoder:
            assert found.encoder_arg == group.encoder_arg, group.path
    assert not [line for line in report.comparison if line.startswith("MISMATCH")], report.comparison
    # Heads and GQA, read on the full-size model, are the config's.
    config = target_for(family).config
    attn = main_attention(report.attention)
    heads = next((config[k] for k in _HEADS if isinstance(config.get(k), int)), None)
    if heads is not None:
        assert attn is not None and attn.heads == heads
        if any(k in config and config[k] is None for k in _KV_HEADS):
            # The class defaults leave the key/value heads open (Lumina-Next): the report filled them from the tiny
            # model, which only has to group the query heads evenly.
            assert attn.kv_heads and heads % attn.kv_heads == 0 and attn.gqa == (attn.kv_heads < heads)
        else:
            kv = next((config[k] for k in _KV_HEADS if isinstance(config.get(k), int)), heads)
            assert (attn.kv_heads, attn.gqa) == (kv, kv < heads)


def test_flux_double_blocks_by_keyword_and_no_loop_body_work() -> None:
    report = report_for("flux")
    double, single = report.group("transformer_blocks"), report.group("single_transformer_blocks")
    assert (double.pattern, single.pattern) == (1, 1)
    assert double.positional == [] and {"hidden_states", "encoder_hidden_states"} <= set(double.keyword)
    assert report.main_groups == ["transformer_blocks", "single_transformer_blocks"]
    assert not report.loop_body
    assert report.cp.strategy == "root split" and report.cp.per_degree[2] == "ulysses"
    assert report.tp.per_degree[2] == "full" and report.tp.per_degree[5] == "none"
    assert any("image_rotary_emb" in a and "pos_embed" in a for a in report.sequence.block_args["transformer_blocks"])
    assert {m.path for m in report.modulation} >= {"transformer_blocks.*.norm1.linear"}


def test_wan_blocks_take_their_streams_positionally() -> None:
    found = report_for("wan").group("blocks")
    assert found.pattern == 2
    assert found.positional[:2] == ["hidden_states", "encoder_hidden_states"]
    assert report_for("wan").sequence.built_inside
    # Wan's QK-norm spans all heads: tensor parallelism needs a sharded norm there.
    attn = main_attention(report_for("wan").attention)
    assert attn.qk_norm == "full inner dim"


def test_lumina2_is_gqa_and_its_kv_heads_limit_tp() -> None:
    report = report_for("lumina2")
    attn = main_attention(report.attention)
    assert (attn.heads, attn.kv_heads, attn.gqa) == (24, 8, True)
    assert report.tp.per_degree[3] == "ffn-only" and report.tp.per_degree[8] == "full"
    assert report.divisibility[3] == {**report.divisibility[3], "heads": True, "kv_heads": False}


def test_qwenimage_passes_no_mask_to_its_blocks() -> None:
    # The tiny pipeline's prompts fill the text: diffusers 0.42.1 then passes no mask to the blocks.
    assert report_for("qwenimage").sequence.masks == []
    # Hunyuan Video does: inside the blocks' arguments, and down to attention.
    assert any("attention_mask" in m for m in report_for("hunyuan_video").sequence.masks)


def test_loop_body_work_is_found_where_it_exists() -> None:
    report = report_for("wan_vace")
    within = [c for c in report.loop_body if c.within_group and c.stream == "hidden"]
    assert within and all(c.after.startswith("blocks.") for c in within)
    assert any("depends on the block index" in line for line in report.loop_body_index)
    assert report.cp.strategy == "per-sub-module hooks"
    # Chroma slices a per-block modulation out of one tensor in its loop.
    assert any(c.within_group and c.stream == "temb" for c in report_for("chroma").loop_body)


def test_third_party_model_gets_an_adapter_that_caches_bit_identically() -> None:
    report = report_for(TOY)
    assert report.family is None and report.proposed_adapter
    assert (report.group("transformer_blocks").pattern, report.group("single_blocks").pattern) == (1, 3)
    attn = main_attention(report.attention)
    assert (attn.heads, attn.kv_heads, attn.qk_norm) == (4, 2, "per head")
    assert any(p.startswith("rope (ToyRope)") for p in report.sequence.producers)
    namespace: dict = {}
    exec(report.proposed_adapter, namespace)
    adapter = namespace["ADAPTER"]
    torch.manual_seed(0)
    model = ToyMMDiT().eval()
    inputs = (torch.randn(1, 16, 4), torch.randn(1, 8, 24))
    with torch.no_grad():
        baseline = [model(*inputs, torch.full((1,), t)) for t in (0.9, 0.5, 0.1)]
    fastdit.accelerate(model, adapter=adapter, cache=fastdit.DBCache(fn=1, bn=0, threshold=0))
    with torch.no_grad():
        cached = [model(*inputs, torch.full((1,), t)) for t in (0.9, 0.5, 0.1)]
    fastdit.disable(model)
    assert all(torch.equal(a, b) for a, b in zip(baseline, cached, strict=True))
    # The projections its blocks share go into the proposal, and fuse as proposed.
    assert report.fused_projections["single_blocks"] == [["attn.to_q", "attn.to_k", "attn.to_v"]]
    assert adapter.fused_projections["transformer_blocks"] == (("attn.to_q", "attn.to_k", "attn.to_v"),)
    fastdit.accelerate(model, adapter=adapter, fuse=True)
    with torch.no_grad():
        fused = [model(*inputs, torch.full((1,), t)) for t in (0.9, 0.5, 0.1)]
        stats = fastdit.summary(model).transformers
    fastdit.disable(model)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(baseline, fused, strict=True))
    assert all(info["fuse"]["misses"] == 0 and info["fuse"]["hits"] > 0 for info in stats.values())


def test_a_registered_family_is_compared_with_its_fused_projections() -> None:
    report = report_for("flux")
    assert report.fused_projections["single_transformer_blocks"] == [
        ["proj_mlp", "attn.to_q", "attn.to_k", "attn.to_v"]
    ]
    assert "ok: every group of projections that shares an input is declared fused" in report.comparison


def test_local_folder(tmp_path) -> None:
    from fastdit.testing.pipelines import save_tiny

    report = inspect_target(save_tiny("flux", str(tmp_path)))
    assert report.family == "flux" and report.config_source.endswith("config.json")
    # The folder's (tiny) config sets the structure: 2 heads.
    assert main_attention(report.attention).heads == 2
    assert report.group("transformer_blocks").pattern == 1


def test_diffusers_class_name_resolves_to_its_family() -> None:
    report = inspect_target("FluxTransformer2DModel")
    assert report.family == "flux" and report.comparison[0].startswith("ok:")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no-such-model", "unknown target"),
        ("no_such_module_xyz:Model", "cannot import"),
        ("tests.diagnostics.toy_mmdit:Missing", "cannot import"),
        ("FluxPipeline", "not a torch.nn.Module class"),
    ],
)
def test_bad_targets(spec: str, message: str) -> None:
    with pytest.raises(TargetError, match=message):
        inspect_target(spec)


def test_folder_without_config(tmp_path) -> None:
    with pytest.raises(TargetError, match=r"no transformer/config\.json"):
        inspect_target(str(tmp_path))


def test_report_renders_and_serialises() -> None:
    report = report_for("flux")
    text = render_text(report)
    for title in ("Block lists", "Context parallelism", "Tensor parallelism", "Adapter 'flux' vs findings"):
        assert title in text
    data = json.loads(json.dumps(report.to_dict()))
    assert data["groups"][0]["pattern"] == 1 and data["cp"]["per_degree"]["2"] == "ulysses"


def test_only_the_cli_imports_diagnostics() -> None:
    import pathlib
    import re

    root = pathlib.Path(fastdit.__file__).parent
    importers = sorted(
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if re.search(r"^\s*(from|import) fastdit\.diagnostics", path.read_text(), re.M)
        and path.parts[len(root.parts)] not in ("cli", "diagnostics")
    )
    assert importers == []


def test_an_example_call_and_a_last_block_of_its_own_go_into_the_proposal() -> None:
    from tests.cache import toy_joint_dit

    report = inspect_target(f"{toy_joint_dit.__name__}:ToyJointDiT", example=f"{toy_joint_dit.__name__}:example")
    group = report.group("stages")
    assert (group.pattern, group.hidden_arg, group.encoder_arg, group.overrides) == (1, "img", "txt", {-1: 2})
    assert "pattern_overrides={-1: ForwardPattern.P2}" in report.proposed_adapter
    assert any('AttentionRouting(sdpa_calls=("stages.*",))' in r for r in report.cp.reasons)
    namespace: dict = {}
    exec(report.proposed_adapter, namespace)
    model = toy_joint_dit.ToyJointDiT().eval()
    baseline = toy_joint_dit.sample(model)
    fastdit.accelerate(model, adapter=namespace["ADAPTER"], cache=fastdit.DBCache(fn=1, bn=0, threshold=0))
    try:
        assert torch.equal(toy_joint_dit.sample(model), baseline)
    finally:
        fastdit.disable(model)


def test_an_unusable_example_is_one_clear_error() -> None:
    from tests.cache import toy_joint_dit

    with pytest.raises(TargetError, match="cannot import 'nothing'"):
        inspect_target(f"{toy_joint_dit.__name__}:ToyJointDiT", example=f"{toy_joint_dit.__name__}:nothing")
    with pytest.raises(TargetError, match=r"expected \(model, kwargs\)"):
        inspect_target(f"{toy_joint_dit.__name__}:ToyJointDiT", example=f"{toy_joint_dit.__name__}:ToyJointDiT")
    with pytest.raises(TargetError, match="calling it raised TypeError"):
        inspect_target(f"{toy_joint_dit.__name__}:ToyJointDiT", example=f"{toy_joint_dit.__name__}:sample")
