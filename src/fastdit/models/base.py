"""The vocabulary a model adapter is written in: forward patterns, block groups, tiny pipelines, CLI presets.

An adapter is a declaration (data). Generic appliers (cache, parallel, ...) read it; an adapter never applies
anything itself.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from fastdit.attrs import is_pattern, resolve_attr

if TYPE_CHECKING:
    from fastdit.parallel.plan import ContextParallelPlan
    from fastdit.parallel.tp_plan import TensorParallelPlan

__all__ = [
    "NO_LATENT",
    "BlockGroup",
    "CachePlan",
    "ForwardPattern",
    "LatentLayout",
    "ModelAdapter",
    "ModelPreset",
    "StepInvariant",
    "TinyPipeline",
    "resolve_attr",
]


class ForwardPattern(enum.IntEnum):
    """What a transformer block takes and returns.

    ====  ==================  ====================
    id    inputs              outputs
    ====  ==================  ====================
    0     (hidden, encoder)   (hidden, encoder)
    1     (hidden, encoder)   (encoder, hidden)
    2     (hidden, encoder)   hidden
    3     hidden              hidden
    4     hidden              (hidden, encoder)
    5     hidden              (encoder, hidden)
    ====  ==================  ====================
    """

    P0 = 0
    P1 = 1
    P2 = 2
    P3 = 3
    P4 = 4
    P5 = 5

    @property
    def takes_encoder(self) -> bool:
        """Whether the block receives the encoder (text) stream as an input."""
        return self in (ForwardPattern.P0, ForwardPattern.P1, ForwardPattern.P2)

    @property
    def returns_encoder(self) -> bool:
        """Whether the block returns the encoder stream alongside the hidden states."""
        return self in (ForwardPattern.P0, ForwardPattern.P1, ForwardPattern.P4, ForwardPattern.P5)

    @property
    def encoder_first(self) -> bool:
        """Whether the returned tuple puts the encoder stream first."""
        return self in (ForwardPattern.P1, ForwardPattern.P5)

    def pack(self, hidden: torch.Tensor, encoder: torch.Tensor | None) -> Any:
        """Build a block's return value in this pattern's layout."""
        if not self.returns_encoder:
            return hidden
        return (encoder, hidden) if self.encoder_first else (hidden, encoder)

    def unpack(self, output: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Split a block's return value into ``(hidden, encoder)`` (encoder is ``None`` if not returned).

        Blocks that return more values than the pattern names (e.g. an extra mask) keep only the first two here;
        callers that must preserve extras use :meth:`extras`.
        """
        if not self.returns_encoder:
            if isinstance(output, torch.Tensor):
                return output, None
            return output[0], None
        first, second = output[0], output[1]
        return (second, first) if self.encoder_first else (first, second)

    def extras(self, output: Any) -> tuple[Any, ...]:
        """Values a block returned beyond the ones the pattern names (passed through unchanged)."""
        if isinstance(output, torch.Tensor):
            return ()
        named = 2 if self.returns_encoder else 1
        return tuple(output[named:])


@dataclass(frozen=True)
class StepInvariant:
    """A module outside the blocks whose output repeats at every step while its inputs do (the pipeline passes the
    same tensors each step): step caching serves its later calls from the first one's output
    (:mod:`fastdit.cache.reuse`).

    Declare only modules whose output is a function of the inputs named here (no randomness, no state of their own
    that changes between calls).

    Attributes:
        module: Its dotted path in the transformer; a ``*`` component matches any one component
            (``"caption_projection.*"``: one module per block, as many as the config has), each served on its own.
        inputs: The transformer ``forward`` arguments its output is computed from, when the module's own arguments
            are built from them inside ``forward`` (a new tensor every call); ``()``: its own arguments.
    """

    module: str
    inputs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.module:
            raise ValueError("StepInvariant.module='': name the module's path in the transformer")


