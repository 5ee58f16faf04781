"""MagCache on a pipeline of two denoisers (Wan 2.2's experts): one calibration per denoiser, recorded in one run,
applied to each denoiser over the steps it serves, stored in calibration and cache files."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import fastdit
from fastdit.cache.files import CacheFile, load_cache_file, save_cache_file
from fastdit.cache.magcache import load_calibration, save_calibration
from fastdit.calibration import calibrate
from fastdit.errors import FieldError
from fastdit.testing.pipelines import build_tiny, run_accelerated, run_tiny

DENOISERS = ("transformer", "transformer_2")


@pytest.fixture(scope="module")
def wan22():
    # 4 steps, boundary between the second and the third: two steps per expert, true CFG in each.
    return build_tiny("wan", "wan2.2-t2v")


@pytest.fixture(scope="module")
def calibration(wan22) -> fastdit.MagCalibrations:
    pipe, tiny = wan22
    return calibrate(pipe, lambda: run_tiny(pipe, tiny))


def _one(steps: int, ratio: float = 1.0, **fields) -> fastdit.MagCalibration:
    return fastdit.MagCalibration(branches=("cond",), ratios=((ratio,) * steps,), num_steps=steps, **fields)


def test_calibration_run_is_bit_identical_and_records_each_denoisers_steps(wan22, calibration) -> None:
    pipe, tiny = wan22
    baseline = run_tiny(pipe, tiny)
    fastdit.accelerate(pipe, cache=fastdit.MagCache(calibrate=True))
    try:
        out = run_tiny(pipe, tiny)
        assert fastdit.summary(pipe).num_cached_steps == 0
    finally:
        fastdit.disable(pipe)
    np.testing.assert_array_equal(out, baseline)
    assert isinstance(calibration, fastdit.MagCalibrations)
    assert calibration.components == DENOISERS and calibration.num_steps == 4
    for one in calibration.calibrations:  # each expert served two steps, both CFG branches
        assert one.num_steps == 2 and one.branches == ("cond", "uncond") and all(r[0] == 1.0 for r in one.ratios)
    # The experts have their own weights, so their magnitudes differ.
    assert calibration.calibrations[0].ratios != calibration.calibrations[1].ratios
    # Reading one component still gives one calibration, as for a pipeline of one denoiser.
    only = calibrate(pipe, lambda: run_tiny(pipe, tiny), component="transformer_2")
    assert only == calibration.for_component("transformer_2")


def test_forced_skipping_skips_the_expected_steps_of_each_denoiser(wan22, calibration) -> None:
    pipe, tiny = wan22
    config = fastdit.MagCache(threshold=1e6, max_skip_steps=100, retention_ratio=0.0, calibration=calibration)
    out, transformers = run_accelerated(pipe, tiny, {"cache": config})
    assert np.isfinite(out).all()
    assert set(transformers) == set(DENOISERS)
    blocks = len(pipe.transformer.blocks)
    for name, info in transformers.items():
        for branch, b in info["cache"]["branches"].items():
            # Each expert counts its own steps: its first computes (nothing cached yet), its second is skipped.
            assert (b["steps"], b["cached_steps"], b["blocks_computed"]) == (2, [1], blocks), (name, branch)


def test_a_calibration_that_does_not_fit_the_denoisers_is_refused_before_anything_is_installed(
    wan22, calibration
) -> None:
    pipe, _ = wan22
    renamed = fastdit.MagCalibrations(
        components=("transformer", "transformer_3"), calibrations=calibration.calibrations, num_steps=4
    )
    with pytest.raises(FieldError, match=r"denoisers are \('transformer', 'transformer_2'\)") as caught:
        fastdit.accelerate(pipe, cache=fastdit.MagCache(threshold=0.3, calibration=renamed))
    assert (caught.value.owner, caught.value.field) == ("MagCalibrations", "components")
    with pytest.raises(FieldError, match="needs one calibration per denoiser") as caught:
        fastdit.accelerate(pipe, cache=fastdit.MagCache(threshold=0.3, calibration=calibration.calibrations[0]))
    assert (caught.value.owner, caught.value.field) == ("MagCache", "calibration")
    assert fastdit.api.context_of(pipe) is None
    with pytest.raises(FieldError, match="'transformer_3' was not calibrated"):
        calibration.for_component("transformer_3")


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"components": ("a", "a")}, "components"),
        ({"components": ("a",)}, "components"),  # one name for two calibrations
        ({"calibrations": (_one(2), _one(2, fn=1))}, "calibrations"),  # two layouts
        ({"num_steps": 1}, "num_steps"),  # shorter than a denoiser's own steps
    ],
)
def test_calibrations_refuse_bad_fields(fields: dict, field: str) -> None:
    values = {"components": ("a", "b"), "calibrations": (_one(2), _one(2)), "num_steps": 4, **fields}
    with pytest.raises(FieldError) as caught:
        fastdit.MagCalibrations(**values)
    assert caught.value.owner == "MagCalibrations" and caught.value.field == field


def test_calibration_and_cache_files_round_trip(tmp_path, calibration) -> None:
    path = save_calibration(calibration, tmp_path / "wan22.json")
    loaded = load_calibration(path, num_steps=4)  # the file keeps 6 decimals
    assert (loaded.components, loaded.num_steps) == (calibration.components, 4)
    for read, recorded in zip(loaded.calibrations, calibration.calibrations, strict=True):
        assert read.branches == recorded.branches and np.allclose(read.ratios, recorded.ratios, atol=1e-6)
    assert load_calibration(save_calibration(loaded, tmp_path / "again.json")) == loaded
    with pytest.raises(FieldError, match="recorded on a run of 4 steps") as caught:
        load_calibration(path, num_steps=8)
    assert (caught.value.owner, caught.value.field) == ("MagCalibrations", "num_steps")
    single = save_calibration(_one(3), tmp_path / "one.json")  # one denoiser: the file and type as before
    assert load_calibration(single) == _one(3)
    config = fastdit.MagCache(threshold=0.3, calibration=calibration)
    cache_path = save_cache_file(tmp_path / "cache.json", CacheFile(config, "wan22", 4))
    assert load_cache_file(cache_path, num_steps=4).config == config


def test_the_calibrate_search_includes_magcache_on_two_denoisers(wan22) -> None:
    """What ``fastdit calibrate`` runs: the calibration of every denoiser, then MagCache ladders on it."""
    from fastdit.bench.calibrate import Target, calibrate_cache, ladders
    from fastdit.bench.heldout import Split, SplitBench, transformer_blocks
    from fastdit.cli.calibrate import _magcache_calibration
    from fastdit.session import ModelSource, Session

    pipe, tiny = wan22
    session = Session(pipe, ModelSource(name="tiny", pipeline_class="diffusers.WanPipeline"), "cpu")
    split = Split(prompts=(tiny.call_kwargs["prompt"],), calibration_seeds=(0,), heldout_seeds=(1,))
    kwargs = {k: v for k, v in tiny.call_kwargs.items() if k != "prompt"}
    found = _magcache_calibration(session, SimpleNamespace(split=split, kwargs=kwargs))
    assert isinstance(found, fastdit.MagCalibrations) and found.components == DENOISERS
    bench = SplitBench(session, split, kwargs, transformer_blocks(session), batch=1)
    try:
        result = calibrate_cache(bench, Target(speedup=1.3), ladders(["magcache"], 4, found)[:1])
    finally:
        bench.close()
    assert result.chosen is not None and isinstance(result.chosen[1], fastdit.MagCache)
    assert result.chosen[1].calibration == found
    assert result.heldout is not None and result.heldout.blocks_computed_fraction <= 1 / 1.3
