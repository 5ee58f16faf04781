"""The context-parallel plan vocabulary and its static validation on the meta device."""

from __future__ import annotations

import pytest
import torch

from fastdit.models.flux import CP_PLAN
from fastdit.parallel.plan import (
    AttentionRouting,
    ContextParallelPlan,
    GatherOutput,
    SplitInput,
    SplitOutput,
    match_modules,
    validate_plan,
)

FLUX_MODULE = "diffusers.models.transformers.transformer_flux"
ROUTING = AttentionRouting(modules=(FLUX_MODULE,))


def _flux_dev_on_meta() -> torch.nn.Module:
    """A FLUX.1-dev-sized transformer without memory: validation must not need weights."""
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        return FluxTransformer2DModel(guidance_embeds=True)


def _plan(**overrides) -> ContextParallelPlan:
    fields = {
        "inputs": {"": {"hidden_states": SplitInput(1, 3)}},
        "gather": {"proj_out": GatherOutput(1, 3)},
        "attention": ROUTING,
    }
    fields.update(overrides)
    return ContextParallelPlan(**fields)


@pytest.fixture(scope="module")
def flux_dev() -> torch.nn.Module:
    return _flux_dev_on_meta()


def test_flux_plan_validates_on_meta(flux_dev: torch.nn.Module) -> None:
    assert next(flux_dev.parameters()).device.type == "meta"
    for degree in (1, 2, 3, 4, 8):
        validate_plan(flux_dev, CP_PLAN, degree)


def test_unknown_path_is_named(flux_dev: torch.nn.Module) -> None:
    with pytest.raises(ValueError, match="'proj_output'"):
        validate_plan(flux_dev, _plan(gather={"proj_output": GatherOutput(1)}), 2)


def test_unknown_argument_is_named(flux_dev: torch.nn.Module) -> None:
    with pytest.raises(ValueError, match="no argument 'image_ids'"):
        validate_plan(flux_dev, _plan(inputs={"": {"image_ids": SplitInput(0)}}), 2)
    with pytest.raises(ValueError, match=r"'transformer_blocks\.0'.*no argument 'temb_x'"):
        validate_plan(flux_dev, _plan(inputs={"transformer_blocks.*": {"temb_x": SplitInput(1)}}), 2)


def test_heads_must_divide_unless_padded(flux_dev: torch.nn.Module) -> None:
    validate_plan(flux_dev, CP_PLAN, 5)  # 24 heads over 5 ranks: padded to 25
    with pytest.raises(ValueError, match=r"24 heads.*Ulysses degree 5"):
        validate_plan(flux_dev, CP_PLAN, 5, uneven_heads=False)


def test_unrouted_processor_module_is_named(flux_dev: torch.nn.Module) -> None:
    plan = _plan(attention=AttentionRouting(modules=("diffusers.models.attention_dispatch",)))
    with pytest.raises(ValueError, match=r"FluxAttnProcessor.*does not route"):
        validate_plan(flux_dev, plan, 2)
    plan = _plan(attention=AttentionRouting(modules=(FLUX_MODULE, "torch.nn.functional")))
    with pytest.raises(ValueError, match="no dispatch_attention_fn"):
        validate_plan(flux_dev, plan, 2)


def test_processor_that_cannot_be_routed_is_named() -> None:
    from diffusers.models.attention_processor import Attention, AttnProcessor2_0

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = Attention(8, heads=2, dim_head=4, processor=AttnProcessor2_0())
            self.proj_out = torch.nn.Linear(8, 8)

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            return self.proj_out(self.attn(hidden_states))

    plan = _plan(attention=AttentionRouting(modules=("diffusers.models.attention_processor",)))
    with pytest.raises(ValueError, match="does not pass a parallel_config"):
        validate_plan(Model(), plan, 2)


def test_match_modules_wildcards(flux_dev: torch.nn.Module) -> None:
    assert [name for name, _ in match_modules(flux_dev, "")] == [""]
    blocks = match_modules(flux_dev, "single_transformer_blocks.*")
    assert [name for name, _ in blocks] == [f"single_transformer_blocks.{i}" for i in range(38)]
    assert [name for name, _ in match_modules(flux_dev, "transformer_blocks.*.attn")][:2] == [
        "transformer_blocks.0.attn",
        "transformer_blocks.1.attn",
    ]
    assert match_modules(flux_dev, "nothing.*") == []


def test_plan_is_frozen_data() -> None:
    plan = _plan(outputs={"pos_embed": (SplitOutput(0, 2, index=0), SplitOutput(0, 2, index=1))})
    with pytest.raises(TypeError):
        plan.inputs[""]["encoder_hidden_states"] = SplitInput(1)  # type: ignore[index]
    assert plan.outputs["pos_embed"][1].index == 1
    assert _plan(outputs={"rope": SplitOutput(1)}).outputs["rope"] == (SplitOutput(1),)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: SplitInput(dim=1.5), "SplitInput.dim"),
        (lambda: GatherOutput(dim=1, expected_dims=0), "GatherOutput.expected_dims"),
        (lambda: AttentionRouting(modules=()), "AttentionRouting.modules"),
        (lambda: _plan(gather={}), "gather"),
        (lambda: _plan(inputs={"": {"x": GatherOutput(1)}}), r"inputs\[''\]\['x'\]"),
        (lambda: _plan(attention=AttentionRouting(modules=(FLUX_MODULE,), mask_segments=("txt",))), "'txt'"),
    ],
)
def test_invalid_plans_raise(make, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def _families_with_plans() -> list[str]:
    from fastdit.models.registry import all_adapters

    return sorted(a.family for a in all_adapters() if a.cp_plan is not None)


def test_flux_wan_and_qwen_image_have_plans() -> None:
    assert {"flux", "qwenimage", "wan"} <= set(_families_with_plans())


@pytest.mark.parametrize("family", _families_with_plans())
def test_every_plan_validates_against_the_default_config_on_meta(family: str) -> None:
    """Each family's plan fits its transformer class at the class's default (full-size) config, without weights."""
    import importlib

    from fastdit.models.registry import all_adapters

    adapter = next(a for a in all_adapters() if a.family == family)
    for qualified in adapter.transformer_classes:
        module_name, _, class_name = qualified.rpartition(".")
        cls = getattr(importlib.import_module(module_name), class_name)
        with torch.device("meta"):
            transformer = cls()
        for degree in (2, 3, 4, 8):
            validate_plan(transformer, adapter.cp_plan, degree)
