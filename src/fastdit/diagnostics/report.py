"""Render an :class:`~fastdit.diagnostics.inspect.InspectReport` as text (the JSON form is its ``to_dict``)."""

from __future__ import annotations

from fastdit.diagnostics.decide import Decision
from fastdit.diagnostics.inspect import InspectReport

__all__ = ["render_text"]


def _section(title: str, lines: list[str]) -> list[str]:
    return [f"\n{title}", *(f"  {line}" for line in lines or ["(none)"])]


def _groups(report: InspectReport) -> list[str]:
    lines = []
    for g in report.groups:
        main = " [main]" if g.path in report.main_groups else ""
        if g.pattern is None:
            lines.append(f"{g.path}: {g.num_blocks} x {g.block_class}, not a block list ({'; '.join(g.evidence)})")
            continue
        lines.append(
            f"{g.path}{main}: {g.num_blocks} x {g.block_class}, P{g.pattern}, hidden={g.hidden_arg}, "
            f"encoder={g.encoder_arg or '-'}, returns {g.returns}"
        )
        lines.append(f"    positional: {', '.join(g.positional) or '-'}; keyword: {', '.join(g.keyword) or '-'}")
        lines.append(f"    evidence: {'; '.join(g.evidence)}")
    return lines


def _attention(report: InspectReport) -> list[str]:
    lines = []
    for a in report.attention:
        lines.append(
            f"{a.path} ({a.cls} x{a.count}): heads={a.heads} kv_heads={a.kv_heads} head_dim={a.head_dim}"
            f"{' GQA' if a.gqa else ''}{' cross' if a.cross else ''}"
            f"; fused={','.join(a.fused) or '-'}; qk_norm={a.qk_norm or '-'}"
            f"; head attributes={','.join(a.head_attributes) or '-'}"
        )
    lines += [f"modulation {m.path}: {m.in_features} -> {m.out_features} (x{m.multiple:g})" for m in report.modulation]
    return lines


def _sequence(report: InspectReport) -> list[str]:
    seq = report.sequence
    lines = [f"lengths (traced): {seq.lengths or '-'}"]
    lines.append(f"sequence built inside forward: {'yes' if seq.built_inside else 'no (root input carries it)'}")
    lines += [f"root input {r}" for r in seq.root_inputs]
    lines += [f"made by {p}" for p in seq.producers]
    lines += [f"{g} arg {a}" for g, args in seq.block_args.items() for a in args]
    lines += [f"mask {m}" for m in seq.root_masks + seq.masks] or ["masks: none"]
    return lines


def _divisibility(report: InspectReport) -> list[str]:
    if not report.divisibility:
        return []
    keys = list(next(iter(report.divisibility.values())))
    header = "degree  " + "  ".join(f"{k:>10}" for k in keys)
    rows = [header]
    for d, row in report.divisibility.items():
        rows.append(f"{d:>6}  " + "  ".join(f"{'yes' if row[k] else 'no':>10}" for k in keys))
    return rows


def _decision(decision: Decision | None) -> list[str]:
    if decision is None:
        return []
    lines = [f"strategy: {decision.strategy}", *(f"why: {r}" for r in decision.reasons)]
    if decision.per_degree:
        lines.append("per degree: " + ", ".join(f"{d}={v}" for d, v in decision.per_degree.items()))
    return lines + [f"- {d}" for d in decision.details]


def render_text(report: InspectReport) -> str:
    """The human-readable report."""
    head = [
        f"fastdit inspect {report.target}",
        f"  class: {report.transformer_class}",
        f"  family: {report.family or '(unregistered)'}",
        f"  structure: {report.config_source}"
        + (f" (meta build failed: {report.structure_note})" if report.structure_note else ""),
        f"  forward: {report.forward_source or '-'}"
        + (f" [FAILED: {report.forward_error}]" if report.forward_error else ""),
    ]
    loop = [
        f"{'WITHIN LIST' if c.within_group else 'hand-over'}: {c.after} -> {c.before}: {c.stream} {c.detail}"
        for c in report.loop_body
    ] + report.loop_body_index
    out = head
    out += _section("Block lists", _groups(report))
    out += _section("Work between block calls (loop body)", loop)
    out += _section("Attention", _attention(report) + [f"call {c}" for c in report.attention_calls])
    out += _section("Sequence, RoPE and masks", _sequence(report))
    out += _section("Divisibility (full-size heads, traced lengths)", _divisibility(report))
    out += _section("Context parallelism", _decision(report.cp))
    out += _section("Tensor parallelism", _decision(report.tp))
    fused = [f"{path}: {'; '.join('+'.join(g) for g in groups)}" for path, groups in report.fused_projections.items()]
    out += _section("Projections that share an input (fuse=True)", fused or ["none found"])
    if report.family:
        out += _section(f"Adapter '{report.family}' vs findings", report.comparison)
    if report.proposed_adapter:
        out += _section("Proposed adapter", report.proposed_adapter.rstrip().splitlines())
    return "\n".join(out) + "\n"
