"""The context-parallel plan vocabulary: where a transformer's sequence is split and gathered, as data.

A plan names module paths (``""`` is the transformer itself; ``"transformer_blocks.*"`` matches every entry of a
``ModuleList``) and says, for each:

* :class:`SplitInput` — split a ``forward`` argument (by name, whether passed by position or keyword) along a dim
  before the module runs. Splitting the root's inputs suits models whose forward is "embed, loop over blocks,
  project out" (Flux); splitting at ``blocks.0`` suits models that build the sequence inside forward. With
  ``segments``, an argument spanning several split inputs (a RoPE table over ``[image, text]``) is split per segment;
  with ``groups_of``, a dim that flattens groups of another split input's tokens (a per-token table repeated per
  sample, ``(B·N, ...)``) is split group by group.
* :class:`SplitOutput` — split what a sub-module *returns* (a RoPE or position-embedding module that produces
  full-length tensors inside forward).
* :class:`GatherInput` — all-gather a split ``forward`` argument before the module runs: a module inside the loop
  that needs every token (attention grouped by frame over a token split that need not follow frames); paired with a
  :class:`SplitOutput` of the same module, so the loop continues on this rank's shard.
* :class:`GatherOutput` — all-gather a module's output (or one element of a tuple output) along a dim (the output
  projection), so the transformer returns the full sequence on every rank.
* :class:`LeadingCount` — a ``forward`` argument that counts leading tokens of a split tensor (the first frame's
  tokens), narrowed to the tokens this rank holds.
* :class:`TrailingCount` — the same for a count of the *last* tokens (the current frames after prepended history).
* :class:`LocalExtent` — an integer ``forward`` argument giving a grid extent (rows, frames) of a split tensor,
  replaced by this rank's share.
* :class:`LengthLogBase` — a logarithm base that attention measures its (local) query length in, replaced so that
  the local length gives the global one's logarithm (proportional attention).
* :class:`Halo` — pad a (convolution) module's input with the neighbouring ranks' edge rows, crop its output.
* :class:`TokenSum` — a reduction over the tokens inside linear attention, summed over the ranks.
* :class:`HeadParallel` — an attention module whose processor runs unchanged on the whole sequence of this rank's
  heads: its q/k/v are exchanged from token shards to head shards where the named sub-modules return them, and back
  where the output projection takes them (processors that slice by global positions, build masks from the whole
  sequence or attend through a flex ``BlockMask``).
* :class:`AttentionRouting` — which Python modules' ``dispatch_attention_fn`` (or, for processors that call
  ``F.scaled_dot_product_attention`` themselves, ``F``) is routed to context-parallel attention, and which split
  tensors, concatenated, form the joint sequence a model-built attention mask indexes.

:func:`validate_plan` checks a plan against a module tree (on any device, ``meta`` included) before anything is
installed. :func:`fastdit.parallel.context_parallel.apply_context_parallel` applies it.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

import torch

__all__ = [
    "AttentionRouting",
    "ContextParallelPlan",
    "GatherInput",
    "GatherOutput",
    "Halo",
    "HeadParallel",
    "LeadingCount",
    "LengthLogBase",
    "LocalExtent",
    "SplitInput",
    "SplitOutput",
    "TokenSum",
    "TrailingCount",
    "head_parallel_paths",
    "linear_attention_paths",
    "local_attention_paths",
    "match_modules",
    "passes_whole",
    "split_class_filter",
    "validate_plan",
]


def _check_dim(owner: str, dim: Any, expected_dims: Any) -> None:
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise ValueError(f"{owner}.dim={dim!r}: must be an integer")
    if expected_dims is not None and (not isinstance(expected_dims, int) or expected_dims < 1):
        raise ValueError(f"{owner}.expected_dims={expected_dims!r}: must be a positive integer or None")


class Splitter(Protocol):
    """What an input spec's ``adjust`` uses: the context-parallel splitter of the current forward."""

    def split(
        self,
        tensor: Any,
        dim: int,
        expected_dims: int | None,
        name: str,
        unit: int = 1,
        keep_singleton: bool | None = None,
        allow_empty: bool = False,
    ) -> Any: ...

    def split_segments(
        self, tensor: Any, dim: int, expected_dims: int | None, name: str, segments: tuple[str, ...]
    ) -> Any: ...

    def split_groups(self, tensor: Any, dim: int, expected_dims: int | None, name: str, of: str) -> Any: ...
    def split_tail(self, tensor: Any, dim: int, expected_dims: int | None, name: str, of: str) -> Any: ...

    def count(self, value: Any, of: str, *, trailing: bool = False) -> Any: ...

    def extent(self, value: Any, of: str) -> Any: ...

    def log_base(self, value: Any, of: str) -> Any: ...

    def gather(self, tensor: Any, dim: int, expected_dims: int | None) -> Any: ...


_UNIT_ELEMENT = re.compile(r"^(\w+)\[(\d+)\]$")


def unit_argument(unit: str) -> tuple[str, int | None]:
    """The ``forward`` argument a :attr:`SplitInput.unit` entry names, and the tuple element (``"THW[1]"``) or None."""
    match = _UNIT_ELEMENT.match(unit)
    return (match[1], int(match[2])) if match else (unit, None)


