"""The verify ladder in one process: rung selection, layouts by process count, thresholds, and cache rows.

The parallel rungs run on gloo ranks in ``tests/parallel/test_verify_ladder.py``; the command in
``tests/cli/test_verify_cli.py``.
"""

from __future__ import annotations

import functools
import json
import math
from typing import Any

import pytest

import fastdit
from fastdit.diagnostics.verify import (
    CACHE,
    LADDER,
    PARALLEL,
    LadderContext,
    LadderError,
    Rung,
    Skip,
    Status,
    Thresholds,
    VerifyRuntime,
    ladder_names,
    select_rungs,
    verify_ladder,
)
from fastdit.models.registry import get_family
from fastdit.testing.pipelines import build_tiny


@functools.lru_cache(maxsize=2)
def _built(family: str) -> tuple[Any, Any]:
    return build_tiny(family)


def test_selection_keeps_ladder_order_and_expands_groups() -> None:
    assert [r.name for r in select_rungs(None)] == [r.name for r in LADDER]
    assert [r.name for r in select_rungs("tp,cache")] == ["cache", "tp"]
    assert [r.name for r in select_rungs(["cp"])] == ["ulysses", "ring", "usp"]
    assert [r.name for r in select_rungs("hybrid")] == ["ulysses_tp", "usp", "cfg"]
    assert "all" in ladder_names() and "cp" in ladder_names()


def test_unknown_ladder_entry_names_the_known_ones() -> None:
    with pytest.raises(LadderError, match=r"unknown ladder entry 'pp'; known: cache, fuse, ulysses"):
        select_rungs("cache,pp")


def _layout(name: str, world_size: int) -> Any:
    rung = next(r for r in LADDER if r.name == name)
    built = rung.build(LadderContext(world_size, (get_family("flux"),), 2))
    return built if isinstance(built, Skip) else built["parallel"]


def test_layouts_fill_the_world_or_say_what_they_need() -> None:
    assert _layout("ulysses", 1) == Skip("needs 2 processes")
    assert _layout("ulysses", 2) == fastdit.Parallel(ulysses=2)
    assert _layout("ring", 4) == fastdit.Parallel(ring=4)
    assert _layout("tep", 2) == fastdit.Parallel(tp=2, text_encoder=True)
    assert _layout("vaep", 2) == fastdit.Parallel(ulysses=2, vae=True)
    assert _layout("ulysses_tp", 2) == Skip("needs 4 processes")
    assert _layout("ulysses_tp", 8) == fastdit.Parallel(ulysses=2, tp=4)
    assert _layout("usp", 4) == fastdit.Parallel(ulysses=2, ring=2)
    assert _layout("cfg", 2) == fastdit.Parallel(cfg=2)
    assert _layout("cfg", 4) == fastdit.Parallel(cfg=2, ulysses=2)
    assert _layout("cfg", 3) == Skip("needs an even number of processes")


def test_the_fuse_rung_runs_where_the_family_declares_groups() -> None:
    fuse = next(r for r in LADDER if r.name == "fuse")
    assert fuse.build(LadderContext(1, (get_family("flux"),))) == {"fuse": fastdit.Fuse()}
    skipped = fuse.build(LadderContext(1, (get_family("flux"), get_family("joyimage"))))
    assert skipped == Skip("the model family declares no projections that share an input")


def test_component_rungs_ride_on_the_plan_the_family_has() -> None:
    from dataclasses import replace

    vaep = next(r for r in LADDER if r.name == "vaep")
    assert vaep.build(LadderContext(2, (get_family("latte"),)))["parallel"] == fastdit.Parallel(ulysses=2, vae=True)
    without_cp = replace(get_family("latte"), cp_plan=None)
    assert vaep.build(LadderContext(2, (without_cp,)))["parallel"] == fastdit.Parallel(tp=2, vae=True)


@pytest.mark.parametrize(
    ("kind", "psnr", "ssim", "status"),
    [
        (CACHE, 31.0, 0.95, Status.PASS),
        (PARALLEL, 31.0, 0.95, Status.FAIL),  # 35 dB for parallel rows
        (PARALLEL, math.inf, 1.0, Status.PASS),
        (CACHE, 40.0, 0.80, Status.FAIL),
        (CACHE, 33.0, 0.30, Status.GARBLED),  # PSNR fine, structure wrong
        (CACHE, math.nan, 1.0, Status.FAIL),
    ],
)
def test_thresholds(kind: str, psnr: float, ssim: float, status: str) -> None:
    got, reason = Thresholds().judge(kind, psnr, ssim)
    assert got == status and (reason == "") == (status == Status.PASS)


