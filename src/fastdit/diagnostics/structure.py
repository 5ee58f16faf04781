"""What a module tree says without running it: attention heads, fused projections, QK-norms, modulation linears.

Read on the full-size model (built on ``meta``), so head counts and widths are the real ones. Attention modules are
the modules with a query projection child (``to_q``, ``q_proj``, ...) or a fused one (``to_qkv``, ``qkv``, ...).
Modules repeated across the entries of a block list are reported once, under a ``*`` path
(``transformer_blocks.*.attn``), which is the path syntax of the CP and TP plans.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

__all__ = ["HEAD_COUNTS", "AttentionFacts", "LinearFacts", "attention_facts", "modulation_linears", "star_path"]

_Q = ("to_q", "q_proj", "q", "wq", "query", "to_query")
_K = ("to_k", "k_proj", "k", "wk", "key", "to_key")
_FUSED = ("to_qkv", "qkv", "qkv_proj", "wqkv")
_HEADS = ("heads", "num_heads", "n_heads", "num_attention_heads")
_KV_HEADS = ("kv_heads", "num_kv_heads", "num_key_value_heads", "n_kv_heads")
HEAD_COUNTS = frozenset(_HEADS + _KV_HEADS)
"""Attribute names that hold head counts (always divided under tensor parallelism)."""
_HEAD_DIM = ("head_dim", "dim_head", "attention_head_dim")
_QK_NORMS = ("norm_q", "norm_k", "q_norm", "k_norm", "query_norm", "key_norm")


def star_path(path: str) -> str:
    """``path`` with list indices replaced by ``*`` (``blocks.3.attn`` -> ``blocks.*.attn``)."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)", "*", path)


@dataclass
class AttentionFacts:
    """One attention module (or every copy of it across a block list).

    Attributes:
        path: Plan-style path (``*`` for list indices).
        cls: Class name.
        count: How many modules the path covers.
        heads, kv_heads, head_dim: Query heads, key/value heads, head width.
        gqa: Fewer key/value heads than query heads.
        cross: Keys are projected from a different width than queries (cross-attention to the text).
        fused: Names of fused projections (``to_qkv``: one linear for q, k, v; ``qkv+mlp`` packs the MLP in too).
        qk_norm: ``"per head"``, ``"full inner dim"`` or ``None``.
        head_attributes: Integer attributes holding head counts or widths (what tensor parallelism must divide).
    """

    path: str
    cls: str
    count: int
    heads: int | None
    kv_heads: int | None
    head_dim: int | None
    gqa: bool
    cross: bool
    fused: list[str] = field(default_factory=list)
    qk_norm: str | None = None
    head_attributes: list[str] = field(default_factory=list)


