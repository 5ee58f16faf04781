"""The tensor-parallel vocabulary, each item against the unsplit module on gloo ranks.

Every item has a case that goes wrong without it: a fused ``[Q|K|V]`` weight split without segments, a ``heads``
attribute left whole, a norm over split features computed locally, a modulation whose output is not gathered.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import fastdit
from fastdit.errors import ArgumentError
from fastdit.models.registry import get_family
from fastdit.parallel.tensor_parallel import apply_tensor_parallel, parameter_bytes
from fastdit.parallel.tp_plan import (
    Colwise,
    LocalSlice,
    Rowwise,
    ShardedNorm,
    TensorParallelPlan,
    resolve_tp_plan,
    validate_tp_plan,
)
from fastdit.testing.distributed import DistributedTestError, WorkerPool

pytestmark = pytest.mark.distributed

DIM, HEADS = 24, 2  # divisible by 2 and 3 ranks; 12 features per head


class FusedAttention(torch.nn.Module):
    """Self-attention with a fused [Q|K|V] projection, a QK-norm over the whole inner dim and AdaLN modulation."""

    def __init__(self, norm: str = "rms") -> None:
        super().__init__()
        self.heads = HEADS * 3
        self.qkv = torch.nn.Linear(DIM, 3 * DIM * 2)
        self.norm_q = torch.nn.RMSNorm(DIM * 2) if norm == "rms" else torch.nn.LayerNorm(DIM * 2)
        self.out = torch.nn.Linear(DIM * 2, DIM)
        self.mod = torch.nn.Linear(DIM, 2 * DIM)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.mod(c).unsqueeze(1).chunk(2, dim=-1)
        x = x * (1 + scale) + shift
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q = self.norm_q(q)
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        return self.out(o)


FULL = TensorParallelPlan(
    layers={
        "qkv": Colwise(segments=(1, 1, 1)),
        "norm_q": ShardedNorm(),
        "out": Rowwise(),
        "mod": Colwise(gather_output=True),
    },
    divide=("heads",),
)
WITHOUT = {
    "segments": TensorParallelPlan(layers={**FULL.layers, "qkv": Colwise()}, divide=("heads",)),
    "divide": TensorParallelPlan(layers=FULL.layers),
    "gather_output": TensorParallelPlan(layers={**FULL.layers, "mod": Colwise()}, divide=("heads",)),
}


def _module(norm: str = "rms") -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    module = FusedAttention(norm).eval()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # non-trivial norm weights and biases
    inputs = (torch.randn(2, 5, DIM), torch.randn(2, DIM))
    return module, inputs


def _split_run(rank: int, world_size: int, plan: TensorParallelPlan, norm: str) -> dict:
    module, inputs = _module(norm)
    originals = {name: p for name, p in module.named_parameters()}
    mesh = init_device_mesh("cpu", (world_size,))
    applied = apply_tensor_parallel(module, plan, mesh, device=torch.device("cpu"), family="test")
    try:
        with torch.no_grad():
            out = module(*inputs).clone()
        stats = applied.state.stats()
        local = parameter_bytes(module)
    finally:
        applied.undo()
    same_objects = all(p is originals[name] for name, p in module.named_parameters())
    return {"out": out, "stats": stats, "local": local, "same_objects": same_objects}


def _expected(norm: str = "rms") -> torch.Tensor:
    module, inputs = _module(norm)
    with torch.no_grad():
        return module(*inputs)


@pytest.mark.parametrize("norm", ["rms", "layer"])
@pytest.mark.parametrize("ranks", [2, 3])
def test_full_plan_matches_unsplit(dist2: WorkerPool, dist3: WorkerPool, ranks: int, norm: str) -> None:
    pool = dist2 if ranks == 2 else dist3
    expected = _expected(norm)
    for result in pool.run(_split_run, FULL, norm):
        torch.testing.assert_close(result["out"], expected, rtol=1e-5, atol=1e-5)
        stats = result["stats"]
        assert stats["split_layers"] == 3 and stats["split_norms"] == 1 and stats["divided_attributes"] == 1
        assert result["local"] == stats["parameter_bytes_per_rank"]
        assert stats["parameter_bytes_per_rank"] == stats["split_bytes"] // ranks + stats["replicated_bytes"]
        assert result["same_objects"], "undo must put the original parameters back"


@pytest.mark.parametrize("missing", list(WITHOUT))
def test_each_item_is_needed(dist2: WorkerPool, missing: str) -> None:
    expected = _expected()
    try:
        results = dist2.run(_split_run, WITHOUT[missing], "rms")
    except DistributedTestError:
        return  # a shape error is a failure too: what matters is that the split is not silently accepted
    for result in results:
        assert (result["out"] - expected).abs().max() > 1e-2, f"the plan without {missing} should not match"


def test_local_norm_over_split_features_fails(dist2: WorkerPool) -> None:
    # The norm replicated while its input is split: the full weight meets a half-width input.
    plan = TensorParallelPlan(layers={k: v for k, v in FULL.layers.items() if k != "norm_q"}, divide=("heads",))
    with pytest.raises(DistributedTestError):
        dist2.run(_split_run, plan, "rms")


# --- checks before anything moves ---


def test_indivisible_degree_names_family_attribute_and_valid_degrees() -> None:
    module, _ = _module()
    validate_tp_plan(module, FULL, 3, "test")
    with pytest.raises(
        ValueError, match=r"'test': .* is not divisible by tp=4; valid tp degrees for this model: 2, 3, 6"
    ):
        validate_tp_plan(module, FULL, 4, "test")


def test_plan_paths_and_types_are_checked() -> None:
    module, _ = _module()
    with pytest.raises(ValueError, match="'missing' matches no module"):
        validate_tp_plan(module, TensorParallelPlan(layers={"missing": Colwise()}), 2, "test")
    with pytest.raises(ValueError, match=r"is a RMSNorm, not a torch\.nn\.Linear"):
        validate_tp_plan(module, TensorParallelPlan(layers={"norm_q": Colwise()}), 2, "test")
    with pytest.raises(ValueError, match="ShardedNorm cannot split"):
        validate_tp_plan(module, TensorParallelPlan(layers={"qkv": ShardedNorm()}), 2, "test")
    with pytest.raises(ValueError, match="has no int attribute 'nope'"):
        validate_tp_plan(module, TensorParallelPlan(layers={"out": Rowwise()}, divide=("qkv.nope",)), 2, "test")
    with pytest.raises(ValueError, match="segments"):
        validate_tp_plan(module, TensorParallelPlan(layers={"qkv": Colwise(segments=(5, 2))}), 2, "test")
    with pytest.raises(ValueError, match="not a pattern"):
        TensorParallelPlan(layers={"out": Rowwise()}, optional=("qkv",))


def test_fallback_serves_the_degrees_the_full_plan_cannot() -> None:
    module, _ = _module()
    ffn_only = TensorParallelPlan(layers={"out": Rowwise()}, name="ffn-only")  # 48 input features
    plan = TensorParallelPlan(layers=FULL.layers, divide=FULL.divide, fallback=ffn_only)
    assert resolve_tp_plan(module, plan, 2, "test") is plan
    assert resolve_tp_plan(module, plan, 4, "test") is ffn_only
    with pytest.raises(ValueError, match="not divisible by tp=5"):
        resolve_tp_plan(module, plan, 5, "test")


def _split_twice(rank: int, world_size: int) -> None:
    module, _ = _module()
    mesh = init_device_mesh("cpu", (world_size,))
    apply_tensor_parallel(module, FULL, mesh, device=torch.device("cpu"))
    apply_tensor_parallel(module, FULL, mesh, device=torch.device("cpu"))


def test_an_already_split_model_is_refused(dist2: WorkerPool) -> None:
    with pytest.raises(DistributedTestError) as info:
        dist2.run(_split_twice)
    assert set(info.value.exc_types.values()) == {"ValueError"}
    assert "is already split" in next(iter(info.value.failures.values())).message


def test_a_family_without_a_plan_or_a_bad_layout_is_refused_before_anything_moves() -> None:
    pipe = get_family("flux").tiny().build()
    before = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    # tp=2 on one process: the layout needs 2 processes.
    with pytest.raises(ValueError, match=r"needs 2 processes, got 1"):
        fastdit.accelerate(pipe, parallel=fastdit.Parallel(tp=2))
    # tp=3 does not divide the tiny model's 2 heads: refused by the check, naming --parallel's field.
    with pytest.raises(ArgumentError, match=r"parallel=.*not divisible by tp=3; valid tp degrees") as info:
        fastdit.accelerate(pipe, parallel=fastdit.Parallel(tp=3))
    assert info.value.field == "parallel"
    assert all(torch.equal(v, before[k]) for k, v in pipe.transformer.state_dict().items())


# --- convolutions and per-head tables ---


class ConvFFN(torch.nn.Module):
    """A gated convolutional FFN (1x1 up to [hidden | gate], depthwise 3x3, 1x1 down) and a RoPE-like table."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Conv2d(DIM, 4 * DIM, 1)
        self.depth = torch.nn.Conv2d(4 * DIM, 4 * DIM, 3, padding=1, groups=4 * DIM)
        self.down = torch.nn.Conv2d(2 * DIM, DIM, 1)
        self.q = torch.nn.Linear(DIM, DIM)
        self.table = torch.nn.Linear(1, DIM)  # a whole-width table, as RoPE modules return
        self.out = torch.nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, gate = self.depth(self.up(x)).chunk(2, dim=1)
        y = self.down(hidden * torch.sigmoid(gate))
        tokens = y.flatten(2).transpose(1, 2)
        scaled = self.q(tokens) * self.table(torch.ones(tokens.shape[1], 1))
        return self.out(scaled)


