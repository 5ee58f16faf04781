"""Plan shapes that several families share, built from the plan vocabulary (still data, still one call per family).

:func:`mmdit_root_plan` is the plan of a two-stream MMDiT whose forward is "embed, blocks over [text, image], project
out" with every operation outside attention token-wise (FLUX.1, FLUX.2, Chroma, Ovis-Image, LongCat-Image, Bria
FIBO): the root's ``hidden_states`` and ``encoder_hidden_states`` are split on the token dim, and the position ids
``img_ids`` / ``txt_ids`` on theirs (``-2``: the 2-D ``(S, 3)`` ids and the deprecated 3-D ``(B, S, 3)`` ones), so
the RoPE that forward computes from them is exactly that of each rank's tokens. A mask built over the global
``[text, image]`` sequence is reordered into shard order in attention; the output projection is gathered.

:func:`wan_blocks_plan` is the plan of a Wan-style video DiT (Wan 2.x, ChronoEdit): forward patchifies and computes
RoPE from the full latent grid, then loops over blocks that take the tokens positionally, so the tokens are split at
``blocks.0`` and the ``rope`` module's (cos, sin) tables on their token dim; a per-token timestep ``(B, S)`` (Wan 2.2
TI2V) is split at the root so its modulation matches the tokens, a per-sample one passes whole. The text is
replicated: its processors pass ``parallel_config=None`` to cross-attention, which runs locally.

:func:`joint_first_block_plan` is the plan of a two-stream DiT whose forward builds the sequences itself (patch
embedding with added positions, register tokens) and whose joint attention has neither mask nor RoPE (SD3, AuraFlow,
CogView3): both streams are split at the first block's inputs, after the positions are added, so any split is exact.
"""

from __future__ import annotations

from collections.abc import Mapping

from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, SplitInput, SplitOutput, TokenSum

__all__ = [
    "TOKENS",
    "joint_first_block_plan",
    "linear_self_attention",
    "mmdit_root_plan",
    "streams",
    "wan_blocks_plan",
]

# A (B, S, D) token sequence split on its token dim; other tensors passed under the same name go whole.
TOKENS = SplitInput(dim=1, expected_dims=3)


def streams(*names: str) -> dict[str, SplitInput]:
    """``{name: TOKENS}`` for each name: the token streams a module takes (default: image and text)."""
    return dict.fromkeys(names or ("hidden_states", "encoder_hidden_states"), TOKENS)


def linear_self_attention(sums: tuple[TokenSum, ...]) -> AttentionRouting:
    """Linear self-attention in every block's ``attn1`` (``sums`` all-reduced), cross-attention ``attn2`` local."""
    return AttentionRouting(linear={"transformer_blocks.*.attn1": sums}, local=("transformer_blocks.*.attn2",))


def mmdit_root_plan(
    *modules: str,
    notes: str,
    outputs: Mapping[str, SplitOutput | tuple[SplitOutput, ...]] | None = None,
    gather_at: str = "proj_out",
) -> ContextParallelPlan:
    """The root-split plan of a two-stream MMDiT with ``img_ids`` / ``txt_ids`` position ids.

    Args:
        *modules: The Python modules whose ``dispatch_attention_fn`` the blocks' processors call.
        notes: One line for ``docs/models.md``.
        outputs: Extra sub-module outputs to split (e.g. per-block text projections that bypass the root).
        gather_at: The module whose output holds the image tokens before unpatchify.
    """
    return ContextParallelPlan(
        inputs={
            "": {
                "hidden_states": SplitInput(dim=1, expected_dims=3),
                "encoder_hidden_states": SplitInput(dim=1, expected_dims=3),
                "img_ids": SplitInput(dim=-2),
                "txt_ids": SplitInput(dim=-2),
            }
        },
        outputs=dict(outputs or {}),
        gather={gather_at: GatherOutput(dim=1, expected_dims=3)},
        attention=AttentionRouting(modules=modules, mask_segments=("encoder_hidden_states", "hidden_states")),
        notes=notes,
    )


def wan_blocks_plan(module: str, *, notes: str) -> ContextParallelPlan:
    """The plan of a Wan-style video DiT whose attention processors live in ``module``."""
    return ContextParallelPlan(
        inputs={
            "": {"timestep": SplitInput(dim=1, expected_dims=2)},
            "blocks.0": {"hidden_states": SplitInput(dim=1, expected_dims=3)},
        },
        outputs={"rope": (SplitOutput(dim=1, expected_dims=4, index=0), SplitOutput(dim=1, expected_dims=4, index=1))},
        gather={"proj_out": GatherOutput(dim=1, expected_dims=3)},
        attention=AttentionRouting(modules=(module,)),
        notes=notes,
    )


def joint_first_block_plan(
    first_block: str, *, notes: str, modules: tuple[str, ...] = (), sdpa_modules: tuple[str, ...] = ()
) -> ContextParallelPlan:
    """Split ``hidden_states`` and ``encoder_hidden_states`` at ``first_block`` and gather at ``proj_out``.

    Args:
        first_block: Path of the first block, e.g. ``"transformer_blocks.0"``.
        notes: One line for ``docs/models.md``.
        modules: Modules whose ``dispatch_attention_fn`` is routed.
        sdpa_modules: Modules whose processors call ``F.scaled_dot_product_attention`` directly.
    """
    return ContextParallelPlan(
        inputs={
            first_block: {
                "hidden_states": SplitInput(dim=1, expected_dims=3),
                "encoder_hidden_states": SplitInput(dim=1, expected_dims=3),
            }
        },
        gather={"proj_out": GatherOutput(dim=1, expected_dims=3)},
        attention=AttentionRouting(modules=modules, sdpa_modules=sdpa_modules),
        notes=notes,
    )
