"""TeaCache's spectral signal on every family, driven by what each adapter declares (``ModelAdapter.latent``).

A family that declares a latent runs its first tiny pipeline with the signal: threshold 0 is bit-identical to no
cache, the declared channel axis is the one the transformer's own output keeps, and on a run three times the tiny one
a threshold just over the largest change the calibration measured skips steps and stays finite and close. A family
that declares none is refused by name, with the reason its notes give. The default run takes the first tiny pipeline
of one family per distinct layout (channel axis, item axes); every other tiny pipeline runs under ``slow``.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

import fastdit
from fastdit.api import context_of, find_transformers
from fastdit.cache import apply_cache
from fastdit.cache.spectral import latent_axes
from fastdit.errors import FieldError
from fastdit.models.base import LatentLayout, ModelAdapter
from fastdit.models.registry import all_adapters, get_family
from fastdit.testing.pipelines import build_tiny, run_tiny, scaled_steps
from tests.cache.toy_dit import TOY_ADAPTER, ToyDiT, sample

SPECTRAL = {"signal": "spectral"}
# Config entries holding a transformer's channel counts (diffusers names them per family).
_CHANNEL_KEYS = ("in_channels", "out_channels", "in_visual_dim", "out_visual_dim")


def _declared() -> list[ModelAdapter]:
    return [a for a in all_adapters() if a.latent is not None and a.tiny_pipelines]


def _undeclared() -> list[ModelAdapter]:
    return [a for a in all_adapters() if a.latent is None]


def _layout_key(layout: LatentLayout) -> tuple:
    return layout.channel_dim, layout.item_dims


def _representatives() -> set[str]:
    """The first family (by name) of each distinct declared layout: the ones the default run covers."""
    first: dict[tuple, str] = {}
    for adapter in _declared():
        first.setdefault(_layout_key(adapter.latent), adapter.family)
    return set(first.values())


def _by_layout(families: list[ModelAdapter]) -> list:
    """Every tiny pipeline of every declaring family: the first one of each layout's representative in the default
    run, the rest under ``slow``."""
    fast = _representatives()
    return [
        pytest.param(
            a.family,
            tiny.name,
            id=f"{a.family}-{tiny.name}",
            marks=() if a.family in fast and i == 0 else pytest.mark.slow,
        )
        for a in families
        for i, tiny in enumerate(a.tiny_pipelines)
    ]


# --- the declarations (no pipeline runs) ---


def test_every_video_and_image_layout_is_declared_somewhere() -> None:
    """The layouts the generic reader handles all have a family: channels second, third (frames first), last, and
    an item axis."""
    layouts = {_layout_key(a.latent) for a in _declared()}
    assert {(1, ()), (2, ()), (-1, ()), (2, (1,))} <= layouts


@pytest.mark.parametrize("family", [a.family for a in _declared()])
def test_declared_argument_is_a_forward_parameter(family: str) -> None:
    """Of the classes the family serves, the one its pipelines denoise with (listed first) takes the argument. (A
    second class may not: DreamLite's bare transformer is a UNet stage, with no ``sample``; a call without the
    argument is refused at run time, see below.)"""
    import importlib

    adapter = get_family(family)
    module, _, cls = adapter.transformer_classes[0].rpartition(".")
    forward = getattr(importlib.import_module(module), cls).forward
    assert adapter.latent.arg in inspect.signature(forward).parameters, (family, adapter.transformer_classes[0])


@pytest.mark.parametrize("family", [a.family for a in _undeclared()])
def test_family_without_a_latent_is_refused_by_name_with_its_reason(family: str) -> None:
    adapter = get_family(family)
    assert adapter.no_latent, f"{family}: notes give no 'No spectral signal:' reason"
    # Refused before the module is looked at: an empty module stands in for the transformer.
    with pytest.raises(FieldError, match="declares no latent grid") as caught:
        apply_cache(torch.nn.Module(), adapter.cache_plan, fastdit.TeaCache(threshold=0.1, **SPECTRAL))
    assert caught.value.owner == "TeaCache" and caught.value.field == "signal"
    assert repr(family) in str(caught.value) and adapter.no_latent in str(caught.value)


def test_layout_validates_its_axes() -> None:
    assert LatentLayout(channel_dim=2, item_dims=[1]).item_dims == (1,)
    for fields in ({"channel_dim": 0}, {"channel_dim": True}, {"item_dims": (0,)}, {"item_dims": (1, 1)}):
        with pytest.raises(ValueError, match="LatentLayout"):
            LatentLayout(**fields)
    with pytest.raises(ValueError, match="no item axis"):
        LatentLayout(channel_dim=2, item_dims=(2,))
    assert latent_axes((2, 3, 4, 5, 6, 7), 2, (1,)) == (3, 4, 5)
    assert latent_axes((2, 5, 6, 4), -1) == (1, 2)
    with pytest.raises(ValueError, match="outside"):
        latent_axes((2, 4, 8, 8), 4)
    with pytest.raises(ValueError, match="also the channel axis"):
        latent_axes((2, 4, 8, 8), 1, (-3,))


# --- the reader's check at run time ---


@pytest.mark.parametrize(
    ("layout", "expected"),
    [
        (LatentLayout(arg="sample", channel_dim=3), r"'toy'.*sample, channels at dim 3.*axis 3 is outside"),
        (LatentLayout(arg="sample", channel_dim=-1, item_dims=(1,)), r"'toy'.*items at dim 1.*no grid axis"),
        (LatentLayout(arg="t"), r"'toy'.*adapter declares its latent as t, channels at dim 1.*axis 1 is outside"),
    ],
)
def test_a_layout_that_does_not_fit_the_tensor_is_refused_naming_family_argument_and_axis(
    layout: LatentLayout, expected: str
) -> None:
    import dataclasses

    model = ToyDiT(depth=1)  # takes sample (batch, tokens, channels) and timestep (batch,)
    adapter = dataclasses.replace(TOY_ADAPTER, family="toy", latent=layout)
    fastdit.accelerate(model, cache=fastdit.TeaCache(threshold=0.5, **SPECTRAL), adapter=adapter)
    try:
        with pytest.raises(FieldError, match=expected) as caught:
            sample(model, steps=2)
    finally:
        fastdit.disable(model)
    assert caught.value.owner == "TeaCache" and caught.value.field == "signal"


def test_a_declared_argument_holding_no_tensor_is_refused() -> None:
    import dataclasses

    model = ToyDiT(depth=1)
    adapter = dataclasses.replace(TOY_ADAPTER, family="toy", latent=LatentLayout(arg="not_an_argument"))
    fastdit.accelerate(model, cache=fastdit.TeaCache(threshold=0.5, **SPECTRAL), adapter=adapter)
    try:
        with pytest.raises(FieldError, match=r"'toy'.*not_an_argument.*got NoneType"):
            sample(model, steps=2)
    finally:
        fastdit.disable(model)


def test_items_are_filtered_apart() -> None:
    """An item axis is no grid axis: two items filtered together equal each filtered alone."""
    from fastdit.cache.spectral import spectral_estimate

    latent = torch.randn(1, 2, 4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    together = spectral_estimate(latent, 2.0, 3.0, channel_dim=2, item_dims=(1,))  # (batch, channels, items, grid)
    for item in range(2):
        alone = spectral_estimate(latent[:, item], 2.0, 3.0, channel_dim=1)
        torch.testing.assert_close(together[:, :, item], alone)
    # Filtered as a grid axis instead, the items would mix.
    mixed = spectral_estimate(latent, 2.0, 3.0, channel_dim=2)
    assert not torch.allclose(mixed[:, :, 0], together[:, :, 0])


# --- runs on each declaring family's tiny pipeline ---


def _record_latents(pipe, adapter: ModelAdapter) -> tuple[dict, list]:
    """Forward hooks recording, per denoiser, the first call's declared latent and output."""
    seen: dict[str, tuple[torch.Tensor, torch.Tensor, dict]] = {}
    handles = []
    for name, (module, _) in find_transformers(pipe).items():
        signature = inspect.signature(module.forward)

        def hook(mod, args, kwargs, output, name=name, signature=signature) -> None:
            if name in seen:
                return
            latent = signature.bind_partial(*args, **kwargs).arguments[adapter.latent.arg]
            out = output if isinstance(output, torch.Tensor) else output[0]
            config = dict(getattr(mod, "config", {}) or {})
            seen[name] = (latent, out, config)

        handles.append(module.register_forward_hook(hook, with_kwargs=True))
    return seen, handles


