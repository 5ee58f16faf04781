"""The context-parallel plan vocabulary and its static validation on the meta device."""

from __future__ import annotations

import pytest
import torch

from fastdit.models.flux import CP_PLAN
from fastdit.parallel.plan import (
    AttentionRouting,
    ContextParallelPlan,
    GatherInput,
    GatherOutput,
    Halo,
    LeadingCount,
    LocalExtent,
    SplitInput,
    SplitOutput,
    TokenSum,
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


def test_match_modules_class_filter(flux_dev: torch.nn.Module) -> None:
    """A trailing ``[ClassName]`` keeps the matches of that class; a plan path so filtered may match nothing."""
    attention = type(flux_dev.transformer_blocks[0].attn).__name__
    matched = match_modules(flux_dev, f"transformer_blocks.*.attn[{attention}]")
    assert [name for name, _ in matched] == [f"transformer_blocks.{i}.attn" for i in range(19)]
    assert match_modules(flux_dev, "transformer_blocks.*.attn[NoSuchClass]") == []
    assert match_modules(flux_dev, f"[{type(flux_dev).__name__}]") == [("", flux_dev)]
    # Validation: an unmatched filtered path selects no module (a checkpoint without such layers) ...
    gather = {"proj_out": GatherOutput(1, 3), "transformer_blocks.*.ff[NoSuchClass]": GatherOutput(1, 3)}
    validate_plan(flux_dev, _plan(gather=gather), 2)
    # ... while an unmatched plain path is an error.
    with pytest.raises(ValueError, match=r"path 'transformer_blocks.\*.nothing' matches no module"):
        validate_plan(flux_dev, _plan(gather={"transformer_blocks.*.nothing": GatherOutput(1, 3)}), 2)


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
        (
            lambda: AttentionRouting(modules=()),
            "AttentionRouting: modules, sdpa_modules, dispatch_modules and sdpa_calls",
        ),
        (lambda: AttentionRouting(modules=("m",), dispatch_modules=("m",)), "AttentionRouting.dispatch_modules"),
        (lambda: AttentionRouting(modules=("m",), exchange_lengths=1), "AttentionRouting.exchange_lengths"),
        (lambda: AttentionRouting(modules=(FLUX_MODULE,), mask_transform="diagonal"), "mask_transform"),
        (lambda: _plan(gather={}), "gather"),
        (lambda: _plan(inputs={"": {"x": GatherOutput(1)}}), r"inputs\[''\]\['x'\]"),
        (lambda: _plan(attention=AttentionRouting(modules=(FLUX_MODULE,), mask_segments=("txt",))), "'txt'"),
        (lambda: SplitInput(dim=1, tail_of="x", segments=("y",)), "SplitInput.tail_of"),
        (lambda: _plan(inputs={"": {"local": SplitInput(1, tail_of="img")}}), r"tail_of='img' is not a plain"),
        (
            lambda: _plan(
                inputs={
                    "": {
                        "hidden_states": SplitInput(1, 3),
                        "a": SplitInput(1, tail_of="hidden_states"),
                        "b": SplitInput(1, tail_of="a"),
                    }
                }
            ),
            r"tail_of='a' is not a plain",
        ),
        (lambda: SplitInput(dim=1, allow_empty=1), "SplitInput.allow_empty"),
        (lambda: SplitInput(dim=1, allow_empty=True, segments=("a",)), "SplitInput.allow_empty=True"),
        (lambda: LeadingCount(of=""), "LeadingCount.of"),
        (lambda: LeadingCount(of="hidden_states", position=-1), "LeadingCount.position"),
        (lambda: _plan(inputs={"": {"n": LeadingCount(of="img")}}), r"LeadingCount\.of='img' is not a split input"),
        (
            lambda: _plan(
                inputs={"": {"n": LeadingCount(of="hidden_states")}},
                attention=AttentionRouting(modules=(FLUX_MODULE,), mask_segments=("n",)),
            ),
            "mask_segments: 'n'",
        ),
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
        try:
            with torch.device("meta"):
                transformer = cls()
        except (TypeError, ValueError):  # no usable default config (in_channels=None): the tiny one's config
            from fastdit.testing.pipelines import build_tiny

            # The tiny pipeline's largest module of that class: a component, or a sub-module of one (the transformer
            # stacks inside a UNet, of which the self-attention-free ones have no attention to route).
            components = [c for c in build_tiny(family)[0].components.values() if isinstance(c, torch.nn.Module)]
            found = [m for c in components for m in c.modules() if type(m) is cls]
            config = max(found, key=lambda m: sum(p.numel() for p in m.parameters())).config
            with torch.device("meta"):
                transformer = cls.from_config(config)
        for degree in (2, 3, 4, 8):
            validate_plan(transformer, adapter.cp_plan, degree)


# --- attention modules kept local ---


def test_local_attention_is_not_validated_as_routed(flux_dev: torch.nn.Module) -> None:
    from diffusers.models.attention_processor import Attention, AttnProcessor2_0
    from diffusers.models.transformers.transformer_flux import FluxAttention

    class Model(torch.nn.Module):
        """A routable attention and one that calls SDPA itself (like a text refiner)."""

        def __init__(self) -> None:
            super().__init__()
            self.refiner = torch.nn.ModuleList([Attention(8, heads=2, dim_head=4, processor=AttnProcessor2_0())])
            self.attn = FluxAttention(8, heads=2, dim_head=4)
            self.proj_out = torch.nn.Linear(8, 8)

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            return self.proj_out(self.attn(self.refiner[0](hidden_states)))

    with pytest.raises(ValueError, match=r"'refiner\.0' does not pass a parallel_config"):
        validate_plan(Model(), _plan(), 2)
    validate_plan(Model(), _plan(attention=AttentionRouting(modules=(FLUX_MODULE,), local=("refiner.*",))), 2)
    everything = AttentionRouting(modules=(FLUX_MODULE,), local=("refiner.*", "attn"))
    with pytest.raises(ValueError, match="no attention processors to route"):
        validate_plan(Model(), _plan(attention=everything), 2)
    validate_plan(
        flux_dev, _plan(attention=AttentionRouting(modules=(FLUX_MODULE,), local=("transformer_blocks.*",))), 2
    )


@pytest.mark.parametrize("pattern", ["refiner.*", "proj_out", "transformer_blocks.*.ff"])
def test_local_pattern_covering_no_attention_is_named(flux_dev: torch.nn.Module, pattern: str) -> None:
    routing = AttentionRouting(modules=(FLUX_MODULE,), local=("single_transformer_blocks.*.attn", pattern))
    with pytest.raises(ValueError, match=rf"local path '{pattern}' covers no attention module"):
        validate_plan(flux_dev, _plan(attention=routing), 2)


def test_local_pattern_covers_the_subtree(flux_dev: torch.nn.Module) -> None:
    from fastdit.parallel.plan import local_attention_paths

    routing = AttentionRouting(modules=(FLUX_MODULE,), local=("transformer_blocks.-1",))
    assert local_attention_paths(flux_dev, routing) == {"transformer_blocks.18.attn"}


def test_local_must_be_a_tuple_of_paths() -> None:
    with pytest.raises(ValueError, match="not a string"):
        AttentionRouting(modules=(FLUX_MODULE,), local="refiner.*")  # type: ignore[arg-type]
    assert AttentionRouting(modules=(FLUX_MODULE,), local=["a.*"]).local == ("a.*",)  # type: ignore[arg-type]


def test_mark_processors_skips_local_modules() -> None:
    from fastdit.models.flux import tiny_transformer
    from fastdit.parallel.attention.dispatch import RoutedAttention, attention_processors, mark_processors

    transformer = tiny_transformer(0)
    marker = RoutedAttention()
    local = {name for name in attention_processors(transformer) if name.startswith("single_transformer_blocks.")}
    assert local
    undo = mark_processors(transformer, marker, local)
    marked = {name for name, p in attention_processors(transformer).items() if "_parallel_config" in vars(p)}
    assert marked == set(attention_processors(transformer)) - local
    assert all(p._parallel_config is marker for name, p in attention_processors(transformer).items() if name in marked)
    undo()
    assert not any("_parallel_config" in vars(p) for p in attention_processors(transformer).values())


def test_processor_shared_by_local_and_parallel_module_is_refused() -> None:
    from fastdit.models.flux import tiny_transformer
    from fastdit.parallel.attention.dispatch import RoutedAttention, attention_processors, mark_processors

    transformer = tiny_transformer(0)
    transformer.single_transformer_blocks[0].attn.processor = transformer.transformer_blocks[0].attn.processor
    local = {"transformer_blocks.0.attn"}
    with pytest.raises(ValueError, match=r"shared by 'transformer_blocks\.0\.attn'.*'single_transformer_blocks\.0"):
        mark_processors(transformer, RoutedAttention(), local)
    assert not any("_parallel_config" in vars(p) for p in attention_processors(transformer).values())
    mark_processors(transformer, RoutedAttention(), local | {"single_transformer_blocks.0.attn"})()


# --- the last entry of a module list ---


def test_last_entry_of_a_module_list(flux_dev: torch.nn.Module) -> None:
    assert [n for n, _ in match_modules(flux_dev, "single_transformer_blocks.-1")] == ["single_transformer_blocks.37"]
    assert [n for n, _ in match_modules(flux_dev, "transformer_blocks.-1.attn")] == ["transformer_blocks.18.attn"]
    assert match_modules(flux_dev, "nothing.-1") == []
    with pytest.raises(ValueError, match="ModuleList or Sequential"):
        match_modules(flux_dev, "proj_out.-1")
    with pytest.raises(ValueError, match=r"ModuleList or Sequential at 'transformer_blocks\.0'"):
        match_modules(flux_dev, "transformer_blocks.*.-1")  # '*' matches blocks, which are no lists
    validate_plan(flux_dev, _plan(gather={"single_transformer_blocks.-1": GatherOutput(1, 3)}), 2)
    with pytest.raises(ValueError, match=r"'nothing\.-1' matches no module"):
        validate_plan(flux_dev, _plan(gather={"nothing.-1": GatherOutput(1, 3)}), 2)


class _Stage(torch.nn.Module):
    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(blocks))


