"""Which tensors carry the token sequence at module-call boundaries, where RoPE comes from, and which masks exist.

Sequence lengths are those the first block sees: the hidden states' tokens (``image``), the text stream's (``text``)
and their sum (``joint``). A tensor carries the sequence on a dim whose size is one of them (dims ``1..ndim-2`` of a
3+-D tensor, dim 0 of a 2-D table): those are the places a context-parallel plan can split.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from fastdit.diagnostics.patterns import GroupFinding, find_masks
from fastdit.diagnostics.trace import Trace, tensors_in

__all__ = ["SequenceFacts", "sequence_facts"]


@dataclass
class SequenceFacts:
    """Where the sequence lives in the traced forward.

    Attributes:
        lengths: Label -> token count (``image``, ``text``, ``joint``) on the tiny model.
        root_inputs: Root ``forward`` arguments carrying the sequence: ``"name (shape) seq@dim label"``.
        built_inside: The hidden states enter the root without a token dim (a latent grid patchified inside forward).
        producers: Modules whose output carries the sequence while none of their inputs does (they make it):
            ``"path (Class) -> shape seq@dim label"``.
        block_args: Per list, arguments of its first call other than the streams that carry the sequence, each with
            the module that produced it (``"computed in forward"`` if no module did): RoPE tables, position ids.
        masks: Masks passed to blocks (also inside ``attention_kwargs`` dicts) and reaching attention.
        root_masks: Root ``forward`` arguments that are masks.
    """

    lengths: dict[str, int] = field(default_factory=dict)
    root_inputs: list[str] = field(default_factory=list)
    built_inside: bool = False
    producers: list[str] = field(default_factory=list)
    block_args: dict[str, list[str]] = field(default_factory=dict)
    masks: list[str] = field(default_factory=list)
    root_masks: list[str] = field(default_factory=list)


def _seq_dims(tensor: torch.Tensor, lengths: dict[str, int]) -> list[tuple[int, str]]:
    dims = range(1, tensor.ndim - 1) if tensor.ndim >= 3 else range(0, 1) if tensor.ndim == 2 else range(0)
    by_size = {v: k for k, v in reversed(lengths.items())}
    return [(d, by_size[tensor.shape[d]]) for d in dims if tensor.shape[d] in by_size and tensor.shape[d] > 1]


def _describe(label: str, tensor: torch.Tensor, lengths: dict[str, int]) -> str | None:
    dims = _seq_dims(tensor, lengths)
    if not dims:
        return None
    where = ", ".join(f"seq@dim{d} {name}" for d, name in dims)
    return f"{label} {tuple(tensor.shape)} {where}"


def _lengths(trace: Trace, findings: list[GroupFinding]) -> dict[str, int]:
    for finding in findings:
        calls = trace.calls_of(finding.path)
        if finding.pattern is None or not calls:
            continue
        hidden = calls[0].arguments.get(finding.hidden_arg)
        encoder = calls[0].arguments.get(finding.encoder_arg) if finding.encoder_arg else None
        lengths: dict[str, int] = {}
        if isinstance(hidden, torch.Tensor) and hidden.ndim == 3:
            lengths["image"] = hidden.shape[1]
        if isinstance(encoder, torch.Tensor) and encoder.ndim == 3:
            lengths["text"] = encoder.shape[1]
        if len(lengths) == 2:
            lengths["joint"] = lengths["image"] + lengths["text"]
        if lengths:
            return lengths
    return {}


def _producer(trace: Trace, tensor: torch.Tensor) -> str:
    for call in trace.modules:
        if any(out is tensor for out in call.outputs.values()):
            return f"{call.path} ({call.cls})"
    return "computed in forward"


def _producers(trace: Trace, lengths: dict[str, int]) -> list[str]:
    out: list[str] = []
    for call in trace.modules:
        in_sizes = {t.shape[d] for t in call.inputs.values() for d, _ in _seq_dims(t, lengths)}
        for label, tensor in call.outputs.items():
            dims = [(d, n) for d, n in _seq_dims(tensor, lengths) if tensor.shape[d] not in in_sizes]
            if dims and not call.path.count("."):
                where = ", ".join(f"seq@dim{d} {n}" for d, n in dims)
                out.append(f"{call.path} ({call.cls}) -> {label} {tuple(tensor.shape)} {where}")
    return list(dict.fromkeys(out))


def _block_args(trace: Trace, finding: GroupFinding, lengths: dict[str, int]) -> list[str]:
    calls = trace.calls_of(finding.path)
    if not calls:
        return []
    out = []
    for name, value in calls[0].arguments.items():
        if name in (finding.hidden_arg, finding.encoder_arg):
            continue
        for label, tensor in tensors_in(value, name):
            text = _describe(label, tensor, lengths)
            if text and "mask" not in label.lower():
                out.append(f"{text} from {_producer(trace, tensor)}")
    return out


def sequence_facts(trace: Trace, findings: list[GroupFinding], hidden_root_arg: str | None) -> SequenceFacts:
    """Collect :class:`SequenceFacts` from a trace and the detected block lists."""
    facts = SequenceFacts(lengths=_lengths(trace, findings))
    for name, value in trace.root_arguments.items():
        for label, tensor in tensors_in(value, name):
            if "mask" in label.lower():
                facts.root_masks.append(f"{label} {tuple(tensor.shape)}")
                continue
            text = _describe(label, tensor, facts.lengths)
            if text:
                facts.root_inputs.append(text)
    hidden = trace.root_arguments.get(hidden_root_arg) if hidden_root_arg else None
    image = facts.lengths.get("image")
    facts.built_inside = not (isinstance(hidden, torch.Tensor) and hidden.ndim == 3 and hidden.shape[1] == image)
    facts.producers = _producers(trace, facts.lengths)
    for finding in findings:
        if finding.pattern is None:
            continue
        args = _block_args(trace, finding, facts.lengths)
        if args:
            facts.block_args[finding.path] = args
        calls = trace.calls_of(finding.path)
        facts.masks.extend(f"{finding.path}: {m}" for m in find_masks(calls[0]))
    masked = sorted({f"{a.module} mask {a.mask}" for a in trace.attention if a.mask is not None})
    facts.masks.extend(f"attention {m}" for m in masked[:4])
    return facts


def first_tensor(value: Any) -> torch.Tensor | None:
    """The first tensor in ``value`` (itself, or the first of a tuple/list)."""
    return next((t for _, t in tensors_in(value, "")), None)
