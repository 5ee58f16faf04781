"""Unstepped-call marks: plain values and predicates, read by name whether passed by position or keyword."""

from __future__ import annotations

import torch

from fastdit.hooks.args import UnsteppedCalls


class _Model(torch.nn.Module):
    def forward(self, x: torch.Tensor, mode: object = None, cache: object = None) -> torch.Tensor:
        return x


class _Cache:
    def __init__(self, writing: bool) -> None:
        self.writing = writing


def test_plain_value_and_predicate_marks() -> None:
    marks = UnsteppedCalls(_Model(), {"mode": ("extract",), "cache": (lambda c: getattr(c, "writing", False),)})
    x = torch.zeros(1)
    assert marks((x, "extract"), {})
    assert marks((x,), {"mode": "extract"})
    assert marks((x,), {"cache": _Cache(writing=True)})
    assert marks((x, None, _Cache(writing=True)), {})
    assert not marks((x,), {"cache": _Cache(writing=False), "mode": "cached"})
    assert not marks((x,), {})


def test_a_tensor_never_equals_a_plain_mark() -> None:
    marks = UnsteppedCalls(_Model(), {"mode": (1,)})
    assert not marks((torch.zeros(1), torch.ones(1)), {})  # no elementwise comparison of a tensor argument


def test_no_marks_is_false() -> None:
    assert not UnsteppedCalls(_Model(), None)
    assert not UnsteppedCalls(_Model(), {})((torch.zeros(1),), {})
