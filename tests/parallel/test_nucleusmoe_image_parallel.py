"""NucleusMoE-Image's mixture of experts split over gloo ranks: routing and routed output equal one process.

Expert-choice routing picks each expert's top tokens over the whole sample, so a split that let a shard route on its
own would silently route differently. Under context parallelism (Ulysses, ring, uneven Ulysses over 3 ranks) every
MoE layer's router sees the whole sequence; under tensor parallelism the routed experts are expert-sharded
(:class:`~fastdit.parallel.tp_plan.ExpertShard`) and their gathered rows must be the single-process rows. Also: the
ExpertShard style on its own, with unequal per-expert counts, an expert with no token and trailing padding rows.
"""

from __future__ import annotations

import pytest
import torch

import fastdit
from fastdit.testing.distributed import WorkerPool

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-5


def _inputs(masked: bool, side: int = 4) -> dict:
    generator = torch.Generator().manual_seed(0)
    mask = torch.ones(1, 7, dtype=torch.bool)
    mask[:, 5:] = False  # padded text: the joint key mask is reordered under context parallelism
    return {
        "hidden_states": torch.randn(1, side * side, 16, generator=generator),
        "img_shapes": [(1, side, side)],
        "encoder_hidden_states": torch.randn(1, 7, 32, generator=generator),
        "encoder_hidden_states_mask": mask if masked else None,  # the pipeline passes None when no token is padded
        "timestep": torch.tensor([0.7]),
        "return_dict": False,
    }


def _moe_run(rank: int, world_size: int, parallel: dict[str, int] | None, masked: bool = True) -> dict:
    """The tiny transformer's output and, per MoE layer, its router logits, routed rows and output."""
    from fastdit.models.nucleusmoe_image import tiny_transformer

    model = tiny_transformer()
    if parallel is not None:
        fastdit.accelerate(model, parallel=fastdit.Parallel(**parallel))
    seen: dict[str, torch.Tensor] = {}
    handles = []
    for name, module in model.named_modules():
        if type(module).__name__ != "NucleusMoELayer":
            continue
        # Registered after the split: each sees what the model's code receives (the gathered rows under TP). The
        # layer's own output is this rank's shard again under context parallelism: the final output covers it.
        parts = [("logits", module.gate), ("routed", module.experts)]
        if not parallel or parallel.get("tp", 1) > 1:
            parts.append(("out", module))
        for part, sub in parts:
            handles.append(
                sub.register_forward_hook(lambda _m, _a, out, key=f"{name}.{part}": seen.__setitem__(key, out))
            )
    try:
        with torch.no_grad():
            seen["output"] = model(**_inputs(masked))[0]
        return {key: value.detach().clone() for key, value in seen.items()}
    finally:
        for handle in handles:
            handle.remove()
        if parallel is not None:
            fastdit.disable(model)


LAYOUTS = {"ulysses2": {"ulysses": 2}, "ring2": {"ring": 2}, "ulysses3-uneven": {"ulysses": 3}, "tp2": {"tp": 2}}


# Ulysses and TP in the default run; ring and uneven Ulysses (same routing path) in the slow one.
MATRIX = [
    *(
        pytest.param(layout, True, id=name, marks=() if name in ("ulysses2", "tp2") else pytest.mark.slow)
        for name, layout in LAYOUTS.items()
    ),
    pytest.param(LAYOUTS["ring2"], False, id="ring2-no-mask"),
]


@pytest.mark.parametrize(("parallel", "masked"), MATRIX)
def test_routing_and_routed_output_equal_one_process(
    dist2: WorkerPool, dist3: WorkerPool, parallel: dict[str, int], masked: bool
) -> None:
    expected = _moe_run(0, 1, None, masked)
    assert sum(key.endswith(".routed") for key in expected) == 2  # both MoE blocks of the tiny model ran
    pool = dist3 if fastdit.Parallel(**parallel).world_size == 3 else dist2
    for got in pool.run(_moe_run, parallel, masked, timeout=180):
        assert set(got) <= set(expected) and len(got) >= len(expected) - 2
        for key, value in expected.items():
            if key not in got:
                continue
            assert got[key].shape == value.shape, key
            assert (got[key] - value).abs().max() < TOLERANCE, f"{key}: max abs error {(got[key] - value).abs().max()}"
            if key.endswith(".logits"):  # every expert picks the same tokens as on one process
                capacity = max(1, -(-2 * value.shape[1] // value.shape[2]))  # ceil(capacity_factor * S / E)
                picks = [t.transpose(1, 2).topk(capacity, dim=-1).indices.sort(-1).values for t in (got[key], value)]
                assert torch.equal(*picks), key


# --- ExpertShard on its own ---


def _experts_and_call() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    from diffusers.models.transformers.transformer_nucleusmoe_image import SwiGLUExperts

    experts = SwiGLUExperts(hidden_size=8, moe_intermediate_dim=6, num_experts=4)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in experts.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
    counts = torch.tensor([3, 0, 4, 2])  # unequal, one expert without tokens; rank 0 gets 3 rows, rank 1 six
    tokens = torch.randn(int(counts.sum()) + 2, 8, generator=generator)  # + 2 trailing padding rows
    return experts, tokens, counts


def _shard_run(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from fastdit.parallel.tensor_parallel import apply_tensor_parallel
    from fastdit.parallel.tp_plan import ExpertShard, TensorParallelPlan

    experts, tokens, counts = _experts_and_call()
    plan = TensorParallelPlan(layers={"": ExpertShard(parameters=("gate_up_proj", "down_proj"))})
    applied = apply_tensor_parallel(experts, plan, init_device_mesh("cpu", (world_size,)), device=torch.device("cpu"))
    try:
        with torch.no_grad():
            out = experts(tokens, counts)
        return {"out": out, "local_experts": experts.gate_up_proj.shape[0]}
    finally:
        applied.undo()


def test_expert_shard_gathers_the_single_process_rows(dist2: WorkerPool) -> None:
    experts, tokens, counts = _experts_and_call()
    with torch.no_grad():
        expected = experts(tokens, counts)
    for got in dist2.run(_shard_run, timeout=120):
        assert got["local_experts"] == 2
        assert got["out"].shape == expected.shape
        assert torch.equal(got["out"][-2:], torch.zeros(2, 8))  # padding rows stay zeros
        assert (got["out"] - expected).abs().max() < TOLERANCE


def test_expert_shard_refuses_experts_the_degree_does_not_divide() -> None:
    from fastdit.parallel.tp_plan import ExpertShard, TensorParallelPlan, validate_tp_plan

    experts, _, _ = _experts_and_call()
    plan = TensorParallelPlan(layers={"": ExpertShard(parameters=("gate_up_proj", "down_proj"))})
    validate_tp_plan(experts, plan, 2, "test")
    with pytest.raises(ValueError, match=r"gate_up_proj experts = 4 is not divisible by tp=3"):
        validate_tp_plan(experts, plan, 3, "test")
    with pytest.raises(ValueError, match=r"no packed expert parameter 'gate_proj'"):
        validate_tp_plan(experts, TensorParallelPlan(layers={"": ExpertShard(parameters=("gate_proj",))}), 2, "test")
    with pytest.raises(ValueError, match=r"ExpertShard.parameters=\(\)"):
        ExpertShard(parameters=())
