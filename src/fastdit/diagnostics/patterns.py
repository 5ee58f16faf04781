"""From recorded block calls to ForwardPatterns, loop-body work and masks.

Which argument carries the hidden states and which the text stream is decided by what a block *returns*: a returned
tensor is matched to the input it continues (same shape, and the nearest by value, since blocks are residual). A
block that returns only the hidden states takes the text stream (pattern 2) when an argument named for it, or one
that a cross-attention of the block reads as keys, is a token sequence.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from fastdit.diagnostics.trace import BlockCall, Trace, tensors_in
from fastdit.models.base import ForwardPattern

__all__ = ["GroupFinding", "LoopBodyChange", "detect_group", "find_masks", "index_dependence", "loop_body_changes"]

# Parameter-name fragments that name a text (or second) stream; decisive only when the returned values say nothing.
_ENCODER_WORDS = ("encoder", "context", "audio", "txt", "text")


@dataclass
class GroupFinding:
    """What one block list's calls show.

    Attributes:
        path: Path of the list.
        num_blocks: Entries in the list.
        num_calls: Calls recorded.
        block_class: Class name of its entries.
        pattern: The detected ForwardPattern value (``None`` when the list was not called or is not a block list).
        hidden_arg, encoder_arg: The parameters carrying the hidden states and the text stream.
        positional: Parameters passed by position in the first call (the rest went by keyword).
        keyword: Parameters passed by keyword in the first call.
        returns: How the first call's return value reads (``"tensor"``, ``"tuple(encoder, hidden)"``, ...).
        evidence: Why, in a few words per decision.
        interleaved_with: Another list whose calls alternate with this one's.
        overrides: Blocks whose calls read as another pattern than the first block's: index (negative from the
            end for the last blocks) -> pattern value (``BlockGroup.pattern_overrides``).
    """

    path: str
    num_blocks: int
    num_calls: int
    block_class: str
    pattern: int | None = None
    hidden_arg: str | None = None
    encoder_arg: str | None = None
    positional: list[str] = field(default_factory=list)
    keyword: list[str] = field(default_factory=list)
    returns: str = ""
    evidence: list[str] = field(default_factory=list)
    interleaved_with: str | None = None
    overrides: dict[int, int] = field(default_factory=dict)


def _seq_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.ndim >= 3 and value.is_floating_point()


def _distance(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    scale = b.float().abs().mean().item() or 1.0
    return (a.float() - b.float()).abs().mean().item() / scale


def _match(output: torch.Tensor, call: BlockCall, exclude: set[str]) -> str | None:
    """The input parameter ``output`` continues: same shape, nearest by value."""
    best, best_d = None, float("inf")
    for name, value in call.arguments.items():
        if name in exclude or not isinstance(value, torch.Tensor):
            continue
        d = _distance(output, value)
        if d < best_d:
            best, best_d = name, d
    return best


def _returned(output: Any) -> list[tuple[int, torch.Tensor | None]]:
    if isinstance(output, torch.Tensor):
        return [(0, output)]
    if isinstance(output, (tuple, list)):
        return [(i, v if isinstance(v, torch.Tensor) else None) for i, v in enumerate(output)]
    return []


def _cross_attention_keys(trace: Trace, path: str) -> set[int]:
    """Key lengths of attention calls inside ``path`` whose keys are not their queries (cross-attention)."""
    return {
        a.key[-2]
        for a in trace.attention
        if a.module.startswith(f"{path}.") and len(a.key) >= 2 and a.key[-2] != a.query[-2]
    }


def _encoder_input(call: BlockCall, hidden: str, trace: Trace, block_path: str) -> tuple[str | None, str]:
    """A text-stream argument of a block that returns only the hidden states, with the reason."""
    keys = _cross_attention_keys(trace, block_path)
    for name, value in call.arguments.items():
        if name == hidden or not _seq_tensor(value):
            continue
        if any(word in name.lower() for word in _ENCODER_WORDS):
            return name, f"{name!r} is a token sequence {tuple(value.shape)} named for a text stream"
        if value.shape[1] in keys:
            return name, f"{name!r} {tuple(value.shape)} is read as keys by a cross-attention"
    return None, "no other token-sequence argument"


def _first_tensor_arg(call: BlockCall) -> str | None:
    return next((n for n, v in call.arguments.items() if _seq_tensor(v)), None)


def detect_group(trace: Trace, path: str, blocks: torch.nn.ModuleList) -> GroupFinding:
    """Detect the ForwardPattern of the list at ``path`` from its recorded calls."""
    calls = trace.calls_of(path)
    finding = GroupFinding(path, len(blocks), len(calls), type(blocks[0]).__name__)
    if not calls:
        finding.evidence.append("never called in the traced forward")
        return finding
    _detect_call(finding, calls[0], trace)
    _note_interleaving(finding, trace)
    if finding.pattern is None:
        return finding
    first = _structure(calls[0].output)
    for call in calls[1:]:
        if call.index == calls[0].index or _structure(call.output) == first:
            continue  # the same block again (a later step), or returned alike: the group's pattern
        other = GroupFinding(path, len(blocks), 1, finding.block_class)
        _detect_call(other, call, trace)
        if other.pattern is not None and other.pattern != finding.pattern:
            index = call.index - len(blocks) if call.index >= len(blocks) - 2 else call.index
            finding.overrides[index] = other.pattern
            finding.evidence.append(f"block {call.index} returns {other.returns}: pattern {other.pattern} there")
    return finding


def _structure(output: Any) -> tuple:
    """What a block call returned, coarsely: a tensor, or a tuple's length and which entries are tensors."""
    if isinstance(output, torch.Tensor):
        return ("tensor",)
    if isinstance(output, (tuple, list)):
        return ("tuple", tuple(isinstance(o, torch.Tensor) for o in output))
    return (type(output).__name__,)


