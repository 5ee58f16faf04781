"""``inspect``: the model-integration analysis of one transformer, done by the tool.

:func:`inspect_target` resolves a target (:mod:`fastdit.diagnostics.target`), reads the full-size structure on
``meta`` (:mod:`~fastdit.diagnostics.structure`), runs one traced forward on a small CPU model
(:mod:`~fastdit.diagnostics.trace`), detects each block list's ForwardPattern and the work between block calls
(:mod:`~fastdit.diagnostics.patterns`), finds where the sequence lives (:mod:`~fastdit.diagnostics.sequence`),
decides CP and TP (:mod:`~fastdit.diagnostics.decide`), and compares all of it with the registered adapter, or
proposes one. :mod:`~fastdit.diagnostics.report` renders the result.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Collection
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from fastdit.attrs import is_pattern
from fastdit.diagnostics.decide import Decision, cp_decision, divisibility, main_attention, tp_decision
from fastdit.diagnostics.patterns import (
    GroupFinding,
    LoopBodyChange,
    detect_group,
    index_dependence,
    loop_body_changes,
)
from fastdit.diagnostics.sequence import SequenceFacts, sequence_facts
from fastdit.diagnostics.structure import HEAD_COUNTS, AttentionFacts, LinearFacts, attention_facts, modulation_linears
from fastdit.diagnostics.synth import TIME_ARGS, forward_setup
from fastdit.diagnostics.target import ForwardSetup, Target, build_meta, example_setup, resolve_target
from fastdit.diagnostics.trace import Trace, block_list_paths, trace_forward
from fastdit.models.base import BlockGroup, ForwardPattern, ModelAdapter, qualified_name, resolve_attr

__all__ = ["InspectReport", "inspect_target"]

# A block list holding less than this share of the largest list's parameters is a refiner or embedder stack, not a
# cache group (Lumina 2's two-block noise refiner beside its 26 layers).
_MAIN_SHARE = 0.1


@dataclass
class InspectReport:
    """Everything ``fastdit inspect`` found about one transformer.

    Attributes:
        target: The target as given.
        transformer_class: Fully qualified class name.
        family: The registered family, ``None`` if unregistered.
        config_source: Where the full-size config came from.
        structure_note: Why the full-size model could not be built on ``meta`` (then the tiny one stands in).
        forward_source: How the traced forward's model and inputs were obtained.
        forward_error: Why the traced forward failed (``None``: it ran).
        groups: Every block list with its detected pattern and evidence.
        main_groups: The lists that form the cache groups, in execution order.
        loop_body: Changes between consecutive block calls.
        loop_body_index: Per list and changed value, whether that work depends on the block index.
        attention: Attention modules (full-size sizes).
        attention_calls: ``module: q (..) k (..)`` of the distinct attention calls of the traced forward.
        modulation: AdaLN modulation linears.
        sequence: Where the sequence lives; RoPE and mask sources.
        divisibility: Degree -> what divides it.
        cp, tp: The decisions.
        fused_projections: Per cache block list, the groups of Linear layers every one of its blocks applied to
            one tensor in the traced forward (what ``ModelAdapter.fused_projections`` declares; ``Fuse``).
        comparison: For a registered family: ``"ok: ..."`` / ``"MISMATCH: ..."`` / ``"note: ..."`` lines.
        proposed_adapter: For an unregistered model: a ``ModelAdapter(...)`` to paste.
    """

    target: str
    transformer_class: str
    family: str | None
    config_source: str
    structure_note: str | None = None
    forward_source: str = ""
    forward_error: str | None = None
    groups: list[GroupFinding] = field(default_factory=list)
    main_groups: list[str] = field(default_factory=list)
    loop_body: list[LoopBodyChange] = field(default_factory=list)
    loop_body_index: list[str] = field(default_factory=list)
    attention: list[AttentionFacts] = field(default_factory=list)
    attention_calls: list[str] = field(default_factory=list)
    modulation: list[LinearFacts] = field(default_factory=list)
    sequence: SequenceFacts = field(default_factory=SequenceFacts)
    divisibility: dict[int, dict[str, bool]] = field(default_factory=dict)
    cp: Decision | None = None
    tp: Decision | None = None
    fused_projections: dict[str, list[list[str]]] = field(default_factory=dict)
    comparison: list[str] = field(default_factory=list)
    proposed_adapter: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data."""
        data = asdict(self)
        data["divisibility"] = {str(k): v for k, v in self.divisibility.items()}
        for key in ("cp", "tp"):
            if data[key]:
                data[key]["per_degree"] = {str(k): v for k, v in data[key]["per_degree"].items()}
        return data

    def group(self, path: str) -> GroupFinding:
        """The finding of the list at ``path``."""
        return next(g for g in self.groups if g.path == path)


