"""The component walk finds every module of a pipeline by kind, from exact registries."""

from __future__ import annotations

import pytest
import torch

from fastdit.components import walk
from fastdit.components.registry import ComponentEntry, component_kind, register_component
from fastdit.testing.pipelines import build_tiny


def test_flux_components_by_kind() -> None:
    pipe, _ = build_tiny("flux")
    kinds = {c.name: c.kind for c in walk(pipe)}
    assert kinds == {"transformer": "denoiser", "text_encoder": "text_encoder", "text_encoder_2": "text_encoder",
                     "vae": "vae"}  # fmt: skip
    (denoiser,) = walk(pipe).denoisers
    assert denoiser.adapter.family == "flux"
    assert [name for name, _ in denoiser.blocks()][:2] == ["transformer_blocks.0", "single_transformer_blocks.0"]


def test_registries_are_exact() -> None:
    from transformers import T5EncoderModel

    class MyT5(T5EncoderModel):
        pass

    assert component_kind(T5EncoderModel) == "text_encoder"
    assert component_kind(MyT5) == "other"  # a subclass is not its parent
    with pytest.raises(ValueError, match="already registered"):
        register_component(
            ComponentEntry(
                class_name="transformers.models.t5.modeling_t5.T5EncoderModel", kind="text_encoder", architecture="t5"
            )
        )
    with pytest.raises(ValueError, match="kind="):
        register_component(ComponentEntry(class_name="x.Y", kind="denoiser", architecture="x"))


def test_targets_without_a_denoiser_are_refused() -> None:
    with pytest.raises(ValueError, match="expected a diffusers pipeline"):
        walk(object())
    with pytest.raises(ValueError, match="no adapter is registered"):
        walk(torch.nn.Linear(2, 2))