def _int_attr(module: torch.nn.Module, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _child_linear(module: torch.nn.Module, names: tuple[str, ...]) -> tuple[str, torch.nn.Linear] | None:
    for name in names:
        child = getattr(module, name, None)
        if isinstance(child, torch.nn.Linear):
            return name, child
    return None


def _norm_width(norm: torch.nn.Module) -> int | None:
    weight = getattr(norm, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.ndim == 1:
        return weight.shape[0]
    shape = getattr(norm, "normalized_shape", None) or getattr(norm, "dim", None)
    if isinstance(shape, (tuple, list)) and shape:
        return int(shape[-1])
    return shape if isinstance(shape, int) else None


def _named_fused(module: torch.nn.Module) -> tuple[str, torch.nn.Linear] | None:
    """The first fused q/k/v linear of an attention module (one with a ``processor``) under a model-specific name
    (JoyImage's ``img_attn_qkv``, PRX's ``img_qkv_proj``); packed q/k/v + MLP projections are not attention."""
    if getattr(module, "processor", None) is None:
        return None
    for name, child in module.named_children():
        if isinstance(child, torch.nn.Linear) and "qkv" in name and "mlp" not in name:
            return name, child
    return None


def _one(path: str, module: torch.nn.Module) -> AttentionFacts | None:
    q, fused = _child_linear(module, _Q), _child_linear(module, _FUSED)
    if q is None and fused is None:
        fused = _named_fused(module)
    if q is None and fused is None:
        return None
    heads = _int_attr(module, _HEADS)
    head_dim = _int_attr(module, _HEAD_DIM)
    q_out = q[1].out_features if q else None
    if head_dim is None and heads and q_out:
        head_dim = q_out // heads
    if heads is None and head_dim and q_out:
        heads = q_out // head_dim
    kv = _int_attr(module, _KV_HEADS)
    k = _child_linear(module, _K)
    if kv is None and head_dim and k:
        kv = k[1].out_features // head_dim
    names = [fused[0]] if fused else []
    if fused and heads and head_dim and kv is None:
        kv = (fused[1].out_features - heads * head_dim) // (2 * head_dim) or heads
    facts = AttentionFacts(
        path=star_path(path),
        cls=type(module).__name__,
        count=1,
        heads=heads,
        kv_heads=kv,
        head_dim=head_dim,
        gqa=bool(heads and kv and kv < heads),
        cross=bool(q and k and k[1].in_features != q[1].in_features),
        fused=names,
    )
    facts.qk_norm = _qk_norm(module, head_dim, heads)
    facts.head_attributes = _head_attributes(module, facts)
    return facts


def _qk_norm(module: torch.nn.Module, head_dim: int | None, heads: int | None) -> str | None:
    for name in _QK_NORMS:
        norm = getattr(module, name, None)
        width = _norm_width(norm) if isinstance(norm, torch.nn.Module) else None
        if width is None:
            continue
        if width == head_dim:
            return "per head"
        if heads and head_dim and width >= heads * head_dim // 2:
            return "full inner dim"
        return f"width {width}"
    return None


def _head_attributes(module: torch.nn.Module, facts: AttentionFacts) -> list[str]:
    if not (facts.heads and facts.head_dim):
        return []
    kv = facts.kv_heads or facts.heads
    sizes = {facts.heads, kv, facts.heads * facts.head_dim, kv * facts.head_dim}
    skip = {*_HEAD_DIM, "query_dim", "out_dim", "cross_attention_dim", "added_kv_proj_dim", "out_context_dim"}
    return sorted(
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and name not in skip
        and isinstance(value, int)
        and not isinstance(value, bool)
        and value in sizes
        and (name in _HEADS or name in _KV_HEADS or "dim" in name or "head" in name)
    )


def attention_facts(root: torch.nn.Module) -> list[AttentionFacts]:
    """Every attention module of ``root``, one entry per plan-style path."""
    merged: dict[str, AttentionFacts] = {}
    for path, module in root.named_modules():
        facts = _one(path, module) if path else None
        if facts is None or facts.heads is None:  # a query-like linear without heads is not attention
            continue
        if facts.path in merged:
            merged[facts.path].count += 1
        else:
            merged[facts.path] = facts
    # Packed q/k/v + MLP projections live on the block (Flux.2 single blocks): a "qkv" linear wider than 3 heads' worth.
    for path, module in root.named_modules():
        if (
            isinstance(module, torch.nn.Linear)
            and "qkv" in path.rpartition(".")[2]
            and "mlp" in path.rpartition(".")[2]
        ):
            parent = star_path(path.rpartition(".")[0])
            for facts in merged.values():
                if facts.path.startswith(parent) and "qkv+mlp" not in facts.fused:
                    facts.fused.append(f"qkv+mlp ({path.rpartition('.')[2]})")
    return list(merged.values())


@dataclass
class LinearFacts:
    """A modulation (AdaLN) linear: applied to a per-sample vector, widening it ``multiple`` times.

    Attributes:
        path: Plan-style path.
        in_features, out_features: Sizes on the full-size model.
        multiple: ``out_features / in_features`` (how many shift/scale/gate vectors it yields).
    """

    path: str
    in_features: int
    out_features: int
    multiple: float


def modulation_linears(root: torch.nn.Module, linear_inputs: dict[str, tuple[int, ...]]) -> list[LinearFacts]:
    """Linears of the blocks that the traced forward applied to ``(B, D)`` (or ``(B, 1, D)``) inputs.

    ``linear_inputs`` come from the tiny model; sizes are read from ``root`` (the full-size model) at the same path.
    """
    found: dict[str, LinearFacts] = {}
    modules = dict(root.named_modules())
    for path, shape in linear_inputs.items():
        per_sample = len(shape) == 2 or (len(shape) == 3 and shape[1] == 1)
        module = modules.get(path)
        if not per_sample or not isinstance(module, torch.nn.Linear) or module.out_features < 2 * module.in_features:
            continue
        star = star_path(path)
        found.setdefault(
            star,
            LinearFacts(star, module.in_features, module.out_features, module.out_features / module.in_features),
        )
    return list(found.values())