def _params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _main_groups(structure: torch.nn.Module, findings: list[GroupFinding], trace: Trace) -> list[str]:
    """Root-level lists that were called as blocks and hold a fair share of the weights, in execution order."""
    candidates = [g for g in findings if g.pattern is not None and "." not in g.path and g.num_calls]
    sizes = {g.path: _params(resolve_attr(structure, g.path)) for g in candidates if hasattr(structure, g.path)}
    largest = max(sizes.values(), default=0)
    keep = {p for p, n in sizes.items() if n >= _MAIN_SHARE * largest}
    order = {c.group: c.order for c in reversed(trace.blocks)}
    return sorted(keep, key=lambda p: order.get(p, 0))


def _hidden_root_arg(trace: Trace) -> str | None:
    return next((n for n, v in trace.root_arguments.items() if isinstance(v, torch.Tensor)), None)


def inspect_target(spec: str, example: str | None = None) -> InspectReport:
    """Inspect ``spec`` (see :func:`fastdit.diagnostics.target.resolve_target` for what it may name).

    Args:
        spec: The target.
        example: ``module.path:function`` giving a small model and one call of it (see
            :func:`fastdit.diagnostics.target.example_setup`); ``None``: made from a tiny pipeline or the signature.

    Raises:
        fastdit.diagnostics.target.TargetError: if ``spec`` names nothing inspectable, or the example is unusable.
    """
    target = resolve_target(spec)
    setup = example_setup(example, target) if example is not None else None
    return inspect_resolved(target, setup)


def inspect_resolved(target: Target, setup: ForwardSetup | None = None) -> InspectReport:
    """Inspect an already resolved target (with ``setup``, the model and call to trace, if given)."""
    report = InspectReport(
        target=target.spec,
        transformer_class=qualified_name(target.cls),
        family=target.adapter.family if target.adapter else None,
        config_source=target.config_source,
    )
    if setup is None:
        try:
            setup = forward_setup(target)
        except Exception as exc:  # no forward: structure only
            report.forward_error = f"no forward could be run: {exc}"
    fill = dict(getattr(setup.model, "config", None) or {}) if setup else None
    meta, report.structure_note = build_meta(target, fill)
    report.config_source = target.config_source
    structure = meta if meta is not None else (setup.model if setup else None)
    if structure is None:
        raise RuntimeError(f"{target.spec}: neither the full-size model nor a small one could be built")
    report.attention = attention_facts(structure)
    if setup is None:
        _finish(report, target, Trace(), structure)
        return report
    report.forward_source = setup.source
    trace = trace_forward(setup.model, setup.args, setup.kwargs)
    report.forward_error = trace.error
    model = setup.model
    report.groups = [detect_group(trace, p, resolve_attr(model, p)) for p in block_list_paths(model)]
    report.main_groups = _main_groups(structure, report.groups, trace)
    declared = report.main_groups
    findings = {g.path: g for g in report.groups}
    if target.adapter:
        groups = declared_groups(target.adapter, findings)
        declared = [p for g in groups for p in (g.path, g.interleaved and g.interleaved.path) if p]
    report.loop_body = loop_body_changes(trace, findings, [p for p in declared if p in findings])
    report.loop_body_index = index_dependence(report.loop_body, findings)
    report.modulation = modulation_linears(structure, trace.linear_inputs)
    ordered = [findings[p] for p in report.main_groups] + report.groups
    report.sequence = sequence_facts(trace, ordered, _hidden_root_arg(trace))
    report.attention_calls = sorted({f"{a.module}: q {a.query} k {a.key}" for a in trace.attention})[:12]
    if trace.error is None:
        report.fused_projections = _shared_inputs(setup, [findings[p] for p in declared if p in findings])
    _finish(report, target, trace, structure)
    return report