@dataclass(frozen=True)
class SplitInput:
    """Split a ``forward`` argument along ``dim`` over the context-parallel ranks.

    A tuple or list argument (a ``(cos, sin)`` RoPE pair) has each of its tensors split alike, unless ``index``
    names the one element to split (e.g. per-token positions nested beside the frequency tables they index); so has
    a ``dict`` of tensors (RoPE tables by role, ``{"query": ..., "key": ...}``), whose keys are kept.

    With ``segments``, the argument is the concatenation along ``dim`` of the sequences of other split inputs of the
    same module path, in that order (a RoPE table built over ``[image, text]`` for a block that splits its image
    and text streams separately): each segment is cut at its own global length and split with the shard sizes that
    input got in this call, and the rank's pieces are concatenated, so the result lines up with the rank's
    ``[image_shard, text_shard]``. Applied after every plain split of the same module (it reads their split record).

    With ``groups_of``, the argument's ``dim`` flattens groups of the tokens of another split input (Latte's temporal
    blocks take a timestep repeated per token position, ``(B·N, 6·D)``, while the loop reshapes the rank's
    ``(B, N_local, ...)`` shard to ``(B·N_local, ...)`` rows, N-strided in the global order): each group of ``N`` rows
    (``N`` the global length of that input in this forward) is split with the shard sizes that input got, and the
    rank's pieces are concatenated group by group. Applied after every plain split of the same module; an input not
    split in this forward (its tokens are whole) leaves the argument whole.

    Attributes:
        dim: The sequence dim of the argument.
        expected_dims: Split only tensors with this many dims (others pass through whole: e.g. a timestep that is
            per token in one model variant and per sample in another). ``None``: any tensor.
        index: Element of a tuple/list argument to split (the others pass whole); ``None``: the argument itself.
        unit: Names of integer arguments of the same ``forward`` whose product is the split granularity: shards hold
            whole multiples of it (``("width",)``: whole rows of a flattened ``(height, width)`` grid, as a
            convolution over the grid needs). The size along ``dim`` must be a multiple of it. ``()``: single tokens.
            ``"name[i]"`` names element ``i`` of a tuple argument (SANA-WM's ``("THW[1]", "THW[2]")``: whole frames
            of a ``(frames, height, width)`` layout).
        keep_singleton: Whether a tensor of size 1 along ``dim`` passes whole, broadcasting over the tokens (a RoPE
            table of one row, a per-sample modulation where another variant of the model passes one per token):
            ``True`` always, ``False`` never (it is refused as too short for the ranks), ``None`` (default) unless
            it is laid out like a token stream (see :func:`passes_whole`).
        segments: Names of plain (unsegmented) :class:`SplitInput` s of the same path whose concatenation this
            argument spans; ``()``: one contiguous split.
        groups_of: Name of a plain :class:`SplitInput` of the plan (any path, split earlier in the same forward)
            whose global token count is the group size of ``dim``; ``None``: one contiguous split.
        tail_of: Name of a plain split input (of this path or an earlier module of the same forward) whose *last*
            tokens this argument lines up with, one for one: a per-token conditioning of the audio frames that the
            model adds after tokens it prepended itself (Stable Audio 3's memory tokens). Each rank takes the part
            of it that falls inside its own shard of that input (possibly none: a rank holding only prepended
            tokens gets an empty slice), so ``x[:, n_prepended_local:] + tail`` keeps working locally with the
            prepended count narrowed by a :class:`LeadingCount`. ``""``: not such an argument.
        allow_empty: Whether a sequence with fewer tokens than ranks is split anyway, the last ranks holding empty
            shards (``shard_sizes``: the first ``total`` ranks get one token each), instead of being refused as too
            short. For a stream that joins attention beside another split stream which every rank still holds tokens
            of (GLM-Image's glyph text: one token for the empty negative prompt, none in the condition-image pass),
            and whose every consumer inside the blocks works on zero tokens (linear layers, norms, concatenation).
            The decision reads global sizes only, so every rank takes it alike.
    """

    dim: int
    expected_dims: int | None = None
    index: int | None = None
    unit: tuple[str, ...] = ()
    keep_singleton: bool | None = None
    segments: tuple[str, ...] = ()
    groups_of: str | None = None
    tail_of: str = ""
    allow_empty: bool = False

    def __post_init__(self) -> None:
        _check_dim("SplitInput", self.dim, self.expected_dims)
        if isinstance(self.unit, str) or not all(isinstance(u, str) and u for u in self.unit):
            raise ValueError(f"SplitInput.unit={self.unit!r}: expected a tuple of argument names")
        object.__setattr__(self, "unit", tuple(self.unit))
        if isinstance(self.segments, str) or not all(isinstance(s, str) and s for s in self.segments):
            raise ValueError(f"SplitInput.segments={self.segments!r}: expected a tuple of split input names")
        object.__setattr__(self, "segments", tuple(self.segments))
        if self.groups_of is not None:
            if not isinstance(self.groups_of, str) or not self.groups_of:
                raise ValueError(f"SplitInput.groups_of={self.groups_of!r}: must name a split input")
            if self.segments or self.unit or self.tail_of:
                raise ValueError(
                    f"SplitInput.groups_of={self.groups_of!r}: cannot be combined with segments, unit or tail_of (a "
                    "grouped split takes its shard sizes from the input it names)"
                )
        if not isinstance(self.tail_of, str) or (self.tail_of and self.segments):
            raise ValueError(f"SplitInput.tail_of={self.tail_of!r}: a split input's name, not combined with segments")
        if not isinstance(self.allow_empty, bool):
            raise ValueError(f"SplitInput.allow_empty={self.allow_empty!r}: expected a bool")
        if self.allow_empty and self.segments:
            raise ValueError("SplitInput.allow_empty=True: a segment-wise split follows its segments' shards")

    @property
    def reads_record(self) -> bool:
        """Whether applying it reads this forward's split record (segment-wise, grouped and tail splits do, plain
        splits write it)."""
        return bool(self.segments or self.tail_of) or self.groups_of is not None

    def adjust(self, value: Any, splitter: Splitter, name: str, unit: int = 1) -> Any:
        """``value`` split per this spec; with :attr:`index`, only that element of a tuple/list argument."""

        def split(item: Any, label: str) -> Any:
            if self.groups_of is not None:
                return splitter.split_groups(item, self.dim, self.expected_dims, label, self.groups_of)
            if self.tail_of:
                return splitter.split_tail(item, self.dim, self.expected_dims, label, self.tail_of)
            if self.segments:
                return splitter.split_segments(item, self.dim, self.expected_dims, label, self.segments)
            if self.allow_empty:
                return splitter.split(item, self.dim, self.expected_dims, label, unit, self.keep_singleton, True)
            return splitter.split(item, self.dim, self.expected_dims, label, unit, self.keep_singleton)

        if self.index is None or not isinstance(value, (tuple, list)):
            return split(value, name)
        items = list(value)
        items[self.index] = split(items[self.index], f"{name}[{self.index}]")
        return type(value)(items)


def passes_whole(tensor: torch.Tensor, dim: int, keep_singleton: bool | None) -> bool:
    """Whether ``tensor``, of size 1 along its split dim ``dim``, is passed whole to every rank instead of split.

    One row along the split dim cannot be shared by two or more ranks. A table or vector of one row that the model
    broadcasts against the split stream (a one-row RoPE table, a per-sample timestep) is right whole on every rank.
    A token stream of one token is not: every rank would add that token to the joint sequence, and attention would
    weigh it once per rank. With ``keep_singleton=None`` a ``(B, S, D)`` tensor split on its token dim (3 dims, dim
    1 or -2: the layout of a stream, e.g. the text of a one-word prompt) is therefore still refused; every other
    layout broadcasts. The decision reads global sizes only, so every rank takes it alike.
    """
    if tensor.shape[dim] != 1:
        return False
    if keep_singleton is not None:
        return keep_singleton
    return not (tensor.ndim == 3 and dim % 3 == 1)


@dataclass(frozen=True)
class SplitOutput:
    """Split a module's output (or one element of a tuple output) along ``dim``.

    A tuple, list or ``dict`` output split whole (no ``index``) has each of its tensors split alike, as for
    :class:`SplitInput`.

    Attributes:
        dim: The sequence dim of the output.
        expected_dims: As for :class:`SplitInput`.
        index: Element of a tuple/list output to split; ``None`` if the output is a tensor.
        keep_singleton: As for :class:`SplitInput` (a RoPE module returning one row that broadcasts).
        like: Name of a plain :class:`SplitInput` of the plan (split earlier in the same forward) whose shard sizes
            the output takes, its length along ``dim`` being that input's global length: the output of a module that
            ran on the gathered sequence (:class:`GatherInput`) goes back to the shards of an input split in whole
            units (SANA-WM's frames), which a plain split of the length would not reproduce. An input not split in
            this forward leaves the output whole. ``""``: a plain split of the output's length.
    """

    dim: int
    expected_dims: int | None = None
    index: int | None = None
    keep_singleton: bool | None = None
    like: str = ""

    def __post_init__(self) -> None:
        _check_dim("SplitOutput", self.dim, self.expected_dims)
        if not isinstance(self.like, str):
            raise ValueError(f"SplitOutput.like={self.like!r}: expected the name of a split input, or ''")


@dataclass(frozen=True)
class GatherInput:
    """All-gather a split ``forward`` argument along ``dim`` before the module runs (shards may differ in length).

    For a module the loop calls between blocks that must see every token although the blocks hold a shard: Wan-Animate's
    face adapter attends frame by frame (``query.unflatten(1, (frames, -1))``), which a token shard that does not
    hold whole frames cannot do. The module then computes on the whole sequence, on every rank alike; a
    :class:`SplitOutput` of the same module (same dim) gives the loop this rank's shard of its output again, with the
    shard sizes any split of that length gets. Applied after every plain split of the same module.

    Attributes:
        dim: The sequence dim of the argument.
        expected_dims: Gather only tensors with this many dims (others pass whole); ``None``: any tensor.
    """

    dim: int
    expected_dims: int | None = None

    def __post_init__(self) -> None:
        _check_dim("GatherInput", self.dim, self.expected_dims)

    # Gathered after the plain splits of the same module (uneven shards read this forward's split record).
    reads_record = True

    def adjust(self, value: Any, splitter: Splitter, name: str, unit: int = 1) -> Any:
        """``value`` gathered from every rank's shard."""
        return splitter.gather(value, self.dim, self.expected_dims)


