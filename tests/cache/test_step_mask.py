"""A step mask knows the run it was laid out for: a longer run is refused, never silently cached past the mask."""

from __future__ import annotations

import pytest
import torch

import fastdit
from fastdit.components import walk
from fastdit.errors import FieldError, FieldsError
from fastdit.models.registry import get_family
from fastdit.testing.pipelines import build_tiny, run_tiny, scaled_steps
from tests.cache.toy_dit import TOY_ADAPTER, ToyDiT, sample


def _cache(mask: fastdit.StepMask) -> fastdit.DBCache:
    return fastdit.DBCache(fn=1, bn=0, warmup_steps=0, step_mask=mask)


def _count_calls(module: torch.nn.Module) -> list[int]:
    """One entry per call of ``module`` that ran to its end."""
    calls: list[int] = []
    module.register_forward_hook(lambda *_: calls.append(1))
    return calls


def test_preset_records_the_steps_it_was_laid_out_for() -> None:
    mask = fastdit.StepMask.preset("fast", 28)
    assert mask.num_steps == 28 and max(mask.compute_steps) == 27
    assert fastdit.StepMask(compute_steps=(0, 3)).num_steps is None  # a hand-written mask: any run length


def test_compute_steps_beyond_num_steps_are_refused() -> None:
    with pytest.raises(FieldsError, match=r"StepMask\(compute_steps=\(0, 30\), num_steps=28\)") as info:
        fastdit.StepMask(compute_steps=(0, 30), num_steps=28)
    assert info.value.fields == {"compute_steps": (0, 30), "num_steps": 28}


def test_a_pipeline_run_longer_than_the_mask_is_refused_before_its_first_step() -> None:
    """The scheduler's timesteps tell the run's length: nothing is computed with a mask that does not cover it."""
    pipe, tiny = build_tiny("flux")
    calls = _count_calls(pipe.transformer)
    fastdit.accelerate(pipe, cache=_cache(fastdit.StepMask.preset("fast", 4)))
    try:
        with pytest.raises(FieldError, match=r"StepMask.num_steps=4: .*this run has 6 steps") as info:
            run_tiny(pipe, tiny, num_inference_steps=6)
        assert (info.value.owner, info.value.field) == ("StepMask", "num_steps")
        assert calls == []  # refused at the first transformer call, before the model ran
        run_tiny(pipe, tiny, num_inference_steps=4)  # the run the mask was made for still works afterwards
        assert len(calls) == 4
    finally:
        fastdit.disable(pipe)


def test_a_loop_without_a_scheduler_is_refused_at_the_first_step_beyond_the_mask() -> None:
    """A third-party sampler gives no run length up front: the step counter refuses step ``num_steps``."""
    torch.manual_seed(0)
    model = ToyDiT().eval()
    calls = _count_calls(model.layers[0])
    mask = fastdit.StepMask(compute_steps=(0, 2), policy="static", num_steps=3)
    fastdit.accelerate(model, cache=_cache(mask), adapter=TOY_ADAPTER)
    try:
        sample(model, steps=3)  # exactly the mask's run
        assert len(calls) == 3
        with pytest.raises(FieldError, match=r"StepMask.num_steps=3: .*this run has more than 3 steps"):
            sample(model, steps=5)
        assert len(calls) == 6  # steps 0-2 of the second run computed block 0; step 3 never ran
    finally:
        fastdit.disable(model)


def test_a_mask_without_num_steps_keeps_its_meaning_beyond_its_steps() -> None:
    """Documented behaviour: a static mask without num_steps caches every step it does not list, however many."""
    torch.manual_seed(0)
    model = ToyDiT().eval()
    mask = fastdit.StepMask(compute_steps=(0, 2), policy="static")
    fastdit.accelerate(model, cache=_cache(mask), adapter=TOY_ADAPTER)
    try:
        sample(model, steps=6)
        (branch,) = fastdit.summary(model).transformers["transformer"]["cache"]["branches"].values()
    finally:
        fastdit.disable(model)
    assert branch["cached_steps"] == [1, 3, 4, 5]


_GRID_POINT_COUNTS = {"minimax_h3"}


def _families() -> list[str]:
    from fastdit.models.registry import all_adapters

    return [adapter.family for adapter in all_adapters() if adapter.tiny_pipelines]


@pytest.mark.parametrize("family", _families())
def test_every_family_runs_its_mask_and_refuses_a_longer_run_up_front(family: str) -> None:
    """The scheduler's count never exceeds the real one (a run the mask fits is never refused) and tells every
    family's longer run before its first transformer call."""
    pipe, tiny = build_tiny(family)
    requested = tiny.call_kwargs.get("num_inference_steps", 2)
    # MiniMax-H3's scheduler counts sigma grid points, the terminal 0 included: N of them are N - 1 steps.
    grid = 1 if family in _GRID_POINT_COUNTS else 0
    steps = requested - grid
    if "num_inference_steps" not in tiny.call_kwargs and "sigmas" in tiny.call_kwargs:  # a sigma schedule's steps
        steps = len(tiny.call_kwargs["sigmas"]) - 1

    def steps_of(count: int) -> dict:
        if "sigmas" in tiny.call_kwargs:
            return scaled_steps(tiny, count, steps)
        return {"num_inference_steps": count + grid}

    # The denoiser named transformer (Ideogram 4 has two), else the pipeline's one denoiser (DreamLite's unet).
    named = (m for name, m in pipe.components.items() if name.startswith("transformer") and m is not None)
    transformer = next(named, None) or walk(pipe).denoisers[0].module
    calls = _count_calls(transformer)
    fastdit.accelerate(pipe, cache=_cache(fastdit.StepMask.preset("fast", steps)))
    # A run's length is known up front from the scheduler's timesteps when one denoiser runs the whole schedule;
    # with several (Ideogram 4's conditional and unconditional transformers) or a sampler without a diffusers
    # scheduler (FLUX.3's), the step counter refuses the first step past the mask instead.
    scheduler = getattr(pipe, "scheduler", None)
    up_front = len(walk(pipe).denoisers) == 1 and callable(getattr(scheduler, "set_timesteps", None))
    length = f"{steps + 1} steps" if up_front else f"more than {steps} steps"
    try:
        run_tiny(pipe, tiny, **steps_of(steps))
        done = len(calls)
        with pytest.raises(FieldError, match=rf"StepMask.num_steps={steps}: .*this run has {length}"):
            run_tiny(pipe, tiny, **steps_of(steps + 1))
    finally:
        fastdit.disable(pipe)
    # A family's unstepped calls (SANA-WM's refiner captures its attention sink at timestep 0 first, Wan-Animate-2
    # runs its reference pass) are no steps: they may run before the refused first step.
    assert done >= steps and (len(calls) == done or not up_front or bool(get_family(family).unstepped_calls))


def test_a_schedule_listing_a_timestep_it_never_runs_is_not_refused() -> None:
    """Sana Sprint's SCM schedule has 3 timesteps for 2 steps (the last is never called): a 2-step mask fits."""
    pipe, tiny = build_tiny("sana", "sprint")
    fastdit.accelerate(pipe, cache=_cache(fastdit.StepMask.preset("fast", 2)))
    try:
        run_tiny(pipe, tiny, num_inference_steps=2)
    finally:
        fastdit.disable(pipe)
