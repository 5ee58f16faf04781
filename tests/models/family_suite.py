"""Capability tests every family file gets by subclassing :class:`FamilySuite` (set ``family``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

import fastdit
from fastdit.attrs import expand_path, is_pattern, resolve_attr
from fastdit.errors import FieldError
from fastdit.fuse import declared_form, expand_group
from fastdit.models.registry import get_family
from fastdit.models.validate import check_adapter, probe_patterns
from fastdit.parallel.attention.dispatch import processor_sites
from fastdit.session import is_audio_pipeline
from fastdit.testing.pipelines import build_tiny, run_accelerated, run_tiny

_BUILT: dict = {}


def _variants(family: str) -> list[str]:
    return [t.name for t in get_family(family).tiny_pipelines]


class FamilySuite:
    """Subclass with ``family = "<name>"``; tests run once per tiny pipeline variant of the family."""

    family: str = ""

    @pytest.fixture
    def built(self) -> dict:
        # One build per variant per module: building is the slow part of a tiny run.
        return _BUILT

    def _pipe(self, built: dict, variant: str):
        key = (self.family, variant)
        if key not in built:
            # Keep one family's pipelines in memory at a time, all of its variants: its tests run function by
            # function, each over every variant, so a cache of one pipeline would rebuild each variant per test.
            if any(family != self.family for family, _ in built):
                built.clear()
            built[key] = build_tiny(self.family, variant)
        return built[key]

    def test_adapter_matches_transformer(self, built: dict, variant: str) -> None:
        pipe, _ = self._pipe(built, variant)
        adapter = get_family(self.family)
        for transformer in _transformers(pipe, adapter):
            check_adapter(transformer, adapter)

    def test_runs_two_steps(self, built: dict, variant: str) -> None:
        """Two steps end in one image, video or waveform, in range, and what the denoiser produced depends on the
        seed."""
        pipe, tiny = self._pipe(built, variant)
        out = run_tiny(pipe, tiny)
        decoded = tiny.call_kwargs.get("output_type", "np") == "np"  # some variants stop at latents
        if out.ndim == 3 or is_audio_pipeline(type(pipe)):  # (1, channels, samples): waveforms, as returned
            assert out.ndim == 3 and out.shape[0] == 1 and out.size > 0, out.shape
            assert np.isfinite(out).all()
        else:
            assert out.ndim in (4, 5) and out.shape[0] == 1 and out.size > 0, out.shape  # (1, [frames,] H, W, C)
            assert np.isfinite(out).all()
            if decoded:
                assert out.shape[-1] in (3, 4), out.shape
                assert out.min() >= 0.0 and out.max() <= 1.0, (out.min(), out.max())
        # Compared as latents: a tiny random-weight VAE can decode every input to one flat colour, which would hide
        # a run that ignores its noise, and with it every comparison the other tests make.
        latents = [run_tiny(pipe, tiny, seed=seed, output_type="latent") for seed in (0, 1)]
        assert latents[0].shape == latents[1].shape
        assert not np.array_equal(*latents), "seeds 0 and 1 gave the same result: the noise does not reach it"

    def test_block_patterns_probe(self, built: dict, variant: str) -> None:
        pipe, tiny = self._pipe(built, variant)
        adapter = get_family(self.family)
        for transformer in _transformers(pipe, adapter):
            probe_patterns(transformer, adapter, lambda: run_tiny(pipe, tiny)).raise_if_failed()

    def test_cache_threshold_zero_is_bit_identical(self, built: dict, variant: str) -> None:
        """DBCache at threshold 0, MagCache at threshold 0 (``fn=0``: every block skippable) and DBCache at
        threshold 0 over streamed blocks (offload beneath the cache) leave the output bit-identical, and disable
        restores the original. The family's first pipeline also runs a TeaCache calibration (every step computes
        while the first block's input is measured; once per family, to keep the default run short)."""
        pipe, tiny = self._pipe(built, variant)
        baseline = run_tiny(pipe, tiny)
        own_forward = _instance_forwards(pipe)
        exact = fastdit.DBCache(fn=1, bn=1, threshold=0.0, warmup_steps=0)
        configurations = [
            ("DBCache", {"cache": exact}),
            ("MagCache", {"cache": fastdit.MagCache(threshold=0.0)}),
            ("DBCache+Offload", {"cache": exact, "offload": fastdit.Offload()}),
        ]
        if variant == _variants(self.family)[0]:
            configurations.append(("TeaCache calibration", {"cache": fastdit.TeaCache(calibrate=True)}))
            if get_family(self.family).latent is not None:  # the spectral signal reads the declared latent
                spectral = fastdit.TeaCache(calibrate=True, signal="spectral")
                configurations.append(("TeaCache spectral calibration", {"cache": spectral}))
        for name, options in configurations:
            fastdit.accelerate(pipe, **options)
            try:
                cached = run_tiny(pipe, tiny)
                stats = fastdit.summary(pipe)
            finally:
                fastdit.disable(pipe)
            assert stats.num_cached_steps == 0, name
            np.testing.assert_array_equal(cached, baseline, err_msg=name)
            _assert_step_invariant_served(stats, name)
            if "offload" in options:  # every block call brought its weights in
                assert all(info["offload"]["transfers"] > 0 for info in stats.transformers.values()), name
        np.testing.assert_array_equal(run_tiny(pipe, tiny), baseline)  # disable restores the original
        # Nothing left behind: an instance ``forward`` would hide a later class-level patch of the model.
        assert _instance_forwards(pipe) == own_forward

    def test_cache_forced_schedule_skips_expected_steps(self, built: dict, variant: str) -> None:
        pipe, tiny = self._pipe(built, variant)
        mask = fastdit.StepMask(compute_steps=(0,), policy="static")
        fastdit.accelerate(pipe, cache=fastdit.DBCache(fn=1, bn=1, warmup_steps=0, step_mask=mask))
        try:
            out = run_tiny(pipe, tiny)
            stats = fastdit.summary(pipe)
        finally:
            fastdit.disable(pipe)
        assert np.isfinite(out).all()
        multi_step = [b for info in stats.transformers.values() for b in info["cache"]["branches"].values()]
        assert any(b["steps"] > 1 for b in multi_step), "no branch ran two steps: the schedule was not exercised"
        assert stats.num_cached_steps > 0
        for name, info in stats.transformers.items():
            for branch, b in info["cache"]["branches"].items():
                assert b["cached_steps"] == list(range(1, b["steps"])), (name, branch)

    @pytest.mark.slow
    def test_magcache_calibrated_steps_skip_every_block(self, built: dict, variant: str) -> None:
        """Calibrated MagCache with ``fn=0``: the calibration run computes every step (bit-identical), then every
        step after a denoiser's first reuses the residual of the whole block stack and the output stays finite.
        A pipeline of several denoisers (Wan 2.2's experts) calibrates each one over the steps it serves."""
        from fastdit.calibration import calibrate

        pipe, tiny = self._pipe(built, variant)
        denoisers = list(fastdit.api.find_transformers(pipe))
        calibration = calibrate(pipe, lambda: run_tiny(pipe, tiny))
        if len(denoisers) > 1:
            assert isinstance(calibration, fastdit.MagCalibrations), denoisers
            assert set(calibration.components) == set(denoisers)
        config = fastdit.MagCache(threshold=1e6, max_skip_steps=100, retention_ratio=0.0, calibration=calibration)
        out, transformers = run_accelerated(pipe, tiny, {"cache": config})
        assert np.isfinite(out).all()
        branches = {(d, n): b for d in denoisers for n, b in transformers[d]["cache"]["branches"].items()}
        assert any(b["steps"] > 1 for b in branches.values()), "no branch ran two steps: nothing was skipped"
        for name, b in branches.items():
            assert b["cached_steps"] == list(range(1, b["steps"])), name
            # Only the first step computed: at most a step's blocks in all (Wan-Animate-2's unconditional branch
            # skips block 9 itself, so it computes one fewer than the blocks counted per step).
            assert 0 < b["blocks_computed"] <= b["blocks_total"] // b["steps"], name

    @pytest.mark.slow
    @pytest.mark.parametrize("signal", ["input", "spectral"])
    def test_teacache_forced_schedule_skips_every_block(self, built: dict, variant: str, signal: str) -> None:
        """TeaCache with ``fn=0`` and a threshold no change reaches: the first block's input (or, with the spectral
        signal, the latent the family declares) is measured before it runs, every step after the first reuses the
        residual of the whole block stack, and the output stays finite. A family that declares no latent refuses
        the spectral signal before anything is installed."""
        pipe, tiny = self._pipe(built, variant)
        settings = {"threshold": 1e6, "max_skip_steps": 100, "retention_ratio": 0.0, "final_steps": 0}
        if signal == "spectral":
            config = fastdit.TeaCache(signal="spectral", **settings)
            if get_family(self.family).latent is None:
                with pytest.raises(FieldError, match="declares no latent"):
                    fastdit.accelerate(pipe, cache=config)
                assert fastdit.api.context_of(pipe) is None
                return
        else:
            config = fastdit.TeaCache(calibration=fastdit.TeaCalibration(coefficients=(1.0, 0.0)), **settings)
        fastdit.accelerate(pipe, cache=config)
        try:
            out = run_tiny(pipe, tiny)
            stats = fastdit.summary(pipe)
        finally:
            fastdit.disable(pipe)
        assert np.isfinite(out).all()
        branches = [b for info in stats.transformers.values() for b in info["cache"]["branches"].values()]
        assert any(b["steps"] > 1 for b in branches), "no branch ran two steps: nothing was skipped"
        for b in branches:
            assert b["cached_steps"] == list(range(1, b["steps"])), b
            assert 0 < b["blocks_computed"] <= b["blocks_total"] // b["steps"], b

    # Groups a traced call finds that the family leaves undeclared (set by a family's test, which says why).
    fused_left_out: tuple[tuple[str, ...], ...] = ()

    def test_fused_projections(self, built: dict, variant: str) -> None:
        """The family declares the projections its blocks apply to one tensor, as a traced call finds them; fused,
        every member is served by its group's matmul (no recomputation), the output stays within float32 rounding,
        and disable gives the baseline back bit for bit. A family that declares none has fusion refused."""
        pipe, tiny = self._pipe(built, variant)
        adapter = get_family(self.family)
        left_out = {frozenset(g) for g in self.fused_left_out}
        for transformer in _transformers(pipe, adapter):
            declared = _declared_groups(transformer, adapter.fused_projections)
            found = declared_form(transformer, adapter.block_groups, lambda: run_tiny(pipe, tiny))
            for path, groups in found.items():
                missing = {g for g in groups if frozenset(g) not in declared.get(path, set()) | left_out}
                assert not missing, f"{path}: undeclared groups {missing}"
        if not adapter.fused_projections:
            with pytest.raises(ValueError, match="declares no projections"):
                fastdit.accelerate(pipe, fuse=True)
            return
        baseline = run_tiny(pipe, tiny)
        out, stats = run_accelerated(pipe, tiny, {"fuse": fastdit.Fuse()})
        np.testing.assert_allclose(out, baseline, atol=5e-4, rtol=0)
        fused = [info["fuse"] for info in stats.values()]
        assert all(f["misses"] == 0 for f in fused), fused
        assert sum(f["hits"] for f in fused) > 0, fused
        np.testing.assert_array_equal(run_tiny(pipe, tiny), baseline)

    def test_attention_backend_on_one_device(self, built: dict, variant: str) -> None:
        """``Attention(backend="math")`` without context parallelism: the SDPA calls the transformers make go to the
        math kernel (the output stays within float32 rounding of the default backend's), and disable gives the
        baseline back bit for bit."""
        pipe, tiny = self._pipe(built, variant)
        with _SdpaCount(_transformers(pipe, get_family(self.family))) as plain:
            baseline = run_tiny(pipe, tiny)
        fastdit.accelerate(pipe, attention=fastdit.Attention(backend="math"))
        try:
            out = run_tiny(pipe, tiny)
            stats = fastdit.summary(pipe)
        finally:
            fastdit.disable(pipe)
        np.testing.assert_allclose(out, baseline, atol=5e-4, rtol=0)  # 66 dB on [0, 1]: kernel rounding only
        served = [info["attention"] for info in stats.transformers.values()]
        assert all(s["backend"] == "math" for s in served)
        seen = sum(s["served_calls"] + sum(s["sdpa_calls"].values()) for s in served)
        if all(s["route"] == "sdpa calls" for s in served):  # every SDPA call of the forward is seen
            assert seen == plain.calls, (served, plain.calls)
        else:  # through diffusers' dispatch: processors that pass no parallel config keep the default
            assert 0 < seen <= plain.calls, (served, plain.calls)
        # (A model attending only through flex attention makes no SDPA call: nothing to route.)
        assert plain.calls == 0 or any(s["served_calls"] > 0 for s in served), served
        np.testing.assert_array_equal(run_tiny(pipe, tiny), baseline)

    def test_static_attention_scales(self, built: dict, variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
        """Static FP8 attention scales. A family routed through diffusers' dispatch: the calibration records Q, K
        and V of every attention site its calls reach, all three or none, and a run with the scales (the FP8 kernel's
        host stand-in) casts every call the backend serves with them, none with per-call scales. A site left
        unrecorded (counted as a dynamic site) is one no call reaches through the dispatch: cross-attention that
        passes no parallel config (Wan's), a module the variant does not use (Kandinsky 6's audio blocks in
        text-to-video), a processor calling SDPA itself (HunyuanVideo's token refiner). Calls with a mask run SDPA,
        so a family whose every call is masked casts nothing. Any other family: the calibration records the Linear
        layers only, and recording attention is refused before anything."""
        pytest.importorskip("torchao")  # the calibration records the Linear layers' inputs through torchao
        from fastdit.calibration import calibrate_scales
        from fastdit.components import walk
        from fastdit.parallel.attention import cudnn_fp8
        from fastdit.parallel.attention.single import QKV, dispatch_routed
        from tests.parallel.attention.fp8_host import fp8_backend_on_host

        pipe, tiny = self._pipe(built, variant)
        denoisers = walk(pipe).denoisers
        routed = all(dispatch_routed(i.adapter.cp_plan.attention if i.adapter.cp_plan else None) for i in denoisers)
        scales = calibrate_scales(pipe, lambda: run_tiny(pipe, tiny))
        recorded = {name for name in scales.layers if ":" in name}
        if not routed:
            assert scales.layers and not recorded, sorted(recorded)
            with pytest.raises(ValueError, match="not routed through diffusers' dispatch"):
                fastdit.accelerate(pipe, attention=fastdit.Attention(calibrate=True))
            assert fastdit.api.context_of(pipe) is None
            return
        sites = {i.name: [f"{i.name}.{path}" for path in processor_sites(i.module)] for i in denoisers}
        whole = {site for names in sites.values() for site in names if all(site + s in recorded for s in QKV)}
        assert whole, "no attention site was recorded"
        assert recorded == {site + s for site in whole for s in QKV}, "a site recorded part of Q, K, V, or no site's"
        casts = {"dynamic": 0, "static": 0}

        def counted(kind: str, cast):
            def count(*args, **kwargs):
                casts[kind] += 1
                return cast(*args, **kwargs)

            return count

        monkeypatch.setattr(cudnn_fp8, "quantize_per_tensor", counted("dynamic", cudnn_fp8.quantize_per_tensor))
        monkeypatch.setattr(cudnn_fp8, "quantize_static", counted("static", cudnn_fp8.quantize_static))
        with fp8_backend_on_host(monkeypatch):
            backend = fastdit.Attention(backend="cudnn-fp8", scales=scales)
            out, transformers = run_accelerated(pipe, tiny, {"attention": backend})
        assert np.isfinite(out).all()
        for name, names in sites.items():
            attention = transformers[name]["attention"]
            static = sum(site in whole for site in names)
            assert attention["static_scale_sites"] == static, (name, attention)
            assert attention["dynamic_scale_sites"] == len(names) - static, (name, attention)
        served = sum(info["attention"]["served_calls"] for info in transformers.values())
        assert casts == {"dynamic": 0, "static": 3 * served}, (casts, served)

    def test_compiled_outer_modules(self, built: dict, variant: str) -> None:
        """What ``Compile(outer=True)`` adds to the compiled blocks: every module outside the blocks (embedders, RoPE
        tables, final norm and projection) computed through dynamo (eager backend: it traces each of them) gives the
        eager output within float32 rounding, and the undo takes every compiled stage off again. (The whole option
        through ``accelerate`` is tested in ``tests/test_compile.py``.)"""
        from fastdit.compile import apply_compile, outer_modules
        from fastdit.components import walk
        from fastdit.hooks.blocks import runner_of

        pipe, tiny = self._pipe(built, variant)
        baseline = run_tiny(pipe, tiny)
        outer = [
            module
            for item in walk(pipe).denoisers
            for _, module in outer_modules(item.module, [name for name, _ in item.blocks()])
        ]
        assert outer, "no module outside the blocks"
        torch._dynamo.reset()
        applied = apply_compile(outer, fastdit.Compile(backend="eager"))
        try:
            out = run_tiny(pipe, tiny)
            assert all(runner_of(m) is not None and runner_of(m).compiled for m in outer)
        finally:
            applied.undo()
            torch._dynamo.reset()
        np.testing.assert_allclose(out, baseline, atol=1e-5, rtol=0)
        assert not any(runner_of(m) for m in outer), "the undo left a compiled stage"

    @pytest.mark.slow
    def test_verify_cache_rung(self, built: dict, variant: str) -> None:
        """The cache rung of ``fastdit verify`` (the same check, called here): it passes and leaves the pipeline
        un-accelerated. The parallel rungs run on gloo ranks in ``tests/parallel/test_verify_ladder.py``."""
        from fastdit.diagnostics.verify import VerifyRuntime, verify_ladder

        pipe, tiny = self._pipe(built, variant)
        report = verify_ladder(pipe, tiny.call_kwargs, "cache", VerifyRuntime(world_size=1))
        assert report.passed, report.table()
        assert fastdit.api.context_of(pipe) is None


class _SdpaCount(TorchFunctionMode):
    """Counts the ``scaled_dot_product_attention`` calls, however spelled, that ``transformers`` make."""

    def __init__(self, transformers: list) -> None:
        super().__init__()
        self.calls, self.depth, self.handles = 0, 0, []
        for module in transformers:
            self.handles.append(module.register_forward_pre_hook(lambda *_: self._step(1)))
            self.handles.append(module.register_forward_hook(lambda *_: self._step(-1), always_call=True))

    def _step(self, by: int) -> None:
        self.depth += by

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.scaled_dot_product_attention and self.depth:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _assert_step_invariant_served(stats, name: str) -> None:
    """Every module a family declares step-invariant was served at least once: the pipeline really passes it the same
    inputs at every step (a declaration that never hits would only cost its lookups)."""
    for component, info in stats.transformers.items():
        invariant = info["cache"]["step_invariant"]
        if invariant is None:
            continue
        assert not invariant["skipped"], (name, component, invariant)
        for module, counts in invariant["modules"].items():
            assert counts["served"] > 0, (name, component, module, counts)


def _declared_groups(transformer, declared) -> dict[str, set[frozenset]]:
    """Per declared block list, every group its blocks hold (``*`` members made concrete), as sets of names."""
    out: dict[str, set[frozenset]] = {}
    for path, groups in declared.items():
        for name in expand_path(transformer, path) if is_pattern(path) else [path]:
            for block in resolve_attr(transformer, name):
                out.setdefault(path, set()).update(frozenset(g) for d in groups for g in expand_group(block, d))
    return out


def _instance_forwards(pipe) -> set[str]:
    return {
        f"{name}.{path}"
        for name, component in pipe.components.items()
        if isinstance(component, torch.nn.Module)
        for path, module in component.named_modules()
        if "forward" in vars(module)
    }


def _transformers(pipe, adapter) -> list:
    from fastdit.models.registry import adapter_for

    found = [m for m in pipe.components.values() if m is not None and adapter_for(m) is adapter]
    assert found, f"no component of {type(pipe).__name__} is served by the {adapter.family!r} adapter"
    return found


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize ``variant`` over the family's tiny pipelines (called from each family test module)."""
    if "variant" not in metafunc.fixturenames:
        return
    variants = _variants(metafunc.cls.family)
    if metafunc.function.__name__ in _FIRST_VARIANT_BY_DEFAULT:  # every family by default, its other variants slow
        variants = [pytest.param(v, marks=[pytest.mark.slow] if i else []) for i, v in enumerate(variants)]
    metafunc.parametrize("variant", variants)


# Capability tests costly enough (dynamo traces) that the default run takes each family's first variant only.
_FIRST_VARIANT_BY_DEFAULT = frozenset({"test_compiled_outer_modules"})