@dataclass(frozen=True)
class GatherOutput:
    """All-gather a module's output (or one element of a tuple output) along ``dim`` (shards may differ in length).

    Attributes:
        dim: The sequence dim of the output.
        expected_dims: As for :class:`SplitInput`.
        index: Element of a tuple/list output to gather (the others stay as they are, e.g. the text shard a dual-stream
            block returns beside the image tokens), or a tuple of elements to gather alike (both streams of a block
            split inside); ``None``: the output itself (also used when the output is not a tuple/list).
    """

    dim: int
    expected_dims: int | None = None
    index: int | tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        _check_dim("GatherOutput", self.dim, self.expected_dims)
        if isinstance(self.index, (tuple, list)):
            if (
                not self.index
                or len(set(self.index)) != len(self.index)
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in self.index)
            ):
                raise ValueError(f"GatherOutput.index={self.index!r}: expected distinct integers")
            object.__setattr__(self, "index", tuple(self.index))


@dataclass(frozen=True)
class LeadingCount:
    """A ``forward`` argument counting the leading tokens of a split tensor, narrowed to this rank's shard.

    Some blocks take a Python ``int`` ``n`` meaning "the first ``n`` tokens of the sequence" (HunyuanVideo-I2V
    modulates the first frame's tokens ``x[:, :n]`` differently). After a split, rank ``r`` holds the contiguous
    tokens ``[start_r, start_r + len_r)`` of that sequence, so it receives ``clamp(n - start_r, 0, len_r)``. The shards
    come from the split record of :attr:`of` in the current forward; if that tensor was not split in this forward
    (its tokens are whole), or the value is not an ``int`` (``None``, a tensor), the argument passes unchanged.
    Counts at a module are adjusted after every split of the same module.

    Attributes:
        of: Name of a :class:`SplitInput` of the plan whose tokens the count indexes (e.g. ``"hidden_states"``).
        position: Index of the argument among ``forward``'s positional arguments (``self`` not counted), for a
            ``forward`` that receives it through ``*args`` rather than by name; ``None``: from the signature. When the
            name is in the signature, ``position`` must agree with it.
    """

    of: str
    position: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.of, str) or not self.of:
            raise ValueError(f"LeadingCount.of={self.of!r}: must name a split input")
        if self.position is not None and (
            not isinstance(self.position, int) or isinstance(self.position, bool) or self.position < 0
        ):
            raise ValueError(f"LeadingCount.position={self.position!r}: must be a non-negative integer or None")

    reads_record = True  # narrowed from this forward's split record of ``of``

    def adjust(self, value: Any, splitter: Splitter, name: str, unit: int = 1) -> Any:
        """``value`` narrowed to this rank's shard of :attr:`of`."""
        return splitter.count(value, self.of)


@dataclass(frozen=True)
class TrailingCount(LeadingCount):
    """A ``forward`` argument counting the *last* tokens of a split tensor, narrowed to this rank's shard.

    Helios prepends history tokens to the current frames' tokens and passes the blocks ``original_context_length``,
    the number of current tokens at the end of the sequence (``torch.split(x, [len - n, n])``, ``x[:, -n:]``). Rank
    ``r``, holding the tokens ``[start_r, end_r)`` of a sequence of ``total``, receives how many of the last ``n``
    tokens it holds, ``clamp(end_r - (total - n), 0, len_r)``: they are the last ones of its shard too. Otherwise as
    :class:`LeadingCount` (same attributes, same pass-through of non-``int`` values and of an unsplit :attr:`of`).
    """

    def adjust(self, value: Any, splitter: Splitter, name: str, unit: int = 1) -> Any:
        """``value`` narrowed to this rank's shard of :attr:`of`, counted from its end."""
        return splitter.count(value, self.of, trailing=True)


@dataclass(frozen=True)
class LocalExtent:
    """An integer ``forward`` argument giving a grid extent of a split tensor, replaced by this rank's share.

    A block that reshapes its flattened tokens to a grid takes the grid's extents as ``int`` arguments (Sana's
    ``height`` and ``width``). When the tokens of :attr:`of` are split into whole multiples of the other extents
    (:attr:`SplitInput.unit`), rank ``r``, holding ``len_r`` of the ``total`` tokens, receives
    ``value * len_r // total`` (its rows). Every rank's share must be whole, otherwise every rank raises
    ``ValueError`` alike (the check uses all ranks' lengths). As for :class:`LeadingCount`, non-``int`` values and an
    :attr:`of` not split in this forward pass unchanged, and extents at a module are adjusted after its splits.

    With :attr:`index`, the argument is a tuple of extents (SANA-WM's ``HW = (frames, height, width)``) and only
    that element is replaced.

    Attributes:
        of: Name of a :class:`SplitInput` of the plan whose tokens the grid holds.
        position: As for :class:`LeadingCount`.
        index: Element of a tuple argument that is the extent; ``None``: the argument itself.
    """

    of: str
    position: int | None = None
    index: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.of, str) or not self.of:
            raise ValueError(f"LocalExtent.of={self.of!r}: must name a split input")
        if self.position is not None and (
            not isinstance(self.position, int) or isinstance(self.position, bool) or self.position < 0
        ):
            raise ValueError(f"LocalExtent.position={self.position!r}: must be a non-negative integer or None")
        if self.index is not None and (not isinstance(self.index, int) or isinstance(self.index, bool)):
            raise ValueError(f"LocalExtent.index={self.index!r}: must be an integer or None")

    reads_record = True  # narrowed from this forward's split record of ``of``

    def adjust(self, value: Any, splitter: Splitter, name: str, unit: int = 1) -> Any:
        """``value`` narrowed to this rank's shard of :attr:`of`."""
        if self.index is None:
            return splitter.extent(value, self.of)
        if not isinstance(value, (tuple, list)) or not -len(value) <= self.index < len(value):
            return value  # not the tuple of extents (e.g. None): passes unchanged, like any non-int extent
        items = list(value)
        items[self.index] = splitter.extent(items[self.index], self.of)
        return type(value)(items)


@dataclass(frozen=True)
class LengthLogBase:
    """A logarithm base ``b`` in which attention measures its query length, adjusted for the rank's shard.

    Proportional attention (Lumina-Next's ``base_sequence_length``) scales the scores by ``sqrt(log_b(S))``, with
    ``S`` read from the query tensor the processor receives: under a token split, this rank's length ``S_r``, not the
    global ``S``. Rank ``r`` receives ``b' = b ** (ln S_r / ln S)`` instead, so that ``log_b'(S_r) = log_b(S)``: the
    scale of the whole sequence (to float rounding). The lengths are those of :attr:`of` in this forward's split
    record; if it was not split (tokens whole), or the value is not a number (``None``: no proportional attention),
    the argument passes unchanged. A shard of one token has no logarithm to rescale: every rank raises
    :class:`~fastdit.errors.ShardError` alike.

    Attributes:
        of: The split whose tokens are the attention's queries: a :class:`SplitInput` name, or a split output's
            record name (``"patch_embedder[0]"``: element 0 of ``patch_embedder``'s output; ``"rope"``: a whole one).
        key: For an argument that is a ``dict`` of keyword arguments the module passes on (``cross_attention_kwargs``),
            the entry holding the base; ``None``: the argument is the base itself.
    """

    of: str
    key: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.of, str) or not self.of:
            raise ValueError(f"LengthLogBase.of={self.of!r}: must name a split input or output")
        if self.key is not None and (not isinstance(self.key, str) or not self.key):
            raise ValueError(f"LengthLogBase.key={self.key!r}: must be a non-empty string or None")

    reads_record = True  # adjusted from this forward's split record of ``of``

    def adjust(self, value: Any, splitter: Splitter, name: str, unit: int = 1) -> Any:
        """``value`` (or its entry :attr:`key`) as the base that gives the global length's logarithm on this rank."""
        if self.key is None:
            return splitter.log_base(value, self.of)
        if not isinstance(value, Mapping) or value.get(self.key) is None:
            return value
        return {**value, self.key: splitter.log_base(value[self.key], self.of)}