class _Staged(torch.nn.Module):
    """Stages with block lists of different lengths (a UNet's transformer stacks)."""

    def __init__(self) -> None:
        super().__init__()
        self.stages = torch.nn.ModuleList([_Stage(1), _Stage(3), _Stage(2)])


def test_last_entry_of_every_list_a_wildcard_matches() -> None:
    """``-1`` after ``*``: the last entry of each list the components before it match."""
    model = _Staged()
    assert [n for n, _ in match_modules(model, "stages.*.blocks.-1")] == [
        "stages.0.blocks.0",
        "stages.1.blocks.2",
        "stages.2.blocks.1",
    ]
    assert [n for n, _ in match_modules(model, "stages.-1.blocks.-1")] == ["stages.2.blocks.1"]
    assert match_modules(model, "others.*.blocks.-1") == []


def test_optional_paths_may_match_nothing(flux_dev: torch.nn.Module) -> None:
    """Paths in ``optional`` (a UNet's lists that the bare transformer lacks) may match nothing; others must."""
    gather = {"proj_out": GatherOutput(1, 3), "down_blocks.*.attentions.*.blocks.-1": GatherOutput(1, 3)}
    inputs = {"": {"hidden_states": SplitInput(1, 3)}, "down_blocks.*.blocks.0": {"hidden_states": SplitInput(1, 3)}}
    routing = AttentionRouting(modules=(FLUX_MODULE,), local=("down_blocks.*.blocks.*.attn2",))
    optional = ("down_blocks.*.attentions.*.blocks.-1", "down_blocks.*.blocks.0", "down_blocks.*.blocks.*.attn2")
    validate_plan(flux_dev, _plan(inputs=inputs, gather=gather, attention=routing, optional=optional), 2)
    with pytest.raises(ValueError, match=r"path 'down_blocks\.\*\.blocks\.0' matches no module"):
        validate_plan(flux_dev, _plan(inputs=inputs, gather=gather, attention=routing, optional=optional[::2]), 2)
    with pytest.raises(ValueError, match=r"local path 'down_blocks\.\*\.blocks\.\*\.attn2' covers no attention"):
        validate_plan(flux_dev, _plan(inputs=inputs, gather=gather, attention=routing, optional=optional[:2]), 2)
    with pytest.raises(ValueError, match=r"optional entry 'proj_output': not a path"):
        _plan(optional=("proj_output",))
    with pytest.raises(ValueError, match="expected a tuple of paths"):
        _plan(optional="proj_out")


