"""Tensor-parallel plan pieces that several families share (still data: each returns a ``{path: style}`` dict).

Paths are relative to a block; a family prefixes them with its block list (``"transformer_blocks.*."``) through
:func:`under`. The usual split is Megatron's: the projections into heads and into the FFN's hidden size are
column-wise, the projections back to the model width row-wise, so each attention or FFN costs one all-reduce.
"""

from __future__ import annotations

from collections.abc import Mapping

from fastdit.parallel.tp_plan import Colwise, Rowwise, Style

__all__ = ["attention", "feed_forward", "joint_attention", "modulation", "under"]


def under(prefix: str, layers: Mapping[str, Style]) -> dict[str, Style]:
    """``layers`` with every path prefixed by ``prefix`` (e.g. ``"transformer_blocks.*"``)."""
    return {f"{prefix}.{path}": style for path, style in layers.items()}


def attention(
    attn: str = "attn", *, out: str = "to_out.0", qkv: tuple[str, ...] = ("to_q", "to_k", "to_v")
) -> dict[str, Style]:
    """A diffusers ``Attention``: q/k/v column-wise, the output projection row-wise."""
    return {**{f"{attn}.{name}": Colwise() for name in qkv}, f"{attn}.{out}": Rowwise()}


def joint_attention(attn: str = "attn", *, out: str = "to_add_out") -> dict[str, Style]:
    """An MMDiT attention: :func:`attention` for the image stream plus the text stream's ``add_*_proj`` and out."""
    added = {f"{attn}.add_{name}_proj": Colwise() for name in ("q", "k", "v")}
    return {**attention(attn), **added, f"{attn}.{out}": Rowwise()}


def feed_forward(ff: str = "ff", *, up: str = "net.0.proj", down: str = "net.2") -> dict[str, Style]:
    """A diffusers ``FeedForward`` (GELU / GEGLU / SwiGLU ``net.0.proj``, ``net.2`` back)."""
    return {f"{ff}.{up}": Colwise(), f"{ff}.{down}": Rowwise()}


def modulation(*linears: str) -> dict[str, Style]:
    """AdaLN modulation linears split column-wise with a gathered output (every rank needs the whole vector)."""
    return {path: Colwise(gather_output=True) for path in linears}