@dataclass(frozen=True)
class Halo:
    """Give a module that mixes neighbouring rows (a ``k x k`` convolution) the adjacent ranks' edge rows.

    The module's first positional input is split along :attr:`dim` in rank order (whole rows, see
    :attr:`SplitInput.unit`). Before it runs, every rank's first and last :attr:`size` rows are all-gathered; rank
    ``r`` pads its input with the last rows of rank ``r - 1`` and the first rows of rank ``r + 1`` (none at the global
    edges, where the module's own padding applies), and the same number of rows is cropped from the output. Exact
    for modules with stride 1 whose output rows each depend on at most :attr:`size` input rows either side (a
    ``2 * size + 1`` kernel with "same" padding). Every rank must hold at least :attr:`size` rows; the split gives
    each rank at least one whole row, so only ``size=1`` is accepted: with a wider halo a rank could hold too few
    rows, which only that rank would see while the others wait in the exchange.

    Attributes:
        dim: The row dim of the module's input and output.
        size: Rows taken from each neighbour (the kernel's reach: 1 for a 3 x 3 convolution).
    """

    dim: int
    size: int = 1

    def __post_init__(self) -> None:
        _check_dim("Halo", self.dim, None)
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size != 1:
            raise ValueError(
                f"Halo.size={self.size!r}: must be 1 (each rank is guaranteed one whole row, not more; a 3 x 3 "
                "convolution needs one)"
            )


@dataclass(frozen=True)
class TokenSum:
    """In linear attention, one reduction over the (split) tokens, whose result is summed over the ranks.

    Linear attention (Sana: ``relu(k)`` and ``v`` meet in ``torch.matmul(v, k)``, a sum over tokens, before the
    local queries) is exact under a sequence split when each such per-rank sum is all-reduced. The reduction is
    named by the function the processor calls and which of its calls it is within one forward of the attention
    module: ``TokenSum(torch.matmul)`` is the first ``torch.matmul``; ``TokenSum(torch.Tensor.sum)`` the first
    ``tensor.sum(...)`` (a method is not the function of the same name: ``a.matmul(b)`` and ``a @ b`` are
    ``torch.Tensor.matmul``, not ``torch.matmul``). The calls are observed by a ``torch.overrides.TorchFunctionMode``
    active only while the attention module runs, so the processor is not modified.

    Attributes:
        op: The function as ``__torch_function__`` sees it (``torch.matmul``, ``torch.Tensor.sum``, ...).
        occurrence: Which call of ``op`` in one forward of the module (0: the first).
    """

    op: Callable[..., Any]
    occurrence: int = 0

    def __post_init__(self) -> None:
        if not callable(self.op):
            raise ValueError(f"TokenSum.op={self.op!r}: expected a torch function")
        if not isinstance(self.occurrence, int) or isinstance(self.occurrence, bool) or self.occurrence < 0:
            raise ValueError(f"TokenSum.occurrence={self.occurrence!r}: must be a non-negative integer")


def _names(owner: str, value: Any, *, allow_empty: bool = False) -> tuple[str, ...]:
    if isinstance(value, str) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{owner}={value!r}: expected a tuple of names")
    value = tuple(value)
    if not value and not allow_empty:
        raise ValueError(f"{owner}=(): name at least one")
    return value


@dataclass(frozen=True)
class HeadParallel:
    """An attention module whose processor runs on the whole sequence of this rank's heads (Ulysses at its edges).

    Some processors need the global sequence, not a shard of it: Qwen-Image 2.1 slices q/k/v by global segment
    positions before each of its attention calls and keeps a prefix KV cache; Wan-Animate-2 scatters the tokens into a
    buffer laid out by frame for a flex ``BlockMask`` over the whole video; Kandinsky 6 SR builds its NABLA
    ``BlockMask`` from block averages of the queries and keys over the whole sequence. Routing the attention call
    itself comes too late for them. Instead, while the module runs, the tensors that the sub-modules named in
    :attr:`inputs` return (``(B, S_local, H·D)`` projections or ``(B, S_local, H, D)``) are exchanged from token shards
    to head shards — under Ulysses one all-to-all gives this rank every token of ``H / U`` heads (zero-padded when
    ``U`` does not divide ``H``); under ring the ring ranks' shards are all-gathered (every rank computes all heads of
    the whole sequence: exact, not faster); USP does both — and the input of :attr:`output` (``(B, S_global, ·)``,
    the processor's result before the output projection) is exchanged back to this rank's tokens with all heads. In
    between, the processor runs unchanged on a global sequence: its global positions, masks over the whole sequence,
    ``BlockMask`` s and caches of keys and values (each rank's holding its heads) all apply as on one device. Its own
    attention calls run locally (its processor is not marked: diffusers' attention on this rank's heads).

    Attributes:
        inputs: Sub-module paths (relative to the attention module) whose outputs are exchanged to head shards, the
            query's first: its lengths give the output's shards. Name the last module before the processor reshapes
            by heads and after anything that mixes heads (a QK-norm over the whole width: ``norm_q``, not ``to_q``).
        output: Sub-module path whose first input is exchanged back to token shards (``"to_out.0"``), or a tuple of
            them for a module with several pathways (Cosmos 3's ``("to_out", "to_add_out")``).
        heads: Attribute of the attention module giving its head count (read when the module starts).
        divide: Attributes of the attention module proportional to the heads (``heads``, ``inner_dim``) that the
            processor reshapes with: each is replaced by this rank's share (``value * local_heads // heads``) while
            the module runs, then restored. ``()``: the processor infers the head count from the tensors.
        queries: For each output, the input whose token lengths it returns to (its pathway's query); ``()``: the
            first input for every output.
        input_heads: Input sub-module -> attribute of the attention module giving that input's head count, for
            inputs with fewer heads than :attr:`heads` (grouped-query keys and values: ``num_key_value_heads``). Each
            rank takes the KV heads of its query heads' groups: its share of them where the shares line up, else
            (fewer KV heads than ranks) every KV head repeated per query head of its group. A :attr:`divide`
            attribute named here takes the exchanged count's share.
        arguments: ``forward`` argument of the attention module -> its heads dim, for arguments laid out for every
            head (a per-head RoPE table, a key/value cache the caller allocates and the processor writes in place):
            each tensor in it (nested in ``dict`` / ``list`` / ``tuple``) becomes this rank's heads along that dim
            (``size / heads`` entries per head: a flattened ``H·D`` dim works too). A view where the rank's heads are
            all real; where Ulysses pads the heads, a zero-padded copy whose real heads are written back after the
            call if the processor changed them. A ``{ndim: dim}`` mapping picks the dim by the tensor's rank (a table
            ``(B, H, S, r)`` or ``(B, S, H·D)`` by configuration).
        optional: Inputs, outputs or arguments that may be absent (a sub-module set to ``None`` by configuration).

    Tensors may be batched ``(B, S, ·)`` or packed ``(S, ·)`` (2-D, no batch dim): packed ones exchange along dim 0.
    """

    inputs: tuple[str, ...]
    output: str | tuple[str, ...]
    heads: str = "heads"
    divide: tuple[str, ...] = ()
    queries: tuple[str, ...] = ()
    input_heads: Mapping[str, str] = field(default_factory=dict)
    arguments: Mapping[str, int | Mapping[int, int]] = field(default_factory=dict)
    optional: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", _names("HeadParallel.inputs", self.inputs))
        object.__setattr__(self, "divide", _names("HeadParallel.divide", self.divide, allow_empty=True))
        object.__setattr__(self, "optional", _names("HeadParallel.optional", self.optional, allow_empty=True))
        if isinstance(self.output, str):
            if not self.output:
                raise ValueError(f"HeadParallel.output={self.output!r}: expected a name")
        else:
            object.__setattr__(self, "output", _names("HeadParallel.output", self.output))
        if not isinstance(self.heads, str) or not self.heads:
            raise ValueError(f"HeadParallel.heads={self.heads!r}: expected a name")
        subs = (*self.inputs, *self.outputs)
        if len(set(subs)) != len(subs):
            raise ValueError(
                f"HeadParallel.inputs={self.inputs!r}, output={self.output!r}: each sub-module is exchanged once"
            )
        queries = _names("HeadParallel.queries", self.queries, allow_empty=True)
        if queries and (len(queries) != len(self.outputs) or not set(queries) <= set(self.inputs)):
            raise ValueError(
                f"HeadParallel.queries={queries!r}: one input of {self.inputs!r} per output of {self.outputs!r}"
            )
        object.__setattr__(self, "queries", queries or (self.inputs[0],) * len(self.outputs))
        input_heads = dict(self.input_heads)
        for sub, attr in input_heads.items():
            if sub not in self.inputs or not isinstance(attr, str) or not attr:
                raise ValueError(
                    f"HeadParallel.input_heads[{sub!r}]={attr!r}: expected an input of {self.inputs!r} -> an attribute"
                )
        object.__setattr__(self, "input_heads", MappingProxyType(input_heads))
        arguments = {}
        for name, dim in dict(self.arguments).items():
            dims = dim if isinstance(dim, Mapping) else {None: dim}
            if (
                not isinstance(name, str)
                or not name
                or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims.values())
            ):
                raise ValueError(f"HeadParallel.arguments[{name!r}]={dim!r}: expected a name -> a dim or {{ndim: dim}}")
            arguments[name] = MappingProxyType(dict(dim)) if isinstance(dim, Mapping) else dim
        object.__setattr__(self, "arguments", MappingProxyType(arguments))
        unknown = set(self.optional) - set(subs) - set(arguments)
        if unknown:
            raise ValueError(
                f"HeadParallel.optional={self.optional!r}: {sorted(unknown)} are no inputs, outputs or arguments"
            )

    @property
    def outputs(self) -> tuple[str, ...]:
        """The output sub-modules (:attr:`output` as a tuple)."""
        return (self.output,) if isinstance(self.output, str) else self.output