# --- leading-token counts and gathering one element of a tuple output ---


class _Block(torch.nn.Module):
    def forward(self, hidden_states: torch.Tensor, num_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        return hidden_states, hidden_states


class _VarArgsBlock(torch.nn.Module):
    def forward(self, hidden_states: torch.Tensor, temb: torch.Tensor, *args: object) -> torch.Tensor:
        return hidden_states


class _Counted(torch.nn.Module):
    def __init__(self, block: type[torch.nn.Module]) -> None:
        from diffusers.models.transformers.transformer_flux import FluxAttention

        super().__init__()
        self.attn = FluxAttention(4, heads=2, dim_head=2)
        self.blocks = torch.nn.ModuleList([block()])
        self.proj_out = torch.nn.Linear(4, 4)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.proj_out(self.blocks[0](self.attn(hidden_states), hidden_states)[0])


def _count_plan(count: LeadingCount, name: str = "num_tokens") -> ContextParallelPlan:
    return _plan(
        inputs={"": {"hidden_states": SplitInput(1, 3)}, "blocks.*": {name: count}},
        gather={"blocks.-1": GatherOutput(1, 3, index=0)},
    )


def test_leading_count_by_name_or_position() -> None:
    named, varargs = _Counted(_Block), _Counted(_VarArgsBlock)
    validate_plan(named, _count_plan(LeadingCount(of="hidden_states")), 2)
    validate_plan(named, _count_plan(LeadingCount(of="hidden_states", position=1)), 2)
    with pytest.raises(ValueError, match="takes 'num_tokens' at position 1, not 2"):
        validate_plan(named, _count_plan(LeadingCount(of="hidden_states", position=2)), 2)
    # Through *args: the position must be a slot of *args, not a named argument.
    validate_plan(varargs, _count_plan(LeadingCount(of="hidden_states", position=6)), 2)
    validate_plan(varargs, _count_plan(LeadingCount(of="hidden_states", position=2)), 2)
    with pytest.raises(ValueError, match="no argument 'num_tokens' and no \\*args slot at position 1"):
        validate_plan(varargs, _count_plan(LeadingCount(of="hidden_states", position=1)), 2)
    with pytest.raises(ValueError, match="no argument 'num_tokens'"):
        validate_plan(varargs, _count_plan(LeadingCount(of="hidden_states")), 2)
    with pytest.raises(ValueError, match="no argument 'count' and no \\*args slot"):
        validate_plan(named, _count_plan(LeadingCount(of="hidden_states", position=5), name="count"), 2)


def test_gather_output_index() -> None:
    assert GatherOutput(1, 3, index=0).index == 0
    assert GatherOutput(1).index is None


# --- linear attention and row-mixing convolutions: SplitInput.unit, LocalExtent, Halo, TokenSum ---


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: SplitInput(1, unit="width"), "SplitInput.unit"),
        (lambda: LocalExtent(of=""), "LocalExtent.of"),
        (lambda: LocalExtent(of="hidden_states", position=True), "LocalExtent.position"),
        (lambda: Halo(dim=2, size=0), "Halo.size"),
        (lambda: Halo(dim=2, size=2), "Halo.size"),
        (lambda: Halo(dim="h"), "Halo.dim"),
        (lambda: TokenSum("matmul"), "TokenSum.op"),
        (lambda: TokenSum(torch.matmul, -1), "TokenSum.occurrence"),
        (lambda: AttentionRouting(linear={"blocks.*.attn1": ()}), r"AttentionRouting.linear\['blocks.\*.attn1'\]"),
        (lambda: _plan(halo={"blocks.0.conv": GatherOutput(1)}), r"halo\['blocks.0.conv'\]"),
        (lambda: _plan(inputs={"": {"height": LocalExtent(of="img")}}), r"LocalExtent\.of='img' is not a split"),
        (lambda: GatherInput(dim="1"), "GatherInput.dim"),
        (lambda: _plan(inputs={"": {"hidden_states": GatherOutput(1)}}), "expected SplitInput, LeadingCount"),
    ],
)
def test_invalid_token_mixing_items_raise(make, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_linear_only_routing_and_its_validation() -> None:
    from fastdit.models import sana

    transformer = sana.tiny_transformer(0)
    plan = sana.CP_PLAN
    validate_plan(transformer, plan, 2)

    def replaced(**changes) -> ContextParallelPlan:
        fields = {"inputs": plan.inputs, "gather": plan.gather, "halo": plan.halo, "attention": plan.attention}
        return ContextParallelPlan(**{**fields, **changes})

    sums = (TokenSum(torch.matmul),)
    unit = {"transformer_blocks.0": {"hidden_states": SplitInput(1, 3, unit=("rows",))}}
    with pytest.raises(ValueError, match="no argument 'rows'"):
        validate_plan(transformer, replaced(inputs=unit), 2)
    with pytest.raises(ValueError, match=r"linear path 'transformer_blocks\.\*\.norm1' covers no attention"):
        validate_plan(transformer, replaced(attention=AttentionRouting(linear={"transformer_blocks.*.norm1": sums})), 2)
    both = AttentionRouting(linear={"transformer_blocks.*": sums}, local=("transformer_blocks.*.attn2",))
    with pytest.raises(ValueError, match="both local and linear"):
        validate_plan(transformer, replaced(attention=both), 2)
    with pytest.raises(ValueError, match=r"path 'transformer_blocks\.\*\.ff\.conv9' matches no module"):
        validate_plan(transformer, replaced(halo={"transformer_blocks.*.ff.conv9": Halo(2)}), 2)
    # Without the linear routing the linear processors are unroutable, as before.
    with pytest.raises(ValueError, match="SanaLinearAttnProcessor2_0"):
        validate_plan(
            transformer,
            replaced(attention=AttentionRouting(modules=(FLUX_MODULE,), local=("transformer_blocks.*.attn2",))),
            2,
        )


def test_gather_output_index_tuple() -> None:
    assert GatherOutput(1, 3, index=[0, 1]).index == (0, 1)  # normalised: the plan stays hashable data
    for index in [(), (0, 0), (0, True), (0, "1")]:
        with pytest.raises(ValueError, match=r"GatherOutput\.index"):
            GatherOutput(1, 3, index=index)


# --- segment-wise splits of one concatenated argument ---


def _segment_plan(**block: object) -> ContextParallelPlan:
    return _plan(inputs={"": {"hidden_states": SplitInput(1, 3)}, "blocks.*": block})


def test_split_input_segments() -> None:
    rope = SplitInput(1, 6, segments=["hidden_states", "encoder_hidden_states"])
    assert rope.segments == ("hidden_states", "encoder_hidden_states")
    assert SplitInput(1).segments == ()
    plan = _segment_plan(hidden_states=SplitInput(1, 3), encoder_hidden_states=SplitInput(1, 3), rope=rope)
    assert plan.inputs["blocks.*"]["rope"] is rope
    with pytest.raises(ValueError, match=r"SplitInput\.segments"):
        SplitInput(1, segments="hidden_states")
    with pytest.raises(ValueError, match=r"SplitInput\.segments"):
        SplitInput(1, segments=("hidden_states", ""))
    # Segments name plain splits of the same path: their split record is the one of this call.
    for block, segment in [
        ({"rope": SplitInput(1, segments=("hidden_states",))}, "hidden_states"),  # split at the root only
        ({"x": SplitInput(1), "rope": SplitInput(1, segments=("x", "rope"))}, "rope"),  # itself
        ({"x": SplitInput(1, segments=("y",)), "y": SplitInput(1), "rope": SplitInput(1, segments=("x",))}, "x"),
        ({"n": LeadingCount(of="hidden_states"), "rope": SplitInput(1, segments=("n",))}, "n"),
    ]:
        with pytest.raises(ValueError, match=f"segment '{segment}' is not another plain SplitInput of the same path"):
            _segment_plan(**block)


def test_gather_input_follows_the_splits_of_its_module() -> None:
    """A gathered input reads this forward's split record, so it is applied after the module's plain splits."""
    from fastdit.parallel.context_parallel import _splits_then_counts

    specs = {"hidden_states": GatherInput(1, 3), "encoder_hidden_states": SplitInput(1, 3)}
    splits, later = _splits_then_counts(specs)
    assert list(splits) == ["encoder_hidden_states"] and list(later) == ["hidden_states"]


# --- SplitInput.tail_of: rows lined up with the last tokens of a split input ---


def _tail_splitter(rank: int, lens: list[int]):
    """A splitter of rank ``rank`` whose forward split ``hidden_states`` as ``lens`` (no process group needed)."""
    from fastdit.parallel.attention.dispatch import ForwardLayout
    from fastdit.parallel.context_parallel import _Splitter

    splitter = _Splitter.__new__(_Splitter)
    splitter.degree, splitter.rank, splitter.layout = len(lens), rank, ForwardLayout()
    splitter.layout.record("hidden_states", lens)
    return splitter


@pytest.mark.parametrize(
    ("lens", "prepended", "expected"),
    [
        ([6, 6, 6], 12, [[], [], [0, 1, 2, 3, 4, 5]]),  # two ranks hold prepended tokens only: empty slices
        ([7, 7, 6], 4, [[0, 1, 2], [3, 4, 5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15]]),
        ([5, 5], 0, [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]),  # no prepended tokens: a plain split
    ],
)
def test_tail_split_gives_each_rank_the_rows_of_its_own_tokens(
    lens: list[int], prepended: int, expected: list[list[int]]
) -> None:
    spec = SplitInput(dim=1, expected_dims=3, tail_of="hidden_states")
    assert spec.reads_record
    rows = torch.arange(sum(lens) - prepended, dtype=torch.float32).view(1, -1, 1)
    for rank, want in enumerate(expected):
        local = spec.adjust(rows, _tail_splitter(rank, lens), "local_seq")
        assert local.view(-1).tolist() == want
        # What the block adds them to: its shard's tokens after the prepended ones it holds (LeadingCount).
        held = _tail_splitter(rank, lens).count(prepended, "hidden_states")
        assert local.shape[1] == lens[rank] - held


def test_tail_split_passes_whole_when_its_input_was_not_split_and_refuses_a_longer_tail() -> None:
    from fastdit.errors import ShardError

    spec = SplitInput(dim=1, tail_of="hidden_states")
    rows = torch.zeros(1, 4, 2)
    unsplit = _tail_splitter(0, [3, 3])
    unsplit.layout.splits.clear()
    assert spec.adjust(rows, unsplit, "local_seq") is rows
    with pytest.raises(ShardError, match="local_seq has 7 tokens along dim 1, more than hidden_states"):
        spec.adjust(torch.zeros(1, 7, 2), _tail_splitter(0, [3, 3]), "local_seq")


# --- whole frames of a tuple layout: SplitInput.unit "name[i]", LocalExtent.index, SplitOutput.like ---


def test_unit_and_extent_read_elements_of_a_tuple_argument() -> None:
    from fastdit.parallel.plan import unit_argument

    assert unit_argument("THW[2]") == ("THW", 2) and unit_argument("width") == ("width", None)
    splitter = _tail_splitter(1, [32, 16])  # rank 1 of 2: one of three frames of 16 tokens
    splitter.layout.record("x", [32, 16])
    assert LocalExtent(of="x", index=0).adjust((3, 4, 4), splitter, "HW") == (1, 4, 4)
    assert LocalExtent(of="x", index=0).adjust(None, splitter, "HW") is None  # not a tuple: unchanged
    with pytest.raises(ValueError, match=r"LocalExtent\.index"):
        LocalExtent(of="x", index="0")


def test_split_output_like_takes_the_shards_of_its_input() -> None:
    splitter = _tail_splitter(0, [32, 16])
    splitter.layout.record("x", [32, 16])
    out = torch.arange(48).view(1, 48, 1)
    assert splitter.split_like(out, 1, 3, "attn", "x").flatten().tolist() == list(range(32))
    assert splitter.split_like(out, 1, 3, "attn", "y") is out  # "y" not split in this forward: whole
    with pytest.raises(ValueError, match=r"SplitOutput\.like"):
        splitter.split_like(out[:, :40], 1, 3, "attn", "x")
    with pytest.raises(ValueError, match=r"SplitOutput\.like"):
        SplitOutput(1, like=None)
    with pytest.raises(ValueError, match=r"SplitOutput\.like='y' is not a split input"):
        _plan(outputs={"transformer_blocks.*.attn": SplitOutput(1, like="y")})


def test_local_only_routing_is_a_routing() -> None:
    from fastdit.models import sana_wm

    assert AttentionRouting(local=("blocks.*.cross_attn",)).local == ("blocks.*.cross_attn",)
    transformer = sana_wm.tiny_transformer(0)
    validate_plan(transformer, sana_wm.CP_PLAN, 2)  # also its "THW[1]" units, checked by the argument's name
    unit = {"blocks.0": {"x": SplitInput(1, 3, unit=("TWH[1]",))}}
    plan = ContextParallelPlan(inputs=unit, gather=sana_wm.CP_PLAN.gather, attention=sana_wm.CP_PLAN.attention)
    with pytest.raises(ValueError, match=r"no argument 'TWH\[1\]'"):
        validate_plan(transformer, plan, 2)