@dataclass(frozen=True, kw_only=True)
class BlockGroup:
    """One list of transformer blocks (a ``ModuleList`` attribute) and how its blocks are called.

    Attributes:
        path: Dotted attribute path from the transformer to the ``ModuleList`` (e.g. ``"transformer_blocks"``). A
            path with ``*`` components (``"down_blocks.*.attentions.*.transformer_blocks"``) stands for every
            ``ModuleList`` it matches, each a block list of its own with this group's pattern and arguments, in
            module order; it may match none (a UNet whose transformer stacks depend on its config).
        pattern: The blocks' :class:`ForwardPattern`.
        hidden_arg: Name of the hidden-states parameter in the block's ``forward``.
        encoder_arg: Name of the encoder-states parameter (patterns 0-2 only).
        interleaved: Another block list whose block ``i`` the model's loop runs right after block ``i`` of this one
            (e.g. Latte's temporal blocks between its spatial blocks). It is not a cache group of its own: a cached
            step that passes block ``i`` of this list through passes block ``i`` of that list through too, since the
            segment's cached residual replaces whatever it computed. Same length as this list. Not with a ``*`` path.
        pattern_overrides: Blocks of this list that are called or return differently from the others, by index
            (negative counts from the end), e.g. ``{-1: ForwardPattern.P2}`` for a last block that returns only the
            hidden states while the others return ``(encoder, hidden)``. Given as a mapping; kept as sorted pairs.
        optional: The list may be missing from some transformers the adapter serves (a family serving both a UNet
            and the bare transformer its stacks are made of): skipped where :attr:`path` does not exist. A
            transformer must still have at least one block list.
    """

    path: str
    pattern: ForwardPattern
    hidden_arg: str = "hidden_states"
    encoder_arg: str = "encoder_hidden_states"
    interleaved: BlockGroup | None = None
    pattern_overrides: Mapping[int, ForwardPattern] | tuple[tuple[int, ForwardPattern], ...] = ()
    optional: bool = False

    def __post_init__(self) -> None:
        if not self.path or any(not part for part in self.path.split(".")):
            raise ValueError(f"BlockGroup.path={self.path!r}: must be a dotted attribute path")
        object.__setattr__(self, "pattern", ForwardPattern(self.pattern))
        if self.interleaved is not None and self.interleaved.interleaved is not None:
            raise ValueError(f"BlockGroup.interleaved of {self.path!r}: an interleaved list cannot nest another")
        if self.interleaved is not None and (is_pattern(self.path) or is_pattern(self.interleaved.path)):
            raise ValueError(f"BlockGroup.interleaved of {self.path!r}: not with a '*' path (lists pair one to one)")
        if not isinstance(self.optional, bool):
            raise ValueError(f"BlockGroup.optional={self.optional!r} of {self.path!r}: expected a bool")
        items = (
            self.pattern_overrides.items() if isinstance(self.pattern_overrides, Mapping) else self.pattern_overrides
        )
        overrides = []
        for index, pattern in items:
            if isinstance(index, bool) or not isinstance(index, int):
                raise ValueError(f"BlockGroup.pattern_overrides of {self.path!r}: index {index!r} is not an int")
            try:
                overrides.append((index, ForwardPattern(pattern)))
            except ValueError:
                raise ValueError(
                    f"BlockGroup.pattern_overrides of {self.path!r}: {pattern!r} at index {index} is not a "
                    "ForwardPattern"
                ) from None
        object.__setattr__(self, "pattern_overrides", tuple(sorted(overrides)))

    def pattern_at(self, index: int, count: int) -> ForwardPattern:
        """The pattern of block ``index`` of this list of ``count`` blocks (an override, or :attr:`pattern`).

        Raises:
            ValueError: an override's index is outside the list, or two overrides name the same block.
        """
        resolved: dict[int, ForwardPattern] = {}
        for i, pattern in self.pattern_overrides:
            j = i + count if i < 0 else i
            if not 0 <= j < count:
                raise ValueError(
                    f"BlockGroup.pattern_overrides of {self.path!r}: index {i} is outside the list of {count} blocks"
                )
            if j in resolved:
                raise ValueError(f"BlockGroup.pattern_overrides of {self.path!r}: block {j} is named twice")
            resolved[j] = pattern
        return resolved.get(index, self.pattern)


@dataclass(frozen=True, kw_only=True)
class TinyPipeline:
    """A complete random-weight pipeline of a family, small enough for CPU tests.

    Attributes:
        name: Variant name, unique within the family (e.g. ``"t2v"``).
        build: Builds the pipeline (deterministic: seeded, ``.eval()``) with no network access.
        call_kwargs: Keyword arguments for a short run (prompt, size, ``num_inference_steps=2``, ...); callers add
            ``generator`` and ``output_type``.
    """

    name: str
    build: Callable[[], Any]
    call_kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class ModelPreset:
    """A model the CLI can load by name (``fastdit generate <name>``).

    Attributes:
        name: Registry name, e.g. ``"flux"``.
        pipeline_class: Fully qualified pipeline class, e.g. ``"diffusers.FluxPipeline"``.
        hub_id: The usual Hub repository id (documentation only: fastdit never downloads).
        defaults: Default call arguments (steps, guidance, size, frames).
    """

    name: str
    pipeline_class: str
    hub_id: str = ""
    defaults: Mapping[str, Any] = field(default_factory=dict)

    @property
    def env_var(self) -> str:
        """Environment variable holding the local weights directory, e.g. ``FLUX_DIR``."""
        return self.name.upper().replace("-", "_").replace(".", "_") + "_DIR"


