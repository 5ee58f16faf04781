"""The context- and tensor-parallel decisions, each with its reason, from what inspection found.

CP: where to split (the root's inputs when they already carry the tokens; the first block's inputs when forward
builds the sequence itself; the outputs of the modules that make full-length tensors; hooks around sub-modules when
work between blocks may need the whole sequence), and Ulysses or ring per degree from the head counts. TP: full
attention + FFN when heads and key/value heads divide the degree, FFN-only when only the key/value heads do not, and
what must be divided, re-laid out or split alongside.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastdit.diagnostics.patterns import LoopBodyChange
from fastdit.diagnostics.sequence import SequenceFacts
from fastdit.diagnostics.structure import AttentionFacts, LinearFacts

__all__ = ["DEGREES", "Decision", "cp_decision", "divisibility", "main_attention", "tp_decision"]

DEGREES = tuple(range(2, 9))
"""The CP and TP degrees checked."""


@dataclass
class Decision:
    """One technique's answer.

    Attributes:
        strategy: The short answer (``"root split"``, ``"full attention+FFN"``, ...).
        reasons: Why, one line each.
        per_degree: Degree -> what it gets (``"ulysses"``, ``"ring"``, ``"full"``, ``"ffn-only"``, ``"none"``).
        details: Things the plan must contain (paths to split, attributes to divide).
    """

    strategy: str
    reasons: list[str] = field(default_factory=list)
    per_degree: dict[int, str] = field(default_factory=dict)
    details: list[str] = field(default_factory=list)


def main_attention(attention: list[AttentionFacts]) -> AttentionFacts | None:
    """The self-attention repeated most often (the blocks'), which sets the head counts."""
    selfs = [a for a in attention if not a.cross and a.heads] or [a for a in attention if a.heads]
    return max(selfs, key=lambda a: a.count, default=None)


def divisibility(attn: AttentionFacts | None, lengths: dict[str, int]) -> dict[int, dict[str, bool]]:
    """Per degree: whether heads, KV heads and each traced sequence length divide it."""
    table: dict[int, dict[str, bool]] = {}
    for d in DEGREES:
        row: dict[str, bool] = {}
        if attn and attn.heads:
            row["heads"] = attn.heads % d == 0
            row["kv_heads"] = (attn.kv_heads or attn.heads) % d == 0
        row.update({f"seq_{label}": n % d == 0 for label, n in lengths.items()})
        table[d] = row
    return table


def _split_strategy(seq: SequenceFacts, changes: list[LoopBodyChange], first_group: str | None) -> Decision:
    within = [c for c in changes if c.within_group and c.stream in ("hidden", "encoder")]
    if within:
        where = ", ".join(sorted({c.after for c in within})[:4])
        return Decision(
            "per-sub-module hooks",
            [
                f"the root's loop changes the streams between blocks (after {where}): split at the first block only "
                "if that work is token-wise, else hook the sub-modules whose inputs must be whole"
            ],
        )
    if not seq.built_inside:
        decision = Decision("root split", ["the root's hidden states already carry the tokens (dim 1)"])
        decision.details += [f"split root input {r}" for r in seq.root_inputs]
    else:
        decision = Decision(
            f"split at {first_group}.0",
            [
                "forward builds the sequence itself (patch embedding of a latent grid): the first block's inputs are "
                "the first place the whole token sequence exists"
            ],
        )
    made = [p for p in seq.producers if "seq@" in p]
    if made and not seq.built_inside:
        decision.strategy += " + split sub-module outputs"
        decision.reasons.append("modules make full-length tensors inside forward: split their outputs")
        decision.details += [f"split output of {p}" for p in made]
    inside = [a for args in seq.block_args.values() for a in args if a.endswith("computed in forward")]
    if inside and not seq.built_inside:
        decision.reasons.append(
            "some sequence-long block arguments are computed in forward, not by a module: split them at the first "
            "block, or patch the one method that makes them (hybrid)"
        )
    return decision


def cp_decision(
    seq: SequenceFacts, changes: list[LoopBodyChange], attn: AttentionFacts | None, first_group: str | None
) -> Decision:
    """Where to split and gather, and Ulysses or ring per degree."""
    decision = _split_strategy(seq, changes, first_group)
    for label, args in seq.block_args.items():
        decision.details += [f"{label}: sequence-long argument {a}" for a in args]
    if seq.masks or seq.root_masks:
        decision.reasons.append(
            "an attention mask is used: after the Ulysses all-to-all each rank holds tokens in shard order, so a "
            "mask over the global sequence must be reordered (AttentionRouting.mask_segments / mask_transform), "
            "never split"
        )
    if attn is None or not attn.heads:
        decision.reasons.append("no attention module found: no Ulysses head split to decide")
        return decision
    kv = attn.kv_heads or attn.heads
    for d in DEGREES:
        decision.per_degree[d] = "ulysses" if attn.heads % d == 0 and kv % d == 0 else "ring"
    ring = [d for d, v in decision.per_degree.items() if v == "ring"]
    decision.reasons.append(
        f"{attn.heads} query / {kv} key-value heads: Ulysses where both divide the degree"
        + (f"; ring (or uneven-head Ulysses) at {ring}" if ring else "")
    )
    return decision


def tp_decision(attention: list[AttentionFacts], modulation: list[LinearFacts]) -> Decision:
    """Full or FFN-only tensor parallelism per degree, and what the plan must divide or split."""
    attn = main_attention(attention)
    if attn is None or not attn.heads:
        return Decision("FFN-only", ["no attention module with a head count found: only the FFN linears split"])
    kv = attn.kv_heads or attn.heads
    per_degree = {d: "none" if attn.heads % d else "ffn-only" if kv % d else "full" for d in DEGREES}
    full = [d for d, v in per_degree.items() if v == "full"]
    decision = Decision("full attention+FFN" if 2 in full else "FFN-only", per_degree=per_degree)
    decision.reasons.append(f"{attn.heads} query heads, {kv} key-value heads: full attention TP at degrees {full}")
    if attn.gqa:
        ffn = [d for d, v in per_degree.items() if v == "ffn-only"]
        decision.reasons.append(
            f"GQA ({attn.heads}/{kv}): where the key-value heads do not divide ({ffn}), shard only the FFN "
            "(replicating attention is correct but usually slower than one GPU)"
        )
    for facts in attention:
        decision.details += [f"divide {facts.path}.{name}" for name in facts.head_attributes]
        if facts.fused:
            decision.details.append(
                f"{facts.path}: fused {', '.join(facts.fused)}: re-lay out per head before sharding"
            )
        if facts.qk_norm == "full inner dim":
            decision.details.append(
                f"{facts.path}: QK-norm over the full inner dim: it needs a sharded norm (statistics over all ranks)"
            )
    if modulation:
        decision.reasons.append(
            "AdaLN modulation linears widen a per-sample vector: split them column-wise with a gathered output"
        )
        decision.details += [f"modulation {m.path} ({m.in_features} -> {m.out_features})" for m in modulation]
    return decision