def _detect_call(finding: GroupFinding, call: BlockCall, trace: Trace) -> None:
    """Fill ``finding`` from one call of the list."""
    finding.positional = list(call.positional)
    finding.keyword = [n for n in call.arguments if n not in call.positional]
    returned = _returned(call.output)
    tensors = [(i, t) for i, t in returned if t is not None]
    hidden = _first_tensor_arg(call)
    if not tensors or hidden is None:
        finding.evidence.append("no tensor argument or return value: not a block list")
        return
    # The returned tensors, each matched to the input it continues.
    matched: list[tuple[int, str]] = []
    taken: set[str] = set()
    for i, tensor in tensors[:2]:
        name = _match(tensor, call, taken)
        if name is not None:
            matched.append((i, name))
            taken.add(name)
    hidden_pos = next((i for i, n in matched if n == hidden), None)
    if hidden_pos is None and matched:
        hidden_pos, hidden = matched[0]
    finding.hidden_arg = hidden
    others = [(i, n) for i, n in matched if n != hidden]
    _decide(finding, call, trace, returned, hidden_pos, others)


def _decide(
    finding: GroupFinding,
    call: BlockCall,
    trace: Trace,
    returned: list[tuple[int, torch.Tensor | None]],
    hidden_pos: int | None,
    others: list[tuple[int, str]],
) -> None:
    hidden = finding.hidden_arg
    where = "by position" if hidden in call.positional else "by keyword"
    finding.evidence.append(f"hidden states arrive as {hidden!r} ({where})")
    # A second returned value (tensor or None, as SD3's last block returns) in the slot the pattern names.
    second = [i for i, _ in returned if i != hidden_pos and i < 2] if len(returned) >= 2 else []
    if others:
        pos, encoder = others[0]
        finding.encoder_arg = encoder
        first = pos < (hidden_pos or 0)
        finding.returns = "tuple(encoder, hidden)" if first else "tuple(hidden, encoder)"
        finding.pattern = (ForwardPattern.P1 if first else ForwardPattern.P0).value
        finding.evidence.append(f"returns {finding.returns}: output {pos} continues input {encoder!r}")
        return
    if second and call.output[second[0]] is None:
        finding.returns = "tuple(hidden, None)" if second[0] > (hidden_pos or 0) else "tuple(None, hidden)"
    else:
        finding.returns = "tensor" if isinstance(call.output, torch.Tensor) else f"tuple (hidden at {hidden_pos})"
    encoder, why = _encoder_input(call, hidden, trace, f"{finding.path}.{call.index}")
    finding.encoder_arg = encoder
    finding.evidence.append(f"returns {finding.returns}")
    finding.evidence.append(why)
    if returned and second and call.output[second[0]] is None and encoder is not None:
        # The stream is returned, as None here (a last block that drops the text).
        first = second[0] < (hidden_pos or 0)
        finding.pattern = (ForwardPattern.P1 if first else ForwardPattern.P0).value
        return
    finding.pattern = (ForwardPattern.P2 if encoder else ForwardPattern.P3).value


