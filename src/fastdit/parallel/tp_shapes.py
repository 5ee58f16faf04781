"""Tensor-parallel plan pieces that several families share (still data: each returns a ``{path: style}`` dict).

Paths are relative to a block; a family prefixes them with its block list (``"transformer_blocks.*."``) through
:func:`under`. The usual split is Megatron's: the projections into heads and into the FFN's hidden size are
column-wise, the projections back to the model width row-wise, so each attention or FFN costs one all-reduce.
"""

from __future__ import annotations

from collections.abc import Mapping

from fastdit.parallel.tp_plan import Colwise, Rowwise, ShardedNorm, Style, TensorParallelPlan

__all__ = ["attention", "feed_forward", "flux1_tp_plan", "joint_attention", "modulation", "under", "wan_tp_plan"]


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


def feed_forward(
    ff: str = "ff", *, up: str = "net.0.proj", down: str = "net.2", gated: bool = False
) -> dict[str, Style]:
    """A diffusers ``FeedForward``: ``net.0.proj`` column-wise, ``net.2`` row-wise.

    ``gated``: the up projection outputs ``[hidden | gate]`` that the activation chunks in two (GEGLU, SwiGLU,
    ``"linear-silu"``); each half is split on its own so every rank pairs its hidden features with their gates. A
    plain GELU (``"gelu"``, ``"gelu-approximate"``) is not gated.
    """
    return {f"{ff}.{up}": Colwise(segments=(1, 1)) if gated else Colwise(), f"{ff}.{down}": Rowwise()}


def modulation(*linears: str) -> dict[str, Style]:
    """AdaLN modulation linears split column-wise with a gathered output (every rank needs the whole vector)."""
    return {path: Colwise(gather_output=True) for path in linears}


def flux1_tp_plan(*, notes: str, modulated: bool = True, mlp_width: str = "mlp_hidden_dim") -> TensorParallelPlan:
    """FLUX.1's block lists: MMDiT ``transformer_blocks`` and parallel-attention ``single_transformer_blocks``.

    Joint attention and both FFNs of a double block split Megatron-style; a single block's q/k/v and ``proj_mlp``
    column-wise and its ``proj_out``, which reads ``cat([attn_out, mlp_hidden])``, row-wise with each part split on
    its own. The processors reshape with ``attn.heads``, which is divided; QK-norms are per head (replicated).

    Args:
        notes: The family's own words for the plan (what it keeps whole).
        modulated: The blocks carry their own AdaLN linears (``norm1.linear`` / ``norm1_context.linear``,
            ``norm.linear``), split with a gathered output.
        mlp_width: Attribute path (on the single block) of the MLP part's width in ``proj_out``'s input.
    """
    double = {**joint_attention(), **feed_forward("ff"), **feed_forward("ff_context")}
    single = {
        "attn.to_q": Colwise(),
        "attn.to_k": Colwise(),
        "attn.to_v": Colwise(),
        "proj_mlp": Colwise(),
        "proj_out": Rowwise(segments=("attn.inner_dim", mlp_width)),
    }
    if modulated:
        double.update(modulation("norm1.linear", "norm1_context.linear"))
        single.update(modulation("norm.linear"))
    return TensorParallelPlan(
        layers={**under("transformer_blocks.*", double), **under("single_transformer_blocks.*", single)},
        divide=("transformer_blocks.*.attn.heads", "single_transformer_blocks.*.attn.heads"),
        notes=notes,
    )


def _wan_block(prefix: str) -> tuple[dict[str, Style], tuple[str, ...]]:
    layers = {
        **under(prefix, attention("attn1")),
        **under(prefix, attention("attn2")),
        **under(prefix, feed_forward("ffn")),
    }
    optional = []
    for attn in ("attn1", "attn2"):
        for norm in ("norm_q", "norm_k"):
            layers[f"{prefix}.{attn}.{norm}"] = ShardedNorm()
    # Image-to-video models project the image tokens for cross-attention; text-to-video ones have none.
    image = {
        f"{prefix}.attn2.add_k_proj": Colwise(),
        f"{prefix}.attn2.add_v_proj": Colwise(),
        f"{prefix}.attn2.norm_added_k": ShardedNorm(),
    }
    layers.update(image)
    optional += list(image)
    return layers, tuple(optional)


def wan_tp_plan(*block_lists: str, notes: str) -> TensorParallelPlan:
    """The plan of a Wan-style video DiT (Wan 2.x, VACE, SkyReels-V2, ChronoEdit) over ``block_lists``.

    Self- and cross-attention split by heads; their QK-norms are RMSNorms over the whole inner dim (not per head),
    so they become :class:`ShardedNorm` (the mean square summed over the ranks) — a local norm would be silently
    wrong. The modulation is a per-block ``scale_shift_table`` added to one shared time projection: it stays whole.
    """
    layers: dict[str, Style] = {}
    optional: tuple[str, ...] = ()
    divide = []
    for blocks in block_lists:
        block_layers, block_optional = _wan_block(f"{blocks}.*")
        layers.update(block_layers)
        optional += block_optional
        divide += [f"{blocks}.*.attn1.heads", f"{blocks}.*.attn2.heads"]
    return TensorParallelPlan(layers=layers, divide=tuple(divide), optional=optional, notes=notes)