@dataclass(frozen=True)
class AttentionRouting:
    """Which attention calls become context-parallel.

    A processor is routed one of two ways, chosen by the Python module that defines its class:

    * ``modules``: processors that call ``dispatch_attention_fn(..., parallel_config=self._parallel_config)``; the
      module's ``dispatch_attention_fn`` global is rebound and the processors are marked.
    * ``sdpa_modules``: processors that call ``F.scaled_dot_product_attention`` directly on ``(B, H, S, D)``
      tensors; the module's ``F`` global (``torch.nn.functional``) is rebound to a proxy whose SDPA is
      context-parallel only while a non-local attention module of this transformer runs (see
      :func:`fastdit.parallel.attention.dispatch.mark_attention_modules`).
    * ``dispatch_modules``: processors that call ``dispatch_attention_fn`` without a ``parallel_config``; the
      module's ``dispatch_attention_fn`` is rebound to a router that, like the SDPA proxy, is context-parallel only
      while a non-local attention module of this transformer runs.

    Attributes:
        modules: Python modules whose ``dispatch_attention_fn`` global is routed (those defining the processors).
        sdpa_modules: Python modules whose ``F`` global is routed (those defining processors that call
            ``F.scaled_dot_product_attention``).
        dispatch_modules: Python modules whose ``dispatch_attention_fn`` global is routed for the marked attention
            modules (processors that pass no ``parallel_config``). At least one of ``modules``, ``sdpa_modules``
            and ``dispatch_modules`` is non-empty; a module is in at most one of them.
        mask_segments: Names of split inputs whose concatenation, in this order, is the joint sequence that an
            attention mask built by the model indexes (a mask over the global sequence is reordered to match the
            ranks' shards; see :class:`fastdit.parallel.attention.ulysses.SeqLayout`). Empty: one contiguous split.
        local: Module path patterns (plan path syntax) of attention modules left out of context parallelism: their
            processors are not marked, so they run ordinary local attention on whatever tensors they receive (a
            text refiner that only sees the whole, replicated text; cross-attention from local tokens to replicated
            text). A pattern covers the modules it matches and everything below them; each must cover at least one
            attention module. Processors there need not route through ``dispatch_attention_fn``.
        mask_transform: A function applied to every mask a routed processor passes, before it is put in shard
            order: it turns a mask the model builds over the rank's local tokens into one context-parallel attention
            understands (a mask over the global sequence, or a key-padding mask over the local keys). ``None``: the
            mask is used as passed.
        exchange_lengths: The ranks' query/key lengths inside attention depend on the data (a processor drops each
            sample's padded text tokens), so every attention call exchanges them instead of deriving them from the
            split sizes. Refused with USP (which needs equal lengths inside each Ulysses group) and with CUDA graphs
            (which would freeze one call's lengths).
        sdpa_calls: Module path patterns (plan path syntax) of modules whose ``forward`` computes softmax attention
            inline — any module, with or without a ``processor`` — through ``scaled_dot_product_attention`` however
            it is spelled (``F.``, ``torch.nn.functional.``, an imported name) on ``(B, H, S, D)`` tensors: while
            such a module runs, every SDPA call it makes is context-parallel. For third-party models; processors at
            or below a match need no other routing.
        linear: Module path pattern -> the :class:`TokenSum` reductions of the linear attention modules it matches
            (covering, like ``local``, the attention modules at or below the match): while such a module runs, the
            named reductions over its local tokens are all-reduced over the ranks, so its local queries meet the
            sums over every token. Its processor needs no other routing. May be the only routing of a plan.
        head_parallel: Module path pattern -> :class:`HeadParallel`: the attention modules (those with a
            ``processor``) it matches run their processor on the whole sequence of this rank's heads. Their
            processors need no other routing. May be the only routing of a plan.
    """

    modules: tuple[str, ...] = ()
    sdpa_modules: tuple[str, ...] = ()
    dispatch_modules: tuple[str, ...] = ()
    mask_segments: tuple[str, ...] = ()
    local: tuple[str, ...] = ()
    mask_transform: Callable[[torch.Tensor], torch.Tensor] | None = None
    exchange_lengths: bool = False
    sdpa_calls: tuple[str, ...] = ()
    linear: Mapping[str, tuple[TokenSum, ...]] = field(default_factory=dict)
    head_parallel: Mapping[str, HeadParallel] = field(default_factory=dict)

    def __post_init__(self) -> None:
        heads = dict(self.head_parallel)
        for path, spec in heads.items():
            if not isinstance(spec, HeadParallel):
                raise ValueError(f"AttentionRouting.head_parallel[{path!r}]={spec!r}: expected HeadParallel")
        object.__setattr__(self, "head_parallel", MappingProxyType(heads))
        linear = {p: (s if isinstance(s, tuple) else (s,)) for p, s in dict(self.linear).items()}
        for path, sums in linear.items():
            if not sums or not all(isinstance(t, TokenSum) for t in sums):
                raise ValueError(f"AttentionRouting.linear[{path!r}]={sums!r}: expected TokenSum(s)")
        object.__setattr__(self, "linear", MappingProxyType(linear))
        if isinstance(self.local, str):
            raise ValueError(f"AttentionRouting.local={self.local!r}: expected a tuple of paths, not a string")
        kinds = ("modules", "sdpa_modules", "dispatch_modules", "sdpa_calls")
        for name in kinds:
            if isinstance(getattr(self, name), str):
                raise ValueError(f"AttentionRouting.{name}={getattr(self, name)!r}: expected a tuple of module names")
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "mask_segments", tuple(self.mask_segments))
        object.__setattr__(self, "local", tuple(self.local))
        # Only ``local``: every attention runs on what its module holds (a plan that gathers the sequence for each
        # module mixing tokens, SANA-WM's recurrent attentions, leaves nothing to route).
        if not any(getattr(self, name) for name in kinds) and not (self.linear or self.head_parallel or self.local):
            raise ValueError(
                "AttentionRouting: modules, sdpa_modules, dispatch_modules and sdpa_calls are empty, and linear, "
                "head_parallel and local too; name a module"
            )
        both = set(self.modules) & set(self.dispatch_modules)
        if both:
            raise ValueError(
                f"AttentionRouting.dispatch_modules={self.dispatch_modules!r}: {sorted(both)} also in modules (one "
                "router per module's dispatch_attention_fn)"
            )
        if not isinstance(self.exchange_lengths, bool):
            raise ValueError(f"AttentionRouting.exchange_lengths={self.exchange_lengths!r}: expected a bool")
        if self.mask_transform is not None and not callable(self.mask_transform):
            raise ValueError(f"AttentionRouting.mask_transform={self.mask_transform!r}: expected a function")