@dataclass(frozen=True, kw_only=True)
class LatentLayout:
    """Where a transformer's noisy latent arrives, laid out on its grid (what TeaCache's spectral signal filters).

    Attributes:
        arg: The transformer ``forward`` parameter carrying the latent (one tensor; a list of per-sample tensors has
            no layout to declare).
        channel_dim: Its channel axis (negative counts from the end: ``-1`` for channels last); every other axis
            after the batch (axis 0) is a grid axis (frames, height, width) unless :attr:`item_dims` names it. A
            latent packed into a token sequence has no grid to declare.
        item_dims: Axes that hold separate pictures rather than a grid (JoyImage-Edit's ``(batch, items, channels,
            frames, height, width)``: the reference image's latent and the noise side by side): each item is
            filtered on its own, like a batch entry, so the filter never mixes one item into another.
    """

    arg: str = "hidden_states"
    channel_dim: int = 1
    item_dims: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.arg:
            raise ValueError("LatentLayout.arg='': must name a forward parameter")
        if not _is_axis(self.channel_dim):
            raise ValueError(f"LatentLayout.channel_dim={self.channel_dim!r}: must be an integer axis other than 0")
        items = tuple(self.item_dims) if isinstance(self.item_dims, (tuple, list)) else None
        if items is None or not all(_is_axis(d) for d in items) or len(set(items)) != len(items):
            raise ValueError(f"LatentLayout.item_dims={self.item_dims!r}: must be distinct integer axes other than 0")
        if self.channel_dim in items:
            raise ValueError(f"LatentLayout.item_dims={items!r}: the channel axis {self.channel_dim} is no item axis")
        object.__setattr__(self, "item_dims", items)

    def describe(self) -> str:
        """The layout in words, for messages and tables (``hidden_states, channels at dim 1``)."""
        items = f", items at dim {', '.join(map(str, self.item_dims))}" if self.item_dims else ""
        return f"{self.arg}, channels at dim {self.channel_dim}{items}"


def _is_axis(value: Any) -> bool:
    """Whether ``value`` can name a latent axis other than the batch (an int, not a bool, not 0)."""
    return isinstance(value, int) and not isinstance(value, bool) and value != 0


@dataclass(frozen=True, kw_only=True)
class CachePlan:
    """What step caching needs of a family: its block lists and where the timestep arrives.

    Attributes:
        family: Family name (for messages).
        block_groups: The block lists, in execution order.
        timestep_arg: The transformer ``forward`` parameter carrying the timestep (``None``: not read).
        unstepped_calls: As :attr:`ModelAdapter.unstepped_calls`.
        timestep_reduce: As :attr:`ModelAdapter.timestep_reduce`.
        latent: As :attr:`ModelAdapter.latent`.
        no_latent: Why the family declares no latent (:attr:`ModelAdapter.no_latent`), for the refusal.
        step_invariant: As :attr:`ModelAdapter.step_invariant`.
    """

    family: str
    block_groups: tuple[BlockGroup, ...]
    timestep_arg: str | None = "timestep"
    unstepped_calls: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    timestep_reduce: str = "max"
    latent: LatentLayout | None = None
    no_latent: str = ""
    step_invariant: tuple[StepInvariant, ...] = ()


NO_LATENT = "No spectral signal:"
"""The marker in :attr:`ModelAdapter.notes` before the reason a family declares no latent (one sentence)."""


