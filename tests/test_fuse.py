"""Projection fusion (``Fuse``): the groups, the shared matmul, the refusals, and how it composes with the other
techniques on one process. Every family's declaration is checked against a traced call in the family suite
(``tests/models/family_suite.py``); context parallelism in ``tests/parallel/test_fuse_parallel.py``."""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import numpy as np
import pytest
import torch

import fastdit
from fastdit.config import Fuse, Quantize
from fastdit.context import context_of
from fastdit.errors import ArgumentError, FieldError
from fastdit.fuse import apply_fuse, declared_form, expand_group, group_name, plan_groups, shared_input_groups
from fastdit.models.base import BlockGroup, ForwardPattern, ModelAdapter
from fastdit.models.registry import get_family
from fastdit.testing.pipelines import build_tiny, run_tiny

FLUX = get_family("flux")


@functools.lru_cache(maxsize=2)
def _built(family: str = "flux") -> tuple[Any, Any]:
    return build_tiny(family)


def _run(family: str = "flux", output_type: str = "latent", **options: Any) -> tuple[np.ndarray, dict[str, Any]]:
    pipe, tiny = _built(family)
    fastdit.accelerate(pipe, **options)
    try:
        return run_tiny(pipe, tiny, output_type=output_type), fastdit.summary(pipe).transformers["transformer"]
    finally:
        fastdit.disable(pipe)


def _baseline(family: str = "flux") -> np.ndarray:
    pipe, tiny = _built(family)
    return run_tiny(pipe, tiny, output_type="latent")


class _Block(torch.nn.Module):
    def __init__(self, dim: int = 8, bias: bool = True) -> None:
        super().__init__()
        self.q = torch.nn.Linear(dim, dim, bias=bias)
        self.k = torch.nn.Linear(dim, dim, bias=False)
        self.mlp = torch.nn.Linear(dim, 3 * dim, bias=bias)
        self.other = torch.nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q(x) * self.k(x) + self.mlp(x)[..., :8]


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(), _Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


GROUPS = {"blocks": (("mlp", "q", "k"),)}


# --- the groups and the shared matmul ---