@pytest.mark.parametrize(("family", "variant"), _by_layout(_declared()))
def test_threshold_zero_is_bit_identical_and_the_channel_axis_is_the_one_the_output_keeps(
    family: str, variant: str
) -> None:
    adapter = get_family(family)
    pipe, tiny = build_tiny(family, variant)
    seen, handles = _record_latents(pipe, adapter)
    try:
        baseline = run_tiny(pipe, tiny)
    finally:
        for handle in handles:
            handle.remove()
    fastdit.accelerate(pipe, cache=fastdit.TeaCache(threshold=0.0, **SPECTRAL))
    try:
        out = run_tiny(pipe, tiny)
        assert fastdit.summary(pipe).num_cached_steps == 0
    finally:
        fastdit.disable(pipe)
    np.testing.assert_array_equal(out, baseline)

    assert seen, f"{family}: no denoiser call seen"
    layout = adapter.latent
    for name, (latent, output, config) in seen.items():
        assert isinstance(latent, torch.Tensor), (family, name, type(latent))
        latent_axes(latent.shape, layout.channel_dim, layout.item_dims)  # the layout fits: raises otherwise
        # The prediction keeps the latent's batch, items and grid; only the channel count may differ (conditioning
        # channels in, learned variance out).
        axis = layout.channel_dim % latent.ndim
        assert output.ndim == latent.ndim, (family, name, tuple(latent.shape), tuple(output.shape))
        differ = [d for d in range(latent.ndim) if latent.shape[d] != output.shape[d]]
        assert differ in ([], [axis]), (family, name, tuple(latent.shape), tuple(output.shape), axis)
        # And the config's channel counts name that axis (where the config states one).
        counts = {v for k in _CHANNEL_KEYS if isinstance(v := config.get(k), int)}
        if counts:
            assert {latent.shape[axis], output.shape[axis]} & counts, (family, name, tuple(latent.shape), counts)