def _frozen(mapping: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType({k: MappingProxyType(dict(v)) if isinstance(v, Mapping) else v for k, v in mapping.items()})


@dataclass(frozen=True, kw_only=True)
class ContextParallelPlan:
    """Where a transformer family splits and gathers its sequence under context parallelism.

    Attributes:
        inputs: Module path -> argument name -> :class:`SplitInput`, :class:`LeadingCount`, :class:`LocalExtent` or
            :class:`GatherInput`.
        outputs: Module path -> :class:`SplitOutput` or a tuple of them (one per tuple element).
        gather: Module path -> :class:`GatherOutput`.
        halo: Module path -> :class:`Halo` (modules mixing neighbouring rows of a row-split grid).
        attention: Attention routing.
        notes: How the family's positional embeddings stay consistent with the split (for the docs).
        optional: Paths of ``inputs``, ``outputs``, ``gather``, ``halo`` or ``attention.local``, exactly as written
            there, that may match no module of a transformer the family serves (a family serving a UNet and the bare
            transformer stack it is built of, each lacking the other's lists). Every other path must match.
    """

    inputs: Mapping[str, Mapping[str, SplitInput | LeadingCount | LocalExtent | LengthLogBase | GatherInput]] = field(
        default_factory=dict
    )
    outputs: Mapping[str, SplitOutput | tuple[SplitOutput, ...]] = field(default_factory=dict)
    gather: Mapping[str, GatherOutput] = field(default_factory=dict)
    halo: Mapping[str, Halo] = field(default_factory=dict)
    attention: AttentionRouting
    notes: str = ""
    optional: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        outputs = {p: (s if isinstance(s, tuple) else (s,)) for p, s in self.outputs.items()}
        object.__setattr__(self, "inputs", _frozen(self.inputs))
        object.__setattr__(self, "outputs", MappingProxyType(outputs))
        object.__setattr__(self, "gather", MappingProxyType(dict(self.gather)))
        object.__setattr__(self, "halo", MappingProxyType(dict(self.halo)))
        for path, halo in self.halo.items():
            if not isinstance(halo, Halo):
                raise ValueError(f"ContextParallelPlan.halo[{path!r}]={halo!r}: expected Halo")
        for path, args in self.inputs.items():
            for name, split in args.items():
                if not isinstance(split, (SplitInput, LeadingCount, LocalExtent, LengthLogBase, GatherInput)):
                    raise ValueError(
                        f"ContextParallelPlan.inputs[{path!r}][{name!r}]={split!r}: expected SplitInput, LeadingCount, "
                        "LocalExtent, LengthLogBase or GatherInput"
                    )
        for path, splits in self.outputs.items():
            if not all(isinstance(s, SplitOutput) for s in splits):
                raise ValueError(f"ContextParallelPlan.outputs[{path!r}]={splits!r}: expected SplitOutput(s)")
        for path, gather in self.gather.items():
            if not isinstance(gather, GatherOutput):
                raise ValueError(f"ContextParallelPlan.gather[{path!r}]={gather!r}: expected GatherOutput")
        if not self.gather:
            raise ValueError("ContextParallelPlan.gather={}: gather the output somewhere (usually proj_out)")
        if isinstance(self.optional, str):
            raise ValueError(f"ContextParallelPlan.optional={self.optional!r}: expected a tuple of paths")
        object.__setattr__(self, "optional", tuple(self.optional))
        named = {*self.inputs, *self.outputs, *self.gather, *self.halo, *self.attention.local}
        for path in self.optional:
            if path not in named:
                raise ValueError(
                    f"ContextParallelPlan.optional entry {path!r}: not a path of inputs, outputs, gather, halo or "
                    "attention.local"
                )
        split_names = {name for args in self.inputs.values() for name, s in args.items() if isinstance(s, SplitInput)}
        for name in self.attention.mask_segments:
            if name not in split_names:
                raise ValueError(f"AttentionRouting.mask_segments: {name!r} is not a split input of the plan")
        for path, splits in self.outputs.items():
            for spec in splits:
                if spec.like and spec.like not in split_names:
                    raise ValueError(
                        f"ContextParallelPlan.outputs[{path!r}]: SplitOutput.like={spec.like!r} is not a split input "
                        "of the plan"
                    )
        for path, args in self.inputs.items():
            for name, split in args.items():
                if not isinstance(split, SplitInput):
                    continue
                for segment in split.segments:
                    other = args.get(segment)
                    if segment == name or not isinstance(other, SplitInput) or other.segments:
                        raise ValueError(
                            f"ContextParallelPlan.inputs[{path!r}][{name!r}]: segment {segment!r} is not another "
                            "plain SplitInput of the same path"
                        )
        output_names = {
            path if spec.index is None else f"{path}[{spec.index}]" for path, specs in outputs.items() for spec in specs
        }
        for path, args in self.inputs.items():
            for name, base in args.items():
                if isinstance(base, LengthLogBase) and base.of not in split_names | output_names:
                    raise ValueError(
                        f"ContextParallelPlan.inputs[{path!r}][{name!r}]: LengthLogBase.of={base.of!r} is neither a "
                        f"split input nor a split output of the plan ({sorted(split_names | output_names)})"
                    )
        plain = {
            name
            for args in self.inputs.values()
            for name, s in args.items()
            if isinstance(s, SplitInput) and not s.reads_record
        }
        for path, args in self.inputs.items():
            for name, split in args.items():
                if isinstance(split, SplitInput) and split.groups_of is not None and split.groups_of not in plain:
                    raise ValueError(
                        f"ContextParallelPlan.inputs[{path!r}][{name!r}]: SplitInput.groups_of={split.groups_of!r} is "
                        "not a plain split input of the plan"
                    )
                if isinstance(split, SplitInput) and split.tail_of and split.tail_of not in plain:
                    raise ValueError(
                        f"ContextParallelPlan.inputs[{path!r}][{name!r}]: tail_of={split.tail_of!r} is not a plain "
                        "SplitInput of the plan"
                    )
        for path, args in self.inputs.items():
            for name, count in args.items():
                if isinstance(count, (LeadingCount, LocalExtent)) and count.of not in split_names:
                    raise ValueError(
                        f"ContextParallelPlan.inputs[{path!r}][{name!r}]: {type(count).__name__}.of={count.of!r} is "
                        "not a split input of the plan"
                    )


_LAST = "-1"


def _expand_last(root: torch.nn.Module, path: str) -> list[str]:
    """``path`` with its first ``-1`` component replaced by the index of the last entry of each list it follows.

    The components before the ``-1`` may hold ``*``: each ``ModuleList`` / ``Sequential`` they match gives one path
    (``"stages.*.blocks.-1"``: the last block of every stage). No match: no path.
    """
    parts = path.split(".")
    at = parts.index(_LAST)
    prefix, rest = ".".join(parts[:at]), parts[at + 1 :]
    expanded: list[str] = []
    for name, container in match_modules(root, prefix):
        if not isinstance(container, (torch.nn.ModuleList, torch.nn.Sequential)) or len(container) == 0:
            raise ValueError(
                f"context-parallel plan path {path!r}: '-1' needs a non-empty ModuleList or Sequential at "
                f"{name!r}, found {type(container).__name__}"
            )
        expanded.append(".".join([*([name] if name else []), str(len(container) - 1), *rest]))
    return expanded


_CLASS_FILTER = re.compile(r"^(?P<path>.*)\[(?P<cls>[A-Za-z_][A-Za-z0-9_]*)\]$")


def split_class_filter(path: str) -> tuple[str, str | None]:
    """``path`` without a trailing ``[ClassName]`` filter, and the class name (``None``: no filter)."""
    found = _CLASS_FILTER.match(path)
    return (found["path"], found["cls"]) if found else (path, None)


def match_modules(root: torch.nn.Module, path: str) -> list[tuple[str, torch.nn.Module]]:
    """Modules under ``root`` matching ``path``.

    ``""`` is the root; a ``*`` component matches any one path component; a ``-1`` component names the last entry
    of the ``ModuleList`` / ``Sequential`` before it (``"blocks.-1"``: the last block; ``"stages.*.blocks.-1"``: the
    last block of every stage). A trailing ``[ClassName]``
    keeps only the matches whose class has that name (``"blocks.*.mlp[MoELayer]"``: the mixture-of-experts
    feed-forwards of a list whose other blocks have a dense one at the same path); a context-parallel plan path so
    filtered may match no module at all (a checkpoint without such layers).
    """
    path, class_name = split_class_filter(path)
    if class_name is not None:
        return [(n, m) for n, m in match_modules(root, path) if type(m).__name__ == class_name]
    if path == "":
        return [("", root)]
    if _LAST in path.split("."):
        found: dict[str, torch.nn.Module] = {}
        for concrete in _expand_last(root, path):
            found.update(match_modules(root, concrete))
        return list(found.items())
    pattern = re.compile("^" + r"\.".join("[^.]+" if p == "*" else re.escape(p) for p in path.split(".")) + "$")
    return [(name, module) for name, module in root.named_modules() if name and pattern.match(name)]


def linear_attention_paths(transformer: torch.nn.Module, routing: AttentionRouting) -> dict[str, tuple[TokenSum, ...]]:
    """The attention modules (those with a ``processor``) that ``routing.linear`` covers, with their token sums.

    Raises:
        ValueError: a ``linear`` pattern covers no attention module, or a module is covered twice.
    """
    found: dict[str, tuple[TokenSum, ...]] = {}
    for pattern, sums in routing.linear.items():
        for path in _covered_attention(transformer, pattern, "linear"):
            if path in found:
                raise ValueError(f"context-parallel plan: AttentionRouting.linear covers {path!r} twice")
            found[path] = sums
    return found


def head_parallel_paths(transformer: torch.nn.Module, routing: AttentionRouting) -> dict[str, HeadParallel]:
    """The attention modules (those with a ``processor``) that ``routing.head_parallel`` covers, with their specs.

    Raises:
        ValueError: a pattern covers no attention module, or a module is covered twice.
    """
    found: dict[str, HeadParallel] = {}
    for pattern, spec in routing.head_parallel.items():
        for path in _covered_attention(transformer, pattern, "head_parallel"):
            if path in found:
                raise ValueError(f"context-parallel plan: AttentionRouting.head_parallel covers {path!r} twice")
            found[path] = spec
    return found


def _covered_attention(transformer: torch.nn.Module, pattern: str, field_name: str) -> list[str]:
    """Attention module paths at or below the modules ``pattern`` matches (at least one, else ``ValueError``)."""
    attention = [name for name, m in transformer.named_modules() if getattr(m, "processor", None) is not None]
    roots = [name for name, _ in match_modules(transformer, pattern)]
    found = [a for a in attention if _below(a, roots)]
    if not found and split_class_filter(pattern)[1] is None:  # a class-filtered path may select nothing
        raise ValueError(
            f"context-parallel plan: AttentionRouting.{field_name} path {pattern!r} covers no attention module of "
            f"{type(transformer).__name__}"
        )
    return found


def sdpa_call_paths(transformer: torch.nn.Module, routing: AttentionRouting) -> list[str]:
    """Paths of the modules ``routing.sdpa_calls`` matches, outermost first (each pattern must match one).

    Raises:
        ValueError: a pattern matches no module.
    """
    found: list[str] = []
    for pattern in routing.sdpa_calls:
        matched = [name for name, _ in match_modules(transformer, pattern)]
        if not matched and split_class_filter(pattern)[1] is None:  # a class-filtered path may select nothing
            raise ValueError(
                f"context-parallel plan: AttentionRouting.sdpa_calls path {pattern!r} matches no module of "
                f"{type(transformer).__name__}"
            )
        found += [m for m in matched if m not in found]
    return found


def _below(path: str, roots: list[str]) -> bool:
    return any(path == r or path.startswith(f"{r}.") or r == "" for r in roots)


def local_attention_paths(
    transformer: torch.nn.Module, routing: AttentionRouting, optional: tuple[str, ...] = ()
) -> set[str]:
    """Paths of the attention modules (those with a ``processor``) that ``routing.local`` keeps local.

    A pattern covers the attention modules it matches and those below them (``"context_embedder"``: every attention
    inside the text embedder).

    Args:
        transformer: The module tree.
        routing: The plan's attention routing.
        optional: Patterns that may cover nothing (:attr:`ContextParallelPlan.optional`).

    Raises:
        ValueError: a ``local`` pattern not in ``optional`` covers no attention module.
    """
    attention = [name for name, m in transformer.named_modules() if getattr(m, "processor", None) is not None]
    paths: set[str] = set()
    for pattern in routing.local:
        roots = [name for name, _ in match_modules(transformer, pattern)]
        found = [a for a in attention if _below(a, roots)]
        # A class-filtered or optional path may select nothing.
        if not found and split_class_filter(pattern)[1] is None and pattern not in optional:
            raise ValueError(
                f"context-parallel plan: AttentionRouting.local path {pattern!r} covers no attention module of "
                f"{type(transformer).__name__}"
            )
        paths.update(found)
    return paths


def _forward_params(module: torch.nn.Module) -> list[str]:
    # The class's forward, not the instance attribute that hooks may have wrapped.
    return list(inspect.signature(type(module).forward).parameters)[1:]


def _check_position(module: torch.nn.Module, arg: str, position: int, where: str, path: str) -> None:
    """``position`` is where ``forward`` receives ``arg``: its named slot, or a slot of its ``*args``."""
    params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    names = [p.name for p in positional]
    if arg in names:
        if names.index(arg) != position:
            raise ValueError(
                f"context-parallel plan: {where} takes {arg!r} at position {names.index(arg)}, not {position} "
                f"(path {path!r})"
            )
        return
    if position < len(positional) or not any(p.kind == p.VAR_POSITIONAL for p in params):
        raise ValueError(
            f"context-parallel plan: {where} has no argument {arg!r} and no *args slot at position {position} "
            f"(path {path!r}); its arguments are {[p.name for p in params]}"
        )


def validate_plan(
    transformer: torch.nn.Module,
    plan: ContextParallelPlan,
    degree: int,
    *,
    uneven_heads: bool = True,
    tp_degree: int = 1,
) -> None:
    """Check ``plan`` against ``transformer`` without running it (works on the ``meta`` device).

    Args:
        transformer: The module tree to check.
        plan: The plan.
        degree: The Ulysses degree (heads are sharded over it).
        uneven_heads: Whether head counts that do not divide ``degree`` are padded (otherwise an error).
        tp_degree: The tensor-parallel degree: Ulysses exchanges the heads local to a TP shard (``heads / tp``).

    Raises:
        ValueError: naming the path, argument or module that does not fit.
    """
    cls = type(transformer).__name__
    paths = [*plan.inputs, *plan.outputs, *plan.gather, *plan.halo]
    resolved = {path: match_modules(transformer, path) for path in paths}
    for path, found in resolved.items():
        # A class-filtered path selects the modules of that class, if any (a checkpoint with no MoE layer).
        if not found and split_class_filter(path)[1] is None and path not in plan.optional:
            raise ValueError(f"context-parallel plan: path {path!r} matches no module of {cls}")
    for path, args in plan.inputs.items():
        for name, module in resolved[path]:
            params = _forward_params(module)
            where = f"{name!r} ({type(module).__name__})" if name else cls
            for arg, spec in args.items():
                for unit in getattr(spec, "unit", ()):
                    if unit_argument(unit)[0] not in params:
                        raise ValueError(
                            f"context-parallel plan: {where}.forward has no argument {unit!r} (SplitInput.unit of "
                            f"{arg!r}, path {path!r}); its arguments are {params}"
                        )
                if isinstance(spec, (LeadingCount, LocalExtent)) and spec.position is not None:
                    _check_position(module, arg, spec.position, f"{where}.forward", path)
                elif arg not in params:
                    raise ValueError(
                        f"context-parallel plan: {where}.forward has no argument {arg!r} (path {path!r}); "
                        f"its arguments are {params}"
                    )
    _validate_attention(transformer, plan.attention, degree, uneven_heads, tp_degree, plan.optional)


def _validate_attention(
    transformer: torch.nn.Module,
    routing: AttentionRouting,
    degree: int,
    uneven_heads: bool,
    tp_degree: int = 1,
    optional: tuple[str, ...] = (),
) -> None:
    local = local_attention_paths(transformer, routing, optional)
    linear = linear_attention_paths(transformer, routing)
    both = sorted(local & set(linear))
    if both:
        raise ValueError(f"context-parallel plan: {both} are both local and linear in AttentionRouting")
    heads = head_parallel_paths(transformer, routing)
    both = sorted(set(heads) & (local | set(linear)))
    if both:
        raise ValueError(
            f"context-parallel plan: {both} are head_parallel and also local or linear in AttentionRouting"
        )
    for path, spec in heads.items():
        _validate_head_parallel(transformer.get_submodule(path), path, spec, degree, uneven_heads, tp_degree)
    inline = sdpa_call_paths(transformer, routing)
    attention = [
        (n, m)
        for n, m in transformer.named_modules()
        if getattr(m, "processor", None) is not None
        and n not in local
        and n not in linear
        and n not in heads
        and not _below(n, inline)
    ]
    # A routing that names only ``local`` modules means it (every attention runs locally); one that names modules to
    # route but leaves nothing for them is a mistake.
    local_only = not any((routing.modules, routing.sdpa_modules, routing.dispatch_modules, routing.sdpa_calls))
    if not attention and not linear and not inline and not heads and not (local and local_only):
        raise ValueError(f"context-parallel plan: {type(transformer).__name__} has no attention processors to route")
    for path, module in attention:
        processor = module.processor
        defined_in = type(processor).__module__
        if defined_in not in routing.sdpa_modules and defined_in not in routing.dispatch_modules:
            if not hasattr(processor, "_parallel_config"):
                raise ValueError(
                    f"context-parallel plan: processor {type(processor).__name__} of {path!r} does not pass a "
                    "parallel_config to dispatch_attention_fn and its module "
                    f"{defined_in!r} is in neither AttentionRouting.sdpa_modules nor dispatch_modules, so its "
                    "attention cannot be routed"
                )
            if defined_in not in routing.modules:
                raise ValueError(
                    f"context-parallel plan: processor {type(processor).__name__} of {path!r} is defined in "
                    f"{defined_in!r}, which AttentionRouting.modules does not route"
                )
        heads = getattr(module, "heads", None)
        if isinstance(heads, int) and heads % tp_degree == 0:
            heads //= tp_degree  # checked before tensor parallelism divides them: the heads of one TP shard
        if isinstance(heads, int) and heads % degree and not uneven_heads:
            raise ValueError(
                f"context-parallel plan: {path!r} has {heads} heads per tensor-parallel shard, which do not divide "
                f"the Ulysses degree {degree}"
            )
    for name, attr in [
        *((n, "dispatch_attention_fn") for n in (*routing.modules, *routing.dispatch_modules)),
        *((n, "F") for n in routing.sdpa_modules),
    ]:
        try:
            py_module = importlib.import_module(name)
        except ImportError as exc:
            raise ValueError(f"context-parallel plan: attention module {name!r} cannot be imported") from exc
        if attr == "F":
            # The real torch.nn.functional, or the proxy another routed transformer installed.
            if not hasattr(getattr(py_module, "F", None), "scaled_dot_product_attention"):
                raise ValueError(f"context-parallel plan: module {name!r} has no F (torch.nn.functional) to route")
        elif not callable(getattr(py_module, attr, None)):
            raise ValueError(f"context-parallel plan: module {name!r} has no dispatch_attention_fn to route")


def _validate_head_parallel(
    module: torch.nn.Module, path: str, spec: HeadParallel, degree: int, uneven_heads: bool, tp_degree: int
) -> None:
    """The sub-modules and attributes a :class:`HeadParallel` names exist on the attention module at ``path``."""
    where = f"AttentionRouting.head_parallel: {path!r} ({type(module).__name__})"
    for sub in (*spec.inputs, *spec.outputs):
        try:
            found = module.get_submodule(sub)
        except AttributeError:
            found = None
        if found is None and sub not in spec.optional:
            raise ValueError(f"context-parallel plan: {where} has no sub-module {sub!r}")
    heads = getattr(module, spec.heads, None)
    if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
        raise ValueError(f"context-parallel plan: {where}.{spec.heads}={heads!r} is not a head count")
    for sub, attr in spec.input_heads.items():
        count = getattr(module, attr, None)
        if not isinstance(count, int) or isinstance(count, bool) or count < 1 or heads % count:
            raise ValueError(
                f"context-parallel plan: {where}.{attr}={count!r} (HeadParallel.input_heads[{sub!r}]) is not a head "
                f"count dividing its {heads} heads"
            )
    grouped = set(spec.input_heads.values())  # checked above, and divided by their own share when the module runs
    for name in spec.divide:
        value = getattr(module, name, None)
        if name in grouped:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value % heads:
            raise ValueError(
                f"context-parallel plan: {where}.{name}={value!r} (HeadParallel.divide) is not an integer multiple of "
                f"its {heads} heads"
            )
    if heads % tp_degree == 0:
        heads //= tp_degree
    if heads % degree and not uneven_heads:
        raise ValueError(
            f"context-parallel plan: {path!r} has {heads} heads per tensor-parallel shard, which do not divide the "
            f"Ulysses degree {degree}"
        )