def test_group_members_share_one_matmul_and_undo_exactly() -> None:
    torch.manual_seed(0)
    model = _Model().eval()
    x = torch.randn(2, 5, 8)
    expected = model(x)
    weights = [p for p in model.parameters()]
    values = [p.detach().clone() for p in weights]
    applied = apply_fuse(model, GROUPS, Fuse())
    matmuls = []
    for group in applied.state.groups:
        group.linear.register_forward_hook(lambda *_: matmuls.append(1))
    out = model(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    assert len(matmuls) == 2  # one per block, for its three members
    stats = applied.state.stats()
    assert stats["num_groups"] == 2 and stats["num_layers"] == 6
    assert stats["hits"] == 4 and stats["misses"] == 0
    assert stats["groups"]["blocks.0.[mlp,q,k]"]["out_features"] == [24, 8, 8]
    applied.undo()
    assert [p for p in model.parameters()] == weights  # the same parameter objects
    assert all(torch.equal(p, v) for p, v in zip(weights, values, strict=True))
    assert not any("forward" in vars(m) for m in model.modules())
    assert torch.equal(model(x), expected)


def test_a_member_called_on_another_tensor_computes_on_its_own_input() -> None:
    torch.manual_seed(0)
    block = _Block().eval()
    model = _Model().eval()
    model.blocks[0] = block
    applied = apply_fuse(model, GROUPS, Fuse())
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    group = applied.state.groups[0]
    plain_q = torch.nn.functional.linear(y, group.linear.weight[24:32], group.linear.bias[24:32])
    block.mlp(x)
    torch.testing.assert_close(block.q(y), plain_q)  # not x's columns
    assert group.misses == 1 and group.hits == 0
    x.add_(1.0)  # an in-place change between two members' calls: the version counter sees it
    block.mlp(x)
    x.mul_(2.0)
    plain_k = torch.nn.functional.linear(x, group.linear.weight[32:40])
    torch.testing.assert_close(block.k(x), plain_k)
    applied.undo()


def test_inference_mode_tensors_share_by_identity() -> None:
    torch.manual_seed(0)
    model = _Model().eval()
    x = torch.randn(2, 5, 8)
    expected = model(x)
    applied = apply_fuse(model, GROUPS, Fuse())
    with torch.inference_mode():
        out = model(x.clone())  # an inference tensor: no version counter
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    assert applied.state.stats()["hits"] == 4 and applied.state.stats()["misses"] == 0
    applied.undo()


def test_exclude_leaves_a_group_unfused() -> None:
    model = _Model().eval()
    applied = apply_fuse(model, GROUPS, Fuse(exclude=("blocks.1.q",)))
    assert [g.name for g in applied.state.groups] == ["blocks.0.[mlp,q,k]"]
    assert applied.state.skipped == {"blocks.1.[mlp,q,k]": "excluded by 'blocks.1.q'"}
    applied.undo()


@pytest.mark.parametrize(
    ("groups", "needle"),
    [
        ({"blocks": (("q", "nope"),)}, "'blocks.0.nope' does not exist"),
        ({"blocks": (("q", "other"),)}, "differ in in_features"),
        ({"blocks": (("q", "k"), ("k", "mlp"))}, "declared in two groups"),
        ({"missing": (("q", "k"),)}, "no block list 'missing'"),
    ],
)
def test_plan_refuses_groups_that_cannot_share_an_input(groups: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        plan_groups(_Model(), groups, Fuse())


def test_plan_refuses_a_member_another_technique_changed() -> None:
    model = _Model()
    model.blocks[1].k.forward = lambda x: x
    with pytest.raises(ValueError, match=r"'blocks\.1\.k': its forward is already replaced"):
        plan_groups(model, GROUPS, Fuse())


def test_discovery_finds_what_the_blocks_share() -> None:
    model = _Model().eval()
    x = torch.randn(2, 8)
    assert shared_input_groups(model.blocks, lambda: model(x)) == {"0": [("q", "k", "mlp")], "1": [("q", "k", "mlp")]}
    adapter_groups = (BlockGroup(path="blocks", pattern=ForwardPattern.P2),)
    assert declared_form(model, adapter_groups, lambda: model(x)) == {"blocks": (("q", "k", "mlp"),)}
    assert group_name("blocks.0", ("q", "k")) == "blocks.0.[q,k]"


def test_starred_members_make_one_group_per_match() -> None:
    class _Experts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = torch.nn.ModuleList(
                torch.nn.ModuleDict({"w1": torch.nn.Linear(4, 8), "w3": torch.nn.Linear(4, 8)}) for _ in range(3)
            )

    block = _Experts()
    assert expand_group(block, ("experts.*.w1", "experts.*.w3")) == [
        ("experts.0.w1", "experts.0.w3"),
        ("experts.1.w1", "experts.1.w3"),
        ("experts.2.w1", "experts.2.w3"),
    ]
    assert expand_group(block, ("a", "b")) == [("a", "b")]
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([block])
    planned, _ = plan_groups(model, {"blocks": (("experts.*.w1", "experts.*.w3"),)}, Fuse())
    assert [g.name for g in planned] == [f"blocks.0.[experts.{i}.w1,experts.{i}.w3]" for i in range(3)]


def test_adapter_refuses_a_bad_declaration() -> None:
    groups = (BlockGroup(path="blocks", pattern=ForwardPattern.P2),)
    with pytest.raises(ValueError, match="not a block list of the adapter"):
        ModelAdapter(family="x", transformer_classes=("a.B",), block_groups=groups, fused_projections={"b": GROUPS})
    with pytest.raises(ValueError, match="two or more distinct layers"):
        ModelAdapter(
            family="x", transformer_classes=("a.B",), block_groups=groups, fused_projections={"blocks": (("q",),)}
        )
    with pytest.raises(ValueError, match="as many '\\*' as the first"):
        ModelAdapter(
            family="x",
            transformer_classes=("a.B",),
            block_groups=groups,
            fused_projections={"blocks": (("e.*.a", "b"),)},
        )


def test_config_validates_its_patterns() -> None:
    assert Fuse(exclude="a.*").exclude == ("a.*",)
    with pytest.raises(FieldError, match="exclude"):
        Fuse(exclude=("",))


# --- through fastdit.accelerate ---


def test_flux_fuses_every_declared_group() -> None:
    expected = _baseline()
    out, info = _run(fuse=True)
    np.testing.assert_allclose(out, expected, atol=1e-5, rtol=0)
    fused = info["fuse"]
    pipe, _ = _built()
    blocks = len(pipe.transformer.transformer_blocks), len(pipe.transformer.single_transformer_blocks)
    assert fused["num_groups"] == 2 * blocks[0] + blocks[1]
    assert fused["num_layers"] == 6 * blocks[0] + 4 * blocks[1]
    assert fused["misses"] == 0 and fused["hits"] > 0
    assert "single_transformer_blocks.0.[proj_mlp,attn.to_q,attn.to_k,attn.to_v]" in fused["groups"]
    assert info["techniques"][0] == "fuse"


def test_summary_text_reports_the_groups() -> None:
    pipe, tiny = _built()
    fastdit.accelerate(pipe, fuse=True)
    try:
        run_tiny(pipe, tiny)
        text = str(fastdit.summary(pipe))
    finally:
        fastdit.disable(pipe)
    assert "projections fused into" in text and "0 recomputed" in text


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"offload": fastdit.Offload()}, "with offload="),
        ({"parallel": fastdit.Parallel(tp=2)}, "tensor parallelism splits each projection"),
    ],
)
def test_refused_beside_techniques_that_split_or_stream_the_weights(options: dict, needle: str) -> None:
    pipe, _ = _built()
    with pytest.raises(ArgumentError, match=needle) as info:
        fastdit.accelerate(pipe, fuse=True, **options)
    assert info.value.field == "fuse"
    assert context_of(pipe) is None


