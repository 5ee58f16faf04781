from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from fastdit.models.hunyuan_video15 import key_padding_from_square
from fastdit.testing.pipelines import run_tiny
from tests.models.family_suite import FamilySuite, pytest_generate_tests  # noqa: F401 - pytest hook

PROCESSOR_MODULE = "diffusers.models.transformers.transformer_hunyuan_video15"


class TestHunyuanVideo15(FamilySuite):
    family = "hunyuan_video15"

    def test_square_mask_reduces_to_key_padding(
        self, built: dict, variant: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # Context parallelism can only use the key-padding diagonal of the processor's square mask: in one process,
        # attention with that mask instead must give the same output (padded encoder tokens are never read).
        pipe, tiny = self._pipe(built, variant)
        expected = run_tiny(pipe, tiny)
        module = importlib.import_module(PROCESSOR_MODULE)
        original = module.dispatch_attention_fn
        padded: list[bool] = []

        def with_key_padding(*args, attn_mask=None, **kwargs):
            reduced = key_padding_from_square(attn_mask)
            assert reduced.shape[-2] == 1
            padded.append(not bool(reduced.all()))
            return original(*args, attn_mask=reduced, **kwargs)

        monkeypatch.setattr(module, "dispatch_attention_fn", with_key_padding)
        out = run_tiny(pipe, tiny)
        assert any(padded), "the tiny prompt has no padded encoder tokens: the test would prove nothing"
        np.testing.assert_array_equal(out, expected)


def test_key_padding_from_square_is_the_padding_vector() -> None:
    m = torch.tensor([[True, True, False, True, False]])
    square = (m[:, None, None, :] & m[:, None, :, None]).bool()
    assert torch.equal(key_padding_from_square(square), m[:, None, None, :])
    key_padding = m[:, None, None, :]
    assert key_padding_from_square(key_padding) is key_padding
