"""The technique list and the context record: one order, checks before anything is touched, undo in reverse."""

from __future__ import annotations

import numpy as np
import pytest

import fastdit
from fastdit.context import context_of
from fastdit.hooks import layers
from fastdit.techniques import TECHNIQUES, technique_names
from fastdit.testing.pipelines import build_tiny, run_tiny


def test_one_documented_order() -> None:
    assert technique_names() == (
        "tensor_parallel",
        "fuse",
        "quantize",
        "attention",
        "context_parallel",
        "input_check",
        "cfg_parallel",
        "cache",
        "offload",
        "compile",
        "cuda_graph",
        "text_encoder_parallel",
        "vae_parallel",
    )
    assert len({t.name for t in TECHNIQUES}) == len(TECHNIQUES)


def _no_fastdit_attributes(module) -> bool:
    return not any(name.startswith("_fastdit") for m in module.modules() for name in vars(m))


def test_context_records_what_was_applied_and_nothing_is_stored_on_modules() -> None:
    pipe, tiny = build_tiny("flux")
    baseline = run_tiny(pipe, tiny, num_inference_steps=3)
    mask = fastdit.StepMask(compute_steps=(0,), policy="static")
    fastdit.accelerate(pipe, cache=fastdit.DBCache(fn=1, bn=0, warmup_steps=0, step_mask=mask))
    context = context_of(pipe)
    assert [(r.technique, r.component) for r in context.records] == [
        ("cache", "transformer"),
        ("cache.runs", "scheduler"),
    ]
    assert _no_fastdit_attributes(pipe.transformer) and not any(k.startswith("_fastdit") for k in vars(pipe))
    cached = run_tiny(pipe, tiny, num_inference_steps=3)
    info = fastdit.summary(pipe).transformers["transformer"]
    assert info["techniques"] == ["cache"] and info["cache"]["num_cached_steps"] == 2
    assert not np.array_equal(cached, baseline)
    fastdit.disable(pipe)
    assert context_of(pipe) is None
    assert all(layers.stack_of(m) is None for m in pipe.transformer.modules())
    np.testing.assert_array_equal(run_tiny(pipe, tiny, num_inference_steps=3), baseline)


def test_checks_run_before_any_module_is_touched() -> None:
    pipe, _ = build_tiny("flux")  # 3 blocks: fn + bn must leave a middle block
    with pytest.raises(ValueError, match="leaves no middle block"):
        fastdit.accelerate(pipe, cache=fastdit.DBCache(fn=2, bn=1))
    assert context_of(pipe) is None and all(layers.stack_of(m) is None for m in pipe.transformer.modules())


def test_a_failing_apply_undoes_what_was_applied(monkeypatch: pytest.MonkeyPatch) -> None:
    import fastdit.compile

    pipe, tiny = build_tiny("flux")
    baseline = run_tiny(pipe, tiny)

    def broken(*args, **kwargs):
        raise RuntimeError("compile failed")

    monkeypatch.setattr(fastdit.compile, "apply_compile", broken)
    with pytest.raises(RuntimeError, match="compile failed"):
        fastdit.accelerate(pipe, cache=fastdit.FBCache(), compile=True)
    assert context_of(pipe) is None and all(layers.stack_of(m) is None for m in pipe.transformer.modules())
    np.testing.assert_array_equal(run_tiny(pipe, tiny), baseline)