@dataclass(frozen=True, kw_only=True)
class ModelAdapter:
    """Everything fastdit needs to know about one transformer family.

    Attributes:
        family: Family name (also the module name under ``fastdit.models``).
        transformer_classes: Fully qualified names of the transformer classes this adapter serves (exact match).
        block_groups: The block lists, in execution order.
        timestep_arg: Name of the transformer ``forward`` parameter carrying the timestep (used to tell steps and
            runs apart when the pipeline does not announce them).
        patch: Optional PatchFunctor: a callable ``patch(transformer) -> undo`` applying the minimal change the
            generic runner needs (documented in the family file), returning a function that reverts it.
        tiny_pipelines: Offline random-weight pipelines for tests and demos.
        presets: Models of this family the CLI can load by name.
        notes: Free text for ``docs/models.md`` (limitations, why a feature is unsupported).
        cp_plan: Where the family splits and gathers its sequence under context parallelism
            (:class:`~fastdit.parallel.plan.ContextParallelPlan`); ``None``: context parallelism is unsupported.
        cfg_parallel: Whether CFG parallelism is verified for the family (``False``: refused, the reason in ``notes``
            after "No CFG parallelism:").
        cfg_pairs_by_timestep: The family's pipelines run their CFG branches as two calls per step without announcing
            them, and use neither call's output before the other call: CFG parallelism pairs them by timestep.
        cfg_batch_dims: Forward arguments whose batch is not their dim 0 (arg → dim; ``None``: no batch dim), for
            batched CFG parallelism.
        cfg_branch_components: The family's pipelines compute each guidance branch with its own denoiser, called once
            per step each (pipeline component name → ``"cond"`` / ``"uncond"``; Ideogram 4's ``transformer`` and
            ``unconditional_transformer``): CFG parallelism runs each denoiser on its branch's rank.
        tp_plan: How the family's layers split under tensor parallelism
            (:class:`~fastdit.parallel.tp_plan.TensorParallelPlan`); ``None``: tensor parallelism is unsupported.
        unstepped_calls: ``forward`` arguments whose value marks a call that is no denoising step, argument name ->
            the values that mark it: Wan-Animate-2's reference pass (``kv_cache_mode="extract"``) fills a KV cache
            that every step then reads, at the first step's timestep. A mark is a plain value, a ``dict`` (marking a
            ``dict`` argument holding all its entries: AnyFlow-FAR's KV-cache prefill,
            ``{"kv_cache_flag": ({"is_cache_step": True},)}``) or a function of the argument returning ``True`` for
            such a call (GLM-Image's ``kv_caches`` object in its write mode). Such a call computes every block (the
            cache never serves it) and step caching does not count it: no step, branch or run of its own; under CFG
            parallelism every rank computes it (it belongs to no branch).
        timestep_reduce: Which entry of a timestep tensor with several (one per token, frame or row group) follows
            the schedule: ``"max"`` (conditioning tokens pinned at 0, the usual case) or ``"min"`` (MiniMax-H3, whose
            keyframe rows stay pinned near clean on a rising schedule).
        latent: Where the transformer's noisy latent arrives on its grid (:class:`LatentLayout`), for TeaCache's
            spectral signal; ``None``: not declared (a latent packed into tokens, or not checked yet), and that
            signal is refused, with the reason ``notes`` gives after "No spectral signal:" (:attr:`no_latent`).
        example: ``module.path:function`` giving a small transformer and one call of it, ``(model, kwargs)``, for
            ``fastdit inspect`` of a family without a tiny pipeline (one served by a pipeline fastdit does not build,
            e.g. a diffusers ModularPipeline); ``""``: the first tiny pipeline's first transformer call is used.
        host_reading_modules: Names of the transformer's modules outside its blocks that read tensor values on the
            host and size their outputs by them (Lumina 2's RoPE embedder turns the prompt mask's lengths into
            Python lists): a CUDA graph would freeze those values, so a graph of the whole call is refused up front
            (graphs per block leave these modules eager).
        step_invariant: Modules outside the blocks whose output repeats at every step of a run
            (:class:`StepInvariant`): while a cache is installed their later calls are served from the first.
        fused_projections: Linear layers each block applies to one tensor, which :class:`~fastdit.config.Fuse`
            computes as one matmul per group: block-list path (a :attr:`block_groups` path or an interleaved one)
            → groups of member paths relative to one block (``{"single_transformer_blocks": (("proj_mlp",
            "attn.to_q", "attn.to_k", "attn.to_v"),)}``); members with a ``*`` component stand for one group per
            match, the stars filled alike (``("ff.experts.*.w1", "ff.experts.*.w3")``: each routed expert's pair);
            empty: the family declares none and fusion is refused.
    """

    family: str
    transformer_classes: tuple[str, ...]
    block_groups: tuple[BlockGroup, ...]
    timestep_arg: str | None = "timestep"
    patch: Callable[[torch.nn.Module], Callable[[], None]] | None = None
    tiny_pipelines: tuple[TinyPipeline, ...] = ()
    presets: tuple[ModelPreset, ...] = ()
    notes: str = ""
    cp_plan: ContextParallelPlan | None = None
    tp_plan: TensorParallelPlan | None = None
    cfg_parallel: bool = True
    cfg_pairs_by_timestep: bool = False
    cfg_batch_dims: Mapping[str, int | None] = field(default_factory=dict)
    cfg_branch_components: Mapping[str, str] = field(default_factory=dict)
    unstepped_calls: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    timestep_reduce: str = "max"
    latent: LatentLayout | None = None
    example: str = ""
    host_reading_modules: tuple[str, ...] = ()
    step_invariant: tuple[StepInvariant, ...] = ()
    fused_projections: Mapping[str, tuple[tuple[str, ...], ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.family:
            raise ValueError("ModelAdapter.family='': must be non-empty")
        if not self.transformer_classes:
            raise ValueError(f"ModelAdapter.transformer_classes=() for family {self.family!r}: name at least one")
        if not self.block_groups:
            raise ValueError(f"ModelAdapter.block_groups=() for family {self.family!r}: name at least one")
        if self.timestep_reduce not in ("max", "min"):
            raise ValueError(
                f"ModelAdapter.timestep_reduce={self.timestep_reduce!r} for family {self.family!r}: must be 'max' or "
                "'min'"
            )
        names = [t.name for t in self.tiny_pipelines]
        if len(set(names)) != len(names):
            raise ValueError(f"ModelAdapter.tiny_pipelines for {self.family!r}: duplicate names {names}")
        self._check_fused_projections()

    def _check_fused_projections(self) -> None:
        lists = {g.path for g in self.block_groups} | {g.interleaved.path for g in self.block_groups if g.interleaved}
        for path, groups in self.fused_projections.items():
            where = f"ModelAdapter.fused_projections[{path!r}] of {self.family!r}"
            if path not in lists:
                raise ValueError(f"{where}: not a block list of the adapter ({sorted(lists)})")
            if not isinstance(groups, tuple) or not groups:
                raise ValueError(f"{where}: expected a non-empty tuple of member tuples")
            for members in groups:
                valid = isinstance(members, tuple) and all(isinstance(m, str) and m for m in members)
                if not valid or len(members) < 2 or len(set(members)) != len(members):
                    raise ValueError(f"{where}: group {members!r} must name two or more distinct layers")
                if len({m.split(".").count("*") for m in members}) != 1:
                    raise ValueError(f"{where}: group {members!r}: every member needs as many '*' as the first")

    @property
    def cache_plan(self) -> CachePlan:
        """The part of this adapter step caching reads."""
        return CachePlan(
            family=self.family,
            block_groups=self.block_groups,
            timestep_arg=self.timestep_arg,
            unstepped_calls=self.unstepped_calls,
            timestep_reduce=self.timestep_reduce,
            latent=self.latent,
            no_latent=self.no_latent,
            step_invariant=self.step_invariant,
        )

    @property
    def no_latent(self) -> str:
        """Why the family declares no latent: the sentence of :attr:`notes` after "No spectral signal:" (``""``)."""
        notes = " ".join(self.notes.split())
        if self.latent is not None or NO_LATENT not in notes:
            return ""
        rest = notes[notes.index(NO_LATENT) + len(NO_LATENT) :].strip()
        end = rest.find(". ")  # one sentence: the notes may go on with other markers
        return rest if end < 0 else rest[: end + 1]

    def tiny(self, name: str | None = None) -> TinyPipeline:
        """Return the tiny pipeline called ``name`` (the first one if ``None``)."""
        if not self.tiny_pipelines:
            raise LookupError(f"family {self.family!r} declares no tiny pipeline")
        if name is None:
            return self.tiny_pipelines[0]
        for tiny in self.tiny_pipelines:
            if tiny.name == name:
                return tiny
        raise LookupError(
            f"family {self.family!r} has no tiny pipeline {name!r}; known: {[t.name for t in self.tiny_pipelines]}"
        )


def qualified_name(cls: type) -> str:
    """``module.QualName`` of a class: the exact key adapters are registered under."""
    return f"{cls.__module__}.{cls.__qualname__}"