def test_refused_for_a_family_that_declares_none() -> None:
    pipe, _ = _built("joyimage")
    with pytest.raises(ArgumentError, match="'joyimage' declares no projections that share an input"):
        fastdit.accelerate(pipe, fuse=True)


def test_accelerate_refuses_a_wrong_type() -> None:
    pipe, _ = _built()
    with pytest.raises(TypeError, match="fuse="):
        fastdit.accelerate(pipe, fuse="yes")


def test_composes_with_a_cache_at_threshold_zero_bit_identically() -> None:
    fused, _ = _run(fuse=True)
    never = fastdit.DBCache(fn=1, bn=0, threshold=0.0, warmup_steps=0)
    both, info = _run(fuse=True, cache=never)
    assert np.array_equal(both, fused)
    assert info["techniques"][:2] == ["fuse", "cache"] and info["fuse"]["misses"] == 0


def test_composes_with_a_cache_that_caches() -> None:
    cache = fastdit.DBCache(fn=1, bn=0, threshold=10.0, warmup_steps=1)
    cached, _ = _run(cache=cache)
    both, info = _run(fuse=True, cache=cache)
    np.testing.assert_allclose(both, cached, atol=1e-5, rtol=0)
    assert info["cache"]["num_cached_steps"] > 0 and info["fuse"]["misses"] == 0


def test_compiled_blocks_trace_one_matmul_per_group() -> None:
    # fullgraph: the identity check and the slices trace without a graph break.
    fused, _ = _run(fuse=True)
    compiled, info = _run(fuse=True, compile=fastdit.Compile(backend="eager", fullgraph=True))
    np.testing.assert_allclose(compiled, fused, atol=1e-5, rtol=0)
    assert info["fuse"]["misses"] == 0


@pytest.mark.slow
def test_inductor_emits_one_matmul_per_group() -> None:
    from torch._inductor.utils import run_and_get_code

    pipe, tiny = _built()
    fused, _ = _run(fuse=True)
    fastdit.accelerate(pipe, fuse=True, compile=fastdit.Compile())
    try:
        compiled, codes = run_and_get_code(lambda: run_tiny(pipe, tiny, output_type="latent"))
    finally:
        fastdit.disable(pipe)
    np.testing.assert_allclose(compiled, fused, atol=1e-4, rtol=0)
    code = "\n".join(codes)
    # The single block's four projections: one matmul of their summed width.
    t = pipe.transformer.single_transformer_blocks[0]
    width = t.proj_mlp.out_features + 3 * t.attn.to_q.out_features
    assert f", {width})" in code