def _shared_inputs(setup: ForwardSetup, lists: list[GroupFinding]) -> dict[str, list[list[str]]]:
    """The projections each block of ``lists`` applied to one tensor, from one more call of the traced forward."""
    from fastdit.fuse import declared_form

    groups = [BlockGroup(path=g.path, pattern=ForwardPattern(g.pattern)) for g in lists if g.pattern is not None]

    def run() -> None:
        with torch.no_grad():
            setup.model(*setup.args, **setup.kwargs)

    found = declared_form(setup.model, groups, run)
    return {path: [list(group) for group in found_groups] for path, found_groups in found.items()}


def _finish(report: InspectReport, target: Target, trace: Trace, structure: torch.nn.Module) -> None:
    inline = inline_attention(trace, structure)
    report.attention += inline
    attn = main_attention(report.attention)
    report.divisibility = divisibility(attn, report.sequence.lengths)
    first = report.main_groups[0] if report.main_groups else None
    report.cp = cp_decision(report.sequence, report.loop_body, attn, first)
    if inline:
        paths = ", ".join(f'"{a.path}"' for a in inline)
        report.cp.reasons.append(
            f"attention is computed inline (scaled_dot_product_attention in {paths}, no processor): route it with "
            f"AttentionRouting(sdpa_calls=({paths},))"
        )
    report.tp = tp_decision(report.attention, report.modulation)
    if target.adapter is not None:
        report.comparison = compare_adapter(report, target.adapter)
    else:
        report.proposed_adapter = propose_adapter(report, target, trace)


def inline_attention(trace: Trace, structure: torch.nn.Module) -> list[AttentionFacts]:
    """Attention the trace saw computed by modules without a ``processor`` (inline SDPA), one entry per path
    pattern, with heads read from the call's query and key shapes ``(B, H, S, D)``."""
    found: dict[str, AttentionFacts] = {}
    for call in trace.attention:
        try:
            module = structure.get_submodule(call.module) if call.module else structure
        except AttributeError:  # traced on a smaller model than the structure: a path the latter lacks
            continue
        if getattr(module, "processor", None) is not None or len(call.query) != 4 or len(call.key) != 4:
            continue
        path = re.sub(r"\.\d+(?=\.|$)", ".*", call.module)
        if path in found:
            found[path].count += 1
            continue
        heads, kv = call.query[1], call.key[1]
        cross = call.key[2] != call.query[2]
        found[path] = AttentionFacts(
            path or "(root)", type(module).__name__, 1, heads, kv, call.query[3], kv < heads, cross
        )
    return list(found.values())


def declared_groups(adapter: ModelAdapter, found: Collection[str]) -> list[BlockGroup]:
    """The adapter's block groups as they apply to a model whose block lists are ``found`` (their paths): a ``*``
    path stands for each found list it matches, an optional list that was not found is left out."""
    out: list[BlockGroup] = []
    for group in adapter.block_groups:
        if is_pattern(group.path):
            parts = group.path.split(".")
            for path in found:
                names = path.split(".")
                if len(names) == len(parts) and all(p in ("*", n) for p, n in zip(parts, names, strict=True)):
                    out.append(dataclasses.replace(group, path=path))
        elif not (group.optional and group.path not in found):
            out.append(group)
    return out