def test_cache_rows_pass_in_one_process_and_parallel_rows_say_they_need_more() -> None:
    pipe, tiny = _built("flux")
    report = verify_ladder(pipe, tiny.call_kwargs, "cache,ulysses,ulysses_tp", VerifyRuntime(world_size=1))
    assert [(r.name, r.status) for r in report.rows] == [
        ("baseline", Status.BASELINE),
        ("cache", Status.PASS),
        ("ulysses", Status.SKIPPED),
        ("ulysses_tp", Status.SKIPPED),
    ]
    assert report.passed and report.rows[2].reason == "needs 2 processes"
    assert fastdit.api.context_of(pipe) is None  # left un-accelerated
    json.dumps(report.to_dict(), allow_nan=False)
    assert report.table().splitlines()[0] == "| Configuration | Latency | PSNR (dB) | SSIM | Peak memory | Result |"


def _served_from_cache(context: LadderContext) -> dict[str, Any]:
    # Random weights never converge: compute step 0 and serve the rest from the cache, which changes the image.
    mask = fastdit.StepMask(compute_steps=(0,), policy="static")
    return {"cache": fastdit.DBCache(fn=1, bn=0, warmup_steps=0, step_mask=mask)}


def _too_short_mask(context: LadderContext) -> dict[str, Any]:
    # Laid out for one step: refused at the run's second step, after accelerate accepted it.
    mask = fastdit.StepMask(compute_steps=(0,), policy="static", num_steps=1)
    return {"cache": fastdit.DBCache(fn=1, bn=0, warmup_steps=0, step_mask=mask)}


def _too_many_blocks(context: LadderContext) -> dict[str, Any]:
    return {"cache": fastdit.DBCache(fn=500)}


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_injected_rungs_fail_error_or_are_unavailable(family: str) -> None:
    pipe, tiny = _built(family)
    rungs = [
        Rung("strict", (), PARALLEL, _served_from_cache),
        Rung("raises", (), CACHE, _too_short_mask),
        Rung("refused", (), CACHE, _too_many_blocks),
    ]
    kwargs = {**tiny.call_kwargs, "num_inference_steps": 3}
    # Random weights change little under a cache: a parallel row's 35 dB would pass it; 80 dB does not.
    runtime = VerifyRuntime(world_size=1, thresholds=Thresholds(parallel_psnr=80.0))
    report = verify_ladder(pipe, kwargs, ["cache", *rungs], runtime)
    statuses = {r.name: r.status for r in report.rows}
    assert statuses == {
        "baseline": Status.BASELINE,
        "cache": Status.PASS,
        "strict": Status.FAIL,
        "raises": Status.ERROR,
        "refused": Status.NOT_AVAILABLE,
    }, report.table()
    assert not report.passed and [r.name for r in report.failures] == ["strict", "raises"]
    assert "PSNR" in report.rows[2].reason and report.rows[2].configuration == "strict (DBCache F1B0, threshold 0.08)"
    assert fastdit.api.context_of(pipe) is None


def test_grid_shows_every_row_that_ran(tmp_path: Any) -> None:
    import numpy as np

    from fastdit.diagnostics.verify import VerifyReport, VerifyRow, save_grid
    from fastdit.io import load_image

    outputs = {"image": np.full((32, 32, 3), 0.5), "video": np.zeros((3, 16, 16, 3)), "latent": np.ones((4, 8, 8))}
    rows = [VerifyRow(name, name, status=Status.PASS, outputs=[output]) for name, output in outputs.items()]
    rows.append(VerifyRow("tp", "tp", status=Status.SKIPPED, reason="needs 2 processes"))
    report = VerifyReport("m", "P", 1, "cpu", {"num_inference_steps": 2}, Thresholds(), rows)
    path = save_grid(report, tmp_path / "grid.png")
    assert load_image(path).shape[1] > load_image(path).shape[0]  # one line of three tiles


def test_an_exact_threshold_fails_a_parallel_row_a_psnr_minimum_lets_through() -> None:
    exact = Thresholds(max_abs=1e-4)
    assert exact.judge(PARALLEL, 70.0, 0.999, 5e-5) == (Status.PASS, "")
    status, reason = exact.judge(PARALLEL, 70.0, 0.999, 2e-4)
    assert status == Status.FAIL and reason == "max abs error 2.00e-04 >= 0.0001"
    assert exact.judge(CACHE, 40.0, 0.99, 0.5)[0] == Status.PASS  # caches approximate: PSNR and SSIM judge them
    with pytest.raises(ValueError, match=r"Thresholds.max_abs must be > 0 or None, got 0"):
        Thresholds(max_abs=0)