@pytest.mark.parametrize(("family", "variant"), _by_layout(_declared()))
def test_a_threshold_over_the_largest_change_skips_steps_on_a_longer_run(family: str, variant: str) -> None:
    pipe, tiny = build_tiny(family, variant)
    longer = scaled_steps(tiny, 3)
    try:
        baseline = run_tiny(pipe, tiny, **longer)
    except ValueError:  # a sampler of a fixed step count (SANA-Sprint's 2): its own run, whose second step may skip
        longer = {}
        baseline = run_tiny(pipe, tiny)
    fastdit.accelerate(pipe, cache=fastdit.TeaCache(calibrate=True, **SPECTRAL))
    try:
        run_tiny(pipe, tiny, **longer)
        context = context_of(pipe)
        changes = [
            x
            for component in find_transformers(pipe)
            for pairs in context.state("cache", component).pairs().values()
            for x, _ in pairs
        ]
    finally:
        fastdit.disable(pipe)
    assert changes and all(np.isfinite(changes)) and min(changes) > 0, changes
    # No single step's change reaches the threshold, so every step after a computed one skips, two at most in a row.
    config = fastdit.TeaCache(
        threshold=1.01 * max(changes), max_skip_steps=2, retention_ratio=0.0, final_steps=0, **SPECTRAL
    )
    fastdit.accelerate(pipe, cache=config)
    try:
        out = run_tiny(pipe, tiny, **longer)
        stats = fastdit.summary(pipe)
    finally:
        fastdit.disable(pipe)
    assert stats.num_cached_steps > 0
    assert np.isfinite(out).all()
    error = float(np.linalg.norm(out - baseline) / max(float(np.linalg.norm(baseline)), 1e-12))
    assert error < 0.5, f"{family}: relative error {error:.3f} of the cached run"


@pytest.mark.slow
@pytest.mark.parametrize("family", [a.family for a in _undeclared() if a.tiny_pipelines])
def test_accelerate_refuses_the_spectral_signal_on_a_family_without_a_latent(family: str) -> None:
    pipe, _ = build_tiny(family)
    with pytest.raises(FieldError, match=f"{family!r} adapter declares no latent grid"):
        fastdit.accelerate(pipe, cache=fastdit.TeaCache(threshold=0.1, **SPECTRAL))
    assert context_of(pipe) is None