def _note_interleaving(finding: GroupFinding, trace: Trace) -> None:
    calls = trace.calls_of(finding.path)
    if len(calls) < 2:
        return
    between = {c.group for c in trace.blocks if calls[0].order < c.order < calls[1].order and c.group != finding.path}
    if len(between) == 1:
        finding.interleaved_with = between.pop()
        finding.evidence.append(f"calls alternate with {finding.interleaved_with!r}")


@dataclass
class LoopBodyChange:
    """A stream changed between two consecutive block calls (work in the root forward's loop body).

    Attributes:
        after: ``"<list>.<i>"``, the block whose output was changed.
        before: ``"<list>.<j>"``, the block that received the changed value.
        stream: ``"hidden"`` or ``"encoder"`` (or the argument name for changed per-block arguments).
        detail: How it changed (shape change, max difference).
        within_group: Both blocks belong to the same list (the pitfall), rather than a hand-over between lists.
    """

    after: str
    before: str
    stream: str
    detail: str
    within_group: bool


def _stream_out(finding: GroupFinding, output: Any) -> tuple[Any, Any]:
    if finding.pattern is None:
        return None, None
    return ForwardPattern(finding.pattern).unpack(output)


def _compare(a: Any, b: Any) -> str | None:
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return None
    if a is b:
        return None
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} -> {tuple(b.shape)}"
    if torch.equal(a, b):
        return None
    return f"max |change| {(a.float() - b.float()).abs().max().item():.3g}"


def loop_body_changes(trace: Trace, findings: dict[str, GroupFinding], groups: list[str]) -> list[LoopBodyChange]:
    """Changes between consecutive calls of the lists ``groups`` (in execution order)."""
    calls = [c for c in trace.blocks if c.group in groups and findings[c.group].pattern is not None]
    changes: list[LoopBodyChange] = []
    for prev, nxt in itertools.pairwise(calls):
        pf, nf = findings[prev.group], findings[nxt.group]
        hidden_out, encoder_out = _stream_out(pf, prev.output)
        pairs = [("hidden", hidden_out, nxt.arguments.get(nf.hidden_arg))]
        if encoder_out is not None and nf.encoder_arg:
            pairs.append(("encoder", encoder_out, nxt.arguments.get(nf.encoder_arg)))
        same = prev.group == nxt.group
        for stream, out, inp in pairs:
            detail = _compare(out, inp)
            if detail:
                changes.append(
                    LoopBodyChange(f"{prev.group}.{prev.index}", f"{nxt.group}.{nxt.index}", stream, detail, same)
                )
        if same:
            changes.extend(_argument_changes(prev, nxt, pf))
    return changes


def _argument_changes(prev: BlockCall, nxt: BlockCall, finding: GroupFinding) -> list[LoopBodyChange]:
    """Other tensor arguments that differ between two calls of one list (computed per block in the loop)."""
    out = []
    for name, value in nxt.arguments.items():
        if name in (finding.hidden_arg, finding.encoder_arg):
            continue
        detail = _compare(prev.arguments.get(name), value)
        if detail:
            out.append(LoopBodyChange(f"{prev.group}.{prev.index}", f"{nxt.group}.{nxt.index}", name, detail, True))
    return out


def find_masks(call: BlockCall) -> list[str]:
    """Mask arguments of one block call, including inside ``attention_kwargs``-style dicts: ``"name (shape)"``."""
    found = []
    for name, value in call.arguments.items():
        for label, tensor in tensors_in(value, name):
            key = label.lower()
            if "mask" in key:
                found.append(f"{label} {tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}")
    return found


def index_dependence(changes: list[LoopBodyChange], findings: dict[str, GroupFinding]) -> list[str]:
    """Per list and changed value, whether the loop-body work depends on the block index, with the reason."""
    lines = []
    keys = sorted({(c.after.rpartition(".")[0], c.stream) for c in changes if c.within_group})
    for group, stream in keys:
        after = sorted(
            int(c.after.rpartition(".")[2])
            for c in changes
            if c.within_group and c.stream == stream and c.after.rpartition(".")[0] == group
        )
        boundaries = max(findings[group].num_calls - 1, 1)
        if stream not in ("hidden", "encoder"):
            why = "a per-block argument: computed from the block index in the loop"
        elif len(after) < boundaries:
            why = f"only after blocks {after} of {boundaries} boundaries: depends on the block index"
        else:
            why = "after every block: the same work each iteration (index dependence not visible)"
        lines.append(f"{group}: {stream} changes between blocks: {why}")
    return lines