def test_a_rung_with_a_reference_is_judged_against_it_steps_served_included() -> None:
    from fastdit.diagnostics.family_ladder import forced_cache
    from fastdit.diagnostics.verify import fixed_rung

    pipe, tiny = _built("flux")
    kwargs = {**tiny.call_kwargs, "num_inference_steps": 3}
    rungs = [
        fixed_rung("same", {"cache": forced_cache(0)}, reference={"cache": forced_cache(0)}),
        # Threshold 0 computes every step: the forced cache serves 2 of 3 and changes the output.
        fixed_rung("other", {"cache": forced_cache(0)}, reference={"cache": fastdit.DBCache(fn=1, threshold=0.0)}),
    ]
    report = verify_ladder(pipe, kwargs, rungs, VerifyRuntime(world_size=1, thresholds=Thresholds(max_abs=1e-4)))
    same, other = report.rows[1:]
    assert same.status == Status.PASS and same.max_abs == 0.0 and same.cached_steps == 2, report.table()
    assert other.status == Status.FAIL and "served 2 steps from the cache, its one-process reference 0" in other.reason
    with pytest.raises(ValueError, match=r"fixed_rung 'x': reference runs on one process"):
        fixed_rung("x", {}, reference={"parallel": fastdit.Parallel(ulysses=2)})


def _served(**branches: tuple[int, list[int]]) -> Any:
    """A run whose transformer's cache branches ran ``steps`` and served ``cached_steps``."""
    from fastdit.bench.timing import RunResult

    stats = {name.replace("_", "/"): {"steps": n, "cached_steps": c} for name, (n, c) in branches.items()}
    return RunResult(summary=fastdit.Summary(transformers={"transformer": {"cache": {"branches": stats}}}))


def test_a_cfg_rank_is_judged_branch_by_branch_against_one_process() -> None:
    from fastdit.diagnostics.verify import _branch_mismatch

    one = _served(cond=(5, [1, 2, 4]), uncond=(5, [1, 4]))
    # Rank 1 runs "uncond" at every step and "cond" only in the warm-up pair of step 0.
    assert _branch_mismatch(_served(cond=(1, []), uncond=(5, [1, 4])), one) == ""
    # An unannounced pipeline: one process names the step's calls by order, CFG parallelism announces them.
    assert _branch_mismatch(_served(cond=(5, [1, 2, 4])), _served(default=(5, [1, 2, 4]), default_1=(5, [2]))) == ""
    assert _branch_mismatch(_served(uncond=(5, [2])), _served(default=(5, [1, 2, 4]), default_1=(5, [2]))) == ""
    assert "branch 'uncond' served steps [1, 2, 4] from the cache, the same branch on one process [1, 4]" in (
        _branch_mismatch(_served(cond=(1, []), uncond=(5, [1, 2, 4])), one)
    )
    assert "branch 'other' the one-process reference does not have" in _branch_mismatch(_served(other=(5, [])), one)


def test_check_disable_fails_a_rung_that_leaves_the_pipeline_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    from fastdit.diagnostics.family_ladder import forced_cache
    from fastdit.diagnostics.verify import fixed_rung
    from fastdit.session import Session

    pipe, tiny = _built("flux")
    kwargs = {**tiny.call_kwargs, "num_inference_steps": 3}
    runtime = VerifyRuntime(world_size=1, check_disable=True)
    rung = fixed_rung("cache", {"cache": forced_cache(0)}, reference={"cache": forced_cache(0)})
    assert verify_ladder(pipe, kwargs, [rung], runtime).passed
    disable, calls = Session.disable, []

    def leaky_disable(self: Session) -> None:  # removes the reference's cache, leaves the rung's on
        calls.append(1)
        if len(calls) == 1:
            disable(self)

    monkeypatch.setattr(Session, "disable", leaky_disable)
    try:
        row = verify_ladder(pipe, kwargs, [rung], runtime).rows[1]
    finally:
        fastdit.disable(pipe)
    assert row.status == Status.FAIL and "after disable the output differs from the baseline" in row.reason


def test_audio_rows_are_judged_on_waveforms_and_spectrograms(tmp_path: Any) -> None:
    """An audio pipeline: outputs are unclipped (channels, samples) waveforms; rows carry waveform PSNR and SNR and
    the spectral SSIM; a cache that serves steps lowers them; the grid shows spectrograms."""
    import numpy as np

    from fastdit.diagnostics.verify import save_grid

    pipe, tiny = _built("longcat_audio_dit")
    rungs = ["cache", Rung("served", (), CACHE, _served_from_cache)]
    report = verify_ladder(pipe, tiny.call_kwargs, rungs, VerifyRuntime(world_size=1))
    assert report.output_kind == "audio" and report.to_dict()["output_kind"] == "audio"
    baseline, cache, served = report.rows
    (output,) = baseline.outputs
    assert output.ndim == 2 and output.shape[0] == 1 and np.abs(output).max() > 1.0  # mono, not clipped to [0, 1]
    assert output.min() < 0.0
    assert cache.status == Status.PASS and cache.snr == math.inf and cache.ssim == pytest.approx(1.0)
    assert served.cached_steps and served.snr < math.inf and served.ssim is not None and served.ssim < 1.0
    assert served.to_dict()["snr_min"] == served.snr_min
    path = save_grid(report, tmp_path / "grid.png")
    assert path.exists()