CONV_PLAN = TensorParallelPlan(
    layers={
        "up": Colwise(segments=(1, 1)),
        "depth": Colwise(segments=(1, 1)),
        "down": Rowwise(),
        "q": Colwise(),
        "table": LocalSlice(dim=-1),
        "out": Rowwise(),
    }
)
CONV_WITHOUT = {
    "segments": TensorParallelPlan(layers={**CONV_PLAN.layers, "up": Colwise(), "depth": Colwise()}),
    "local_slice": TensorParallelPlan(layers={k: v for k, v in CONV_PLAN.layers.items() if k != "table"}),
}


def _conv_module() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return ConvFFN().eval(), torch.randn(2, DIM, 3, 4)


def _conv_run(rank: int, world_size: int, plan: TensorParallelPlan) -> dict:
    module, x = _conv_module()
    mesh = init_device_mesh("cpu", (world_size,))
    applied = apply_tensor_parallel(module, plan, mesh, device=torch.device("cpu"))
    try:
        with torch.no_grad():
            out = module(x).clone()
        stats = applied.state.stats()
    finally:
        applied.undo()
    with torch.no_grad():
        restored = module(x)
    return {"out": out, "stats": stats, "restored": restored}


@pytest.mark.parametrize("ranks", [2, 3])
def test_convolutions_and_local_slices_match_unsplit(dist2: WorkerPool, dist3: WorkerPool, ranks: int) -> None:
    module, x = _conv_module()
    with torch.no_grad():
        expected = module(x)
    for result in (dist2 if ranks == 2 else dist3).run(_conv_run, CONV_PLAN):
        torch.testing.assert_close(result["out"], expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(result["restored"], expected)
        stats = result["stats"]
        assert stats["split_layers"] == 5
        assert stats["parameter_bytes_per_rank"] == stats["split_bytes"] // ranks + stats["replicated_bytes"]


@pytest.mark.parametrize("missing", list(CONV_WITHOUT))
def test_each_convolution_item_is_needed(dist2: WorkerPool, missing: str) -> None:
    module, x = _conv_module()
    with torch.no_grad():
        expected = module(x)
    try:
        results = dist2.run(_conv_run, CONV_WITHOUT[missing])
    except DistributedTestError:
        return
    for result in results:
        assert (result["out"] - expected).abs().max() > 1e-2, f"the plan without {missing} should not match"


def test_units_keep_whole_heads_and_convolutions_are_checked() -> None:
    module, _ = _conv_module()
    plan = TensorParallelPlan(layers={"q": Colwise(unit=12), "out": Rowwise(unit=12)})
    validate_tp_plan(module, plan, 2, "test")
    with pytest.raises(ValueError, match=r"units of 12 = 2 is not divisible by tp=3; valid tp degrees .*: 2$"):
        validate_tp_plan(module, plan, 3, "test")
    with pytest.raises(ValueError, match="a grouped convolution splits column-wise only"):
        validate_tp_plan(module, TensorParallelPlan(layers={"depth": Rowwise()}), 2, "test")
    with pytest.raises(ValueError, match="gather_output applies to a Linear only"):
        validate_tp_plan(module, TensorParallelPlan(layers={"up": Colwise(gather_output=True)}), 2, "test")


def test_planned_bytes_equal_what_splitting_reports(dist2: WorkerPool) -> None:
    from fastdit.parallel.tensor_parallel import planned_bytes

    module, _ = _module()
    planned = planned_bytes(module.to("meta"), FULL, 2)
    stats = dist2.run(_split_run, FULL, "rms")[0]["stats"]
    assert planned["plan"] == "full"
    for key in ("split_bytes", "replicated_bytes", "parameter_bytes_per_rank"):
        assert planned[key] == stats[key], key


def test_ulysses_head_check_counts_the_heads_of_one_tensor_parallel_shard() -> None:
    from fastdit.parallel.plan import validate_plan

    transformer = get_family("flux").tiny().build().transformer  # 2 heads
    plan = get_family("flux").cp_plan
    validate_plan(transformer, plan, 2, uneven_heads=False)  # 2 heads over 2 Ulysses ranks
    with pytest.raises(ValueError, match="1 heads per tensor-parallel shard, which do not divide the Ulysses degree 2"):
        validate_plan(transformer, plan, 2, uneven_heads=False, tp_degree=2)


class _Tables(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.reshape(2, 3, 12), x.reshape(2, 6, 3, 2)  # (B, S, features) and (B, heads, S, d)


def _slice_tables(rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    module = _Tables()
    plan = TensorParallelPlan(layers={"": LocalSlice(dim={3: -1, 4: 1})})
    applied = apply_tensor_parallel(module, plan, init_device_mesh("cpu", (world_size,)), device=torch.device("cpu"))
    try:
        return module(torch.arange(72.0))
    finally:
        applied.undo()


def test_local_slice_picks_the_dim_by_the_tensor_layout(dist2: WorkerPool) -> None:
    features, heads = _Tables()(torch.arange(72.0))
    for rank, (f, h) in enumerate(dist2.run(_slice_tables)):
        assert torch.equal(f, features[..., rank * 6 : (rank + 1) * 6])
        assert torch.equal(h, heads[:, rank * 3 : (rank + 1) * 3])


# --- SplitParameter: a per-head parameter the model's code reads directly ---


class _PerHeadScale(torch.nn.Module):
    def __init__(self, heads: int) -> None:
        super().__init__()
        self.attn = torch.nn.Module()
        self.attn.scale = torch.nn.Parameter(torch.ones(heads))
        self.attn.proj = torch.nn.Linear(8, 8)


def test_split_parameter_is_checked_on_meta() -> None:
    from fastdit.parallel.tensor_parallel import planned_bytes
    from fastdit.parallel.tp_plan import Colwise, SplitParameter, TensorParallelPlan, validate_tp_plan

    plan = TensorParallelPlan(layers={"attn": SplitParameter("scale"), "attn.proj": Colwise()})
    with torch.device("meta"):
        per_head, scalar = _PerHeadScale(4), _PerHeadScale(1)
    validate_tp_plan(per_head, plan, 2, "toy")
    with pytest.raises(ValueError, match=r"attn.scale = 4 is not divisible by tp=3"):
        validate_tp_plan(per_head, plan, 3, "toy")
    validate_tp_plan(scalar, TensorParallelPlan(layers={"attn": SplitParameter("scale")}), 3, "toy")  # broadcast
    assert planned_bytes(per_head, plan, 2)["split_bytes"] == 4 * 4 + (8 * 8 + 8) * 4
    assert planned_bytes(scalar, plan, 2)["replicated_bytes"] == 4  # the scalar stays whole
    missing = TensorParallelPlan(layers={"attn": SplitParameter("gain")})
    with pytest.raises(ValueError, match="has no parameter 'gain'"):
        validate_tp_plan(per_head, missing, 2, "toy")
    optional = TensorParallelPlan(layers={"attn": SplitParameter("gain")}, optional=("attn",))
    validate_tp_plan(per_head, optional, 2, "toy")
    with pytest.raises(ValueError, match=r"SplitParameter\.name"):
        SplitParameter("attn.scale")