def _compare_groups(report: InspectReport, adapter: ModelAdapter) -> list[str]:
    found = {g.path: g for g in report.groups}
    lines = []
    groups = declared_groups(adapter, found)
    for group in groups:
        for declared in (group, group.interleaved) if group.interleaved else (group,):
            seen = found.get(declared.path)
            if seen is None or seen.pattern is None:
                lines.append(f"MISMATCH: {declared.path}: declared P{declared.pattern.value}, not seen as a block list")
                continue
            ok = seen.pattern == declared.pattern.value and seen.hidden_arg == declared.hidden_arg
            if ok and declared.pattern.takes_encoder:
                ok = seen.encoder_arg == declared.encoder_arg
            tag = "ok" if ok else "MISMATCH"
            lines.append(
                f"{tag}: {declared.path}: declared P{declared.pattern.value} ({declared.hidden_arg}"
                + (f", {declared.encoder_arg}" if declared.pattern.takes_encoder else "")
                + f"), detected P{seen.pattern} ({seen.hidden_arg}"
                + (f", {seen.encoder_arg}" if seen.encoder_arg else "")
                + ")"
            )
    declared_paths = {g.path for g in groups} | {g.interleaved.path for g in groups if g.interleaved}
    for path in report.main_groups:
        if path not in declared_paths:
            lines.append(f"note: {path} looks like a block list the adapter does not declare")
    if any(c.within_group for c in report.loop_body) and adapter.patch is None:
        lines.append(
            "note: work between blocks was detected and the adapter has no patch: check the cache hooks keep it"
        )
    return lines


def _declared_cp(plan: Any) -> str:
    kinds = []
    if "" in plan.inputs:
        kinds.append("root split")
    kinds += [f"split at {p}" for p in plan.inputs if p and p.split(".")[-1].isdigit()]
    if plan.outputs:
        kinds.append("split sub-module outputs")
    if [p for p in plan.inputs if p and not p.split(".")[-1].isdigit()]:
        kinds.append("per-sub-module hooks")
    return " + ".join(kinds) or "no splits"


def _compare_cp(report: InspectReport, adapter: ModelAdapter) -> list[str]:
    plan = adapter.cp_plan
    if plan is None:
        return [f"note: no CP plan declared; detected strategy: {report.cp.strategy}"]
    declared = _declared_cp(plan)
    detected = report.cp.strategy.split(" + ")[0]
    tag = "ok" if detected in declared else "differs"
    lines = [f"{tag}: CP declared {declared}; detected {report.cp.strategy}"]
    mask = bool(report.sequence.masks or report.sequence.root_masks)
    handled = bool(plan.attention.mask_segments or plan.attention.mask_transform)
    if mask and not handled:
        lines.append("note: a mask was seen but the CP plan names no mask_segments / mask_transform: check its order")
    return lines


def _compare_tp(report: InspectReport, adapter: ModelAdapter) -> list[str]:
    plan = adapter.tp_plan
    if plan is None:
        return [f"note: no TP plan declared; detected strategy: {report.tp.strategy}"]
    wanted = [d.removeprefix("divide ") for d in report.tp.details if d.startswith("divide ")]
    lines = []
    for path in wanted:
        covered = any(fnmatch.fnmatchcase(path, pattern) or path == pattern for pattern in plan.divide)
        used = any(
            fnmatch.fnmatchcase(path.rpartition(".")[0], p) or p.startswith(path.rpartition(".")[0])
            for p in plan.layers
        )
        if covered or not used:
            continue
        if path.rpartition(".")[2] in HEAD_COUNTS:
            lines.append(f"MISMATCH: TP plan splits {path.rpartition('.')[0]} but does not divide {path}")
        else:
            lines.append(
                f"note: {path} holds a sharded width; the plan leaves it whole (fine if attention never reads it)"
            )
    attn = main_attention(report.attention)
    if attn and attn.gqa and report.tp.per_degree.get(2) == "ffn-only" and plan.fallback is None:
        lines.append("note: GQA heads do not divide 2 and the TP plan has no FFN-only fallback")
    return lines or [f"ok: TP plan {plan.name!r} divides every head attribute it splits"]


