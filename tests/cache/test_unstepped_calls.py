"""``ModelAdapter.unstepped_calls``: a call that is no denoising step (a reference pass filling a KV cache, at the
first step's timestep) computes every block and is not counted as a step, branch or run."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fastdit
from fastdit.models.validate import AdapterError, check_adapter
from tests.cache.toy_dit import TOY_ADAPTER, ToyDiT


class ToyReferenceDiT(ToyDiT):
    """A ToyDiT whose ``mode="extract"`` calls store the block outputs that the step calls add back."""

    def forward(self, sample: torch.Tensor, t: torch.Tensor, mode: str = "step") -> torch.Tensor:
        out = super().forward(sample, t)
        if mode == "extract":
            self.reference = out
            return out
        return out + 0.1 * self.reference


ADAPTER = dataclasses.replace(
    TOY_ADAPTER,
    transformer_classes=(f"{ToyReferenceDiT.__module__}.ToyReferenceDiT",),
    unstepped_calls={"mode": ("extract",)},
)
STEPS = 4


def _sample(model: ToyReferenceDiT) -> torch.Tensor:
    """Per run: one reference pass at the first step's timestep, then Euler steps."""
    x = torch.randn(2, 8, 4, generator=torch.Generator().manual_seed(0))
    ts = torch.linspace(1.0, 0.0, STEPS + 1)
    with torch.no_grad():
        model(torch.ones_like(x), ts[0].expand(2), mode="extract")
        for i in range(STEPS):
            x = x + (ts[i + 1] - ts[i]) * model(x, ts[i].expand(2))
    return x


def _accelerated(model: ToyReferenceDiT, adapter, mask: fastdit.StepMask | None) -> tuple[torch.Tensor, dict, list]:
    calls: list[int] = []
    handles = [block.register_forward_pre_hook(lambda *_, i=i: calls.append(i)) for i, block in
               enumerate(model.layers)]  # fmt: skip
    cache = fastdit.DBCache(fn=1, bn=1, warmup_steps=0, threshold=0.0 if mask is None else 0.1, step_mask=mask)
    fastdit.accelerate(model, cache=cache, adapter=adapter)
    try:
        out = _sample(model)
        return out, fastdit.summary(model), calls
    finally:
        fastdit.disable(model)
        for handle in handles:
            handle.remove()


def test_reference_pass_is_computed_and_not_a_step() -> None:
    torch.manual_seed(0)
    model = ToyReferenceDiT().eval()
    baseline = _sample(model)
    out, _, _ = _accelerated(model, ADAPTER, None)
    assert torch.equal(out, baseline)  # threshold 0: bit-identical, the reference pass included
    mask = fastdit.StepMask(compute_steps=(0,), policy="static")
    _, stats, calls = _accelerated(model, ADAPTER, mask)
    (info,) = stats.transformers.values()
    (branch,) = info["cache"]["branches"].values()
    assert branch["steps"] == STEPS and branch["cached_steps"] == list(range(1, STEPS))
    depth = len(model.layers)
    assert calls[:depth] == list(range(depth))  # the reference pass ran every block


def test_without_the_declaration_the_reference_pass_reads_as_a_branch() -> None:
    """The same sampler with the plain adapter: the reference call shares step 0's timestep and becomes a second
    branch, so the cache statistics differ (what the declaration prevents)."""
    torch.manual_seed(0)
    model = ToyReferenceDiT().eval()
    plain = dataclasses.replace(ADAPTER, unstepped_calls={})
    _, stats, _ = _accelerated(model, plain, fastdit.StepMask(compute_steps=(0,), policy="static"))
    (info,) = stats.transformers.values()
    assert len(info["cache"]["branches"]) == 2


def test_unstepped_argument_must_be_a_forward_parameter() -> None:
    with pytest.raises(AdapterError, match="unstepped_calls names 'kv_mode'"):
        check_adapter(ToyReferenceDiT(), dataclasses.replace(ADAPTER, unstepped_calls={"kv_mode": ("extract",)}))


class ToyFlagDiT(ToyReferenceDiT):
    """The same reference pass, marked by an entry of a ``dict`` argument (AnyFlow-FAR's ``kv_cache_flag``)."""

    def forward(self, sample: torch.Tensor, t: torch.Tensor, flag: dict | None = None) -> torch.Tensor:
        return super().forward(sample, t, mode="extract" if (flag or {}).get("is_cache_step") else "step")


def test_a_dict_mark_matches_a_dict_argument_holding_its_entries() -> None:
    """``{"flag": ({"is_cache_step": True},)}`` marks calls whose ``flag`` holds that entry, whatever else it holds."""
    adapter = dataclasses.replace(
        ADAPTER,
        transformer_classes=(f"{ToyFlagDiT.__module__}.ToyFlagDiT",),
        unstepped_calls={"flag": ({"is_cache_step": True},)},
    )
    torch.manual_seed(0)
    model = ToyFlagDiT().eval()
    mask = fastdit.StepMask(compute_steps=(0,), policy="static")
    cache = fastdit.DBCache(fn=1, bn=1, warmup_steps=0, step_mask=mask)
    fastdit.accelerate(model, cache=cache, adapter=adapter)
    try:
        x = torch.randn(2, 8, 4, generator=torch.Generator().manual_seed(0))
        ts = torch.linspace(1.0, 0.0, STEPS + 1)
        with torch.no_grad():
            model(torch.ones_like(x), ts[0].expand(2), flag={"is_cache_step": True, "num_cached_chunks": 3})
            for i in range(STEPS):
                x = x + (ts[i + 1] - ts[i]) * model(x, ts[i].expand(2), flag={"is_cache_step": False})
        (info,) = fastdit.summary(model).transformers.values()
    finally:
        fastdit.disable(model)
    (branch,) = info["cache"]["branches"].values()  # the marked call is no second branch
    assert branch["steps"] == STEPS and branch["cached_steps"] == list(range(1, STEPS))