# --- with quantization ---


needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao")


@needs_torchao
def test_weight_only_quantization_quantizes_the_groups() -> None:
    int8 = Quantize(mode="int8_weight")
    alone, plain = _run(quantize=int8)
    both, info = _run(fuse=True, quantize=int8)
    np.testing.assert_allclose(both, alone, atol=1e-4, rtol=0)  # per-row scales: the same codes
    report = info["quantize"]
    groups = set(info["fuse"]["groups"])
    assert groups <= set(report["quantized"])
    assert report["skipped"]["transformer_blocks.0.attn.to_q"].startswith("fused into transformer_blocks.0.[")
    assert report["num_quantized"] == plain["quantize"]["num_quantized"] - info["fuse"]["num_layers"] + len(groups)


@needs_torchao
def test_static_fp8_takes_the_members_largest_scale() -> None:
    from fastdit.calibration import calibrate_scales
    from fastdit.metrics import compare

    pipe, tiny = _built()
    scales = calibrate_scales(pipe, lambda: run_tiny(pipe, tiny))
    config = Quantize(mode="fp8_static", scales=scales)
    alone, _ = _run(quantize=config, output_type="np")
    both, info = _run(fuse=True, quantize=config, output_type="np")
    expected = run_tiny(pipe, tiny)
    assert set(info["fuse"]["groups"]) <= set(info["quantize"]["quantized"])
    assert not np.array_equal(both, expected), "quantization changed nothing"
    # One weight scale per group instead of one per member: close to the unfused quantization, and as close to
    # float32 as it is.
    near = compare(list(alone), list(both))
    assert near.psnr > 35 and near.ssim > 0.98, (near.psnr, near.ssim)
    fused, unfused = compare(list(expected), list(both)), compare(list(expected), list(alone))
    assert fused.psnr > unfused.psnr - 3 and fused.ssim > 0.98, (fused.psnr, unfused.psnr)


@needs_torchao
def test_calibration_records_the_members_through_their_group() -> None:
    from fastdit.calibration import calibrate_scales

    pipe, tiny = _built()
    plain = calibrate_scales(pipe, lambda: run_tiny(pipe, tiny))
    config = Quantize(mode="fp8_static", calibrate=True)
    fastdit.accelerate(pipe, fuse=True, quantize=config)
    try:
        run_tiny(pipe, tiny)
        recorder = context_of(pipe).state("quantize", "transformer")
    finally:
        fastdit.disable(pipe)
    recorded = {name: float(value) for name, value in recorder.amax.items()}
    table = plain.lookup()
    assert recorded and all(abs(recorded[n] - table[f"transformer.{n}"][0]) < 1e-6 for n in recorded)


# --- GPU ---


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bf16_fused_eager_compiled_and_graphed() -> None:
    """bf16 on the GPU: fused calls (eager, compiled, compiled + CUDA graphs) within bf16 rounding of unfused ones."""
    from fastdit.metrics import compare

    pipe, tiny = build_tiny("flux")
    pipe.to("cuda", torch.bfloat16)
    expected = run_tiny(pipe, tiny)
    for name, options in {
        "eager": {},
        "compiled": {"compile": fastdit.Compile()},
        "graphed": {"compile": fastdit.Compile(), "cuda_graph": fastdit.CudaGraph()},
    }.items():
        fastdit.accelerate(pipe, fuse=True, **options)
        try:
            run_tiny(pipe, tiny)  # warm-up (compile, capture)
            out = run_tiny(pipe, tiny)
            fused = fastdit.summary(pipe).transformers["transformer"]["fuse"]
        finally:
            fastdit.disable(pipe)
        quality = compare(list(expected), list(out))
        assert quality.psnr > 35 and quality.ssim > 0.9, (name, quality.psnr, quality.ssim)
        assert fused["misses"] == 0, name
    assert np.array_equal(run_tiny(pipe, tiny), expected)