def _compare_fused(report: InspectReport, adapter: ModelAdapter) -> list[str]:
    declared = {path: {frozenset(g) for g in groups} for path, groups in adapter.fused_projections.items()}
    lines = []
    for path, groups in report.fused_projections.items():
        missing = [g for g in groups if frozenset(g) not in declared.get(path, set())]
        lines += [f"note: {path}: {'+'.join(g)} share an input but are not declared fused" for g in missing]
    if not lines and report.fused_projections:
        lines.append("ok: every group of projections that shares an input is declared fused")
    return lines


def compare_adapter(report: InspectReport, adapter: ModelAdapter) -> list[str]:
    """The registered adapter's declarations against what was found."""
    return (
        _compare_groups(report, adapter)
        + _compare_cp(report, adapter)
        + _compare_tp(report, adapter)
        + _compare_fused(report, adapter)
    )


def _group_text(finding: GroupFinding, indent: str) -> str:
    args = [f'path="{finding.path}"', f"pattern=ForwardPattern.P{finding.pattern}"]
    if finding.hidden_arg != "hidden_states":
        args.append(f'hidden_arg="{finding.hidden_arg}"')
    if ForwardPattern(finding.pattern).takes_encoder and finding.encoder_arg != "encoder_hidden_states":
        args.append(f'encoder_arg="{finding.encoder_arg}"')
    if finding.overrides:
        pairs = ", ".join(f"{i}: ForwardPattern.P{p}" for i, p in sorted(finding.overrides.items()))
        args.append(f"pattern_overrides={{{pairs}}}")
    return f"{indent}BlockGroup({', '.join(args)})"


def _fused_text(report: InspectReport) -> str:
    """The proposed adapter's ``fused_projections=`` argument (empty when no block shares an input)."""
    if not report.fused_projections:
        return ""
    lines = ["    fused_projections={"]
    for path, groups in report.fused_projections.items():
        members = ", ".join("(" + ", ".join(f'"{m}"' for m in group) + ")" for group in groups)
        lines.append(f'        "{path}": ({members},),')
    return "\n".join(lines) + "\n    },\n"


def propose_adapter(report: InspectReport, target: Target, trace: Trace) -> str:
    """A ``ModelAdapter(...)`` for an unregistered model, as Python source."""
    findings = {g.path: g for g in report.groups}
    groups = [findings[p] for p in report.main_groups]
    companions = {g.interleaved_with for g in groups if g.interleaved_with}
    lines = []
    for finding in groups:
        if finding.path in companions and finding.interleaved_with not in companions:
            continue
        text = _group_text(finding, "        ")
        partner = findings.get(finding.interleaved_with or "")
        if partner is not None and partner.pattern is not None and finding.path not in companions:
            text = text[:-1] + f", interleaved={_group_text(partner, '').strip()})"
        lines.append(text + ",")
    timestep = next((n for n in trace.root_arguments if n in TIME_ARGS), None)
    family = target.cls.__name__.lower()
    cp, tp = (d.strategy if d else "-" for d in (report.cp, report.tp))
    timestep_text = f'"{timestep}"' if timestep else "None"
    body = "\n".join(lines) or "        # no block list was detected"
    return (
        "from fastdit.models.base import BlockGroup, ForwardPattern, ModelAdapter\n\n"
        "ADAPTER = ModelAdapter(\n"
        f'    family="{family}",\n'
        f'    transformer_classes=("{qualified_name(target.cls)}",),\n'
        f"    block_groups=(\n{body}\n    ),\n"
        f"    timestep_arg={timestep_text},\n"
        f"{_fused_text(report)}"
        ")\n"
        f"# CP sketch: {cp}; TP sketch: {tp} (see the CP and TP sections of this report)\n"
    )
