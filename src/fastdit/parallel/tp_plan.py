"""Tensor-parallel plans as data, and their checks against a module tree (which work on the ``meta`` device).

A :class:`TensorParallelPlan` maps module paths of a transformer (``*`` matches one path component) to a style:

* :class:`Colwise` — a ``Linear`` whose *output* features are split over the TP ranks (attention q/k/v, FFN up and
  gate). ``segments`` describes a fused weight (``[Q|K|V]``, ``[gate|up]``, FLUX.2's ``[Q|K|V|gate|up]``): each
  segment is split on its own, so rank ``r`` holds ``[Q_r|K_r|V_r]`` and the processor's ``split`` of the local output
  finds its own heads. ``gather_output`` all-gathers the output (AdaLN modulation: the weight is split, every rank
  gets the whole modulation vector).
* :class:`Rowwise` — a ``Linear`` whose *input* features are split (attention out, FFN down); the partial outputs are
  summed over the ranks. ``segments`` describes an input that concatenates several split streams (FLUX.1's single
  block ``proj_out`` over ``cat([attn_out, mlp_hidden])``).
* :class:`ShardedNorm` — an RMSNorm / LayerNorm over a feature dim that is split (Wan's QK-norm over the whole inner
  dim): its weight is split like the features and its statistics are summed over the ranks, instead of a silently
  wrong local norm.

* :class:`SplitParameter` — a parameter the model's code reads directly, with one entry per head (Helios' per-head
  history key scale): each rank keeps its heads' entries.

* :class:`LocalArgument` — a ``forward`` argument holding tensors for *all* heads that the caller allocates and the
  module writes into (AnyFlow-FAR's per-block KV cache): each rank passes on a view of its heads' slice.
* :class:`ExpertShard` — a module of packed experts (``(E, ...)`` weights, called with tokens sorted by expert and
  per-expert counts): each rank keeps ``E / tp`` whole experts, runs their rows and all-gathers the rows back
  (expert parallelism inside the TP group, for a mixture of experts whose router sees replicated tokens).

* :class:`LocalSlice` — a module that computes a table for *all* heads or features (a RoPE module returning
  ``(S, heads, d)`` or ``(B, S, inner_dim)`` cos/sin): each rank keeps its slice of every output tensor.

``Colwise`` / ``Rowwise`` also split ``Conv1d/2d/3d`` layers by channel (Sana's convolutional FFN): a grouped
(depthwise) convolution split column-wise keeps whole groups, its ``groups`` divided by the degree. ``unit``
keeps a split in whole heads when nothing else divides by the head count (Lumina2's K/V, whose KV heads are only a
ratio of widths).

``divide`` names the attributes the model's code reshapes with (``heads``, ``inner_dim``, an MLP hidden size):
they are divided by the degree so the processor sees the local sizes.

A segment size is an ``int`` (a proportion of the feature count, e.g. ``(1, 1, 1)`` for ``[Q|K|V]``) or a ``str``:
a dotted attribute path read on the module that owns the ``Linear`` (``"attn.inner_dim"``), so a checkpoint with
another MLP ratio still splits right.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from fastdit.attrs import resolve_attr
from fastdit.parallel.plan import match_modules

__all__ = [
    "CONV_TYPES",
    "Colwise",
    "ExpertShard",
    "LocalArgument",
    "LocalSlice",
    "Rowwise",
    "ShardedNorm",
    "SplitParameter",
    "Style",
    "TensorParallelPlan",
    "divided_attributes",
    "expert_counts",
    "norm_kind",
    "plan_layers",
    "resolve_tp_plan",
    "segment_sizes",
    "unit_size",
    "validate_tp_plan",
]

Segment = int | str


def _check_segments(owner: str, segments: tuple[Segment, ...]) -> None:
    for segment in segments:
        if isinstance(segment, bool) or not isinstance(segment, (int, str)) or segment in (0, ""):
            raise ValueError(f"{owner}.segments={segments!r}: each segment is a positive int or an attribute path")
        if isinstance(segment, int) and segment < 0:
            raise ValueError(f"{owner}.segments={segments!r}: each segment is a positive int or an attribute path")


# A split's unit: an int, an attribute path on the owning module (``"head_dim"``), or (numerator, denominator)
# attribute paths on it (inner_dim // heads).
Unit = int | str | tuple[str, str] | None


def _check_unit(owner: str, unit: Unit) -> None:
    if unit is None:
        return
    if isinstance(unit, int) and not isinstance(unit, bool) and unit > 0:
        return
    if isinstance(unit, str) and unit:
        return
    if isinstance(unit, tuple) and len(unit) == 2 and all(isinstance(u, str) and u for u in unit):
        return
    raise ValueError(
        f"{owner}.unit={unit!r}: a positive int, an attribute path or a (numerator, denominator) pair of them"
    )


@dataclass(frozen=True)
class Colwise:
    """Split a layer's output features (a ``Linear``'s weight rows, a convolution's output channels).

    Attributes:
        segments: The fused parts of the output, each split on its own (empty: one part).
        gather_output: All-gather the output so every rank gets all features (AdaLN modulation; ``Linear`` only).
        unit: Split each segment only in whole units of this many features (a head), when no divided attribute
            already says so: an int, an attribute path read on the owning module (``"head_dim"``), or a
            (numerator, denominator) pair of them.
    """

    segments: tuple[Segment, ...] = ()
    gather_output: bool = False
    unit: Unit = None

    def __post_init__(self) -> None:
        _check_segments("Colwise", self.segments)
        _check_unit("Colwise", self.unit)


@dataclass(frozen=True)
class Rowwise:
    """Split a layer's input features (weight columns, input channels); the partial outputs are summed.

    Attributes:
        segments: The concatenated parts of the input, each split on its own (empty: one part).
        unit: As for :class:`Colwise`.
    """

    segments: tuple[Segment, ...] = ()
    unit: Unit = None

    def __post_init__(self) -> None:
        _check_segments("Rowwise", self.segments)
        _check_unit("Rowwise", self.unit)


@dataclass(frozen=True)
class ShardedNorm:
    """A norm over split features: its weight split like them, its statistics summed over the ranks.

    Attributes:
        segments: The parts of the normalised features, as for :class:`Colwise` (empty: one part).
    """

    segments: tuple[Segment, ...] = ()

    def __post_init__(self) -> None:
        _check_segments("ShardedNorm", self.segments)


@dataclass(frozen=True)
class LocalSlice:
    """Keep this rank's slice of a module's output tensors (a table computed for every head or feature).

    The module runs whole (it is small: a RoPE table); a forward hook cuts each tensor of its output (a tensor, or
    a tuple / list of them) along ``dim`` to the rank's part of every segment.

    Attributes:
        dim: The dim to slice (heads or features; negative counts from the end), or a mapping from a tensor's
            number of dims to the dim to slice, for a module whose tables take one of several layouts (LTX-2's
            ``(B, S, inner_dim)`` interleaved and ``(B, H, S, d)`` split RoPE tables: ``{3: -1, 4: 1}``).
        segments: The parts of that dim, each sliced on its own (empty: one part).
    """

    dim: int | Mapping[int, int]
    segments: tuple[Segment, ...] = ()

    def __post_init__(self) -> None:
        dims = self.dim.values() if isinstance(self.dim, Mapping) else (self.dim,)
        if not dims or any(isinstance(d, bool) or not isinstance(d, int) for d in dims):
            raise ValueError(f"LocalSlice.dim={self.dim!r}: an int, or a mapping of tensor dims to ints")
        if isinstance(self.dim, Mapping):
            object.__setattr__(self, "dim", tuple(sorted(self.dim.items())))  # hashable, like the rest of the plan
        if any(isinstance(s, str) for s in self.segments):
            raise ValueError(f"LocalSlice.segments={self.segments!r}: proportions (ints) only")
        _check_segments("LocalSlice", self.segments)

    def dim_for(self, ndim: int) -> int | None:
        """The dim to slice in a tensor of ``ndim`` dims (``None``: a layout the mapping does not name)."""
        if isinstance(self.dim, int):
            return self.dim
        return dict(self.dim).get(ndim)


@dataclass(frozen=True)
class SplitParameter:
    """Split one parameter of the module (not a layer: a tensor the model's code reads, e.g. one scale per head).

    Rank ``r`` keeps the ``r``-th of ``degree`` equal contiguous parts along :attr:`dim`, as a plain local tensor, so
    code that reshapes it with the divided head count (``view(1, 1, -1, 1)``) finds its heads. A parameter of size 1
    along :attr:`dim` broadcasts over the heads and stays whole (a scalar variant of the same model); a module
    without the parameter is skipped when its pattern is in :attr:`TensorParallelPlan.optional`.

    Attributes:
        name: The parameter's attribute name on the module (``"history_key_scale"``).
        dim: The dim to split.
    """

    name: str
    dim: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or "." in self.name:
            raise ValueError(f"SplitParameter.name={self.name!r}: the parameter's attribute name on the module")
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise ValueError(f"SplitParameter.dim={self.dim!r}: must be an integer")

    def parameter(self, module: torch.nn.Module) -> torch.nn.Parameter | None:
        """The module's parameter, or ``None`` if it has none of that name."""
        return module._parameters.get(self.name)

    def splits(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is split (not a size-1, broadcast, dim)."""
        return param.shape[self.dim] != 1


@dataclass(frozen=True)
class LocalArgument:
    """Pass the module this rank's slice of a ``forward`` argument's tensors (laid out for every head).

    For a buffer the caller allocates for all heads and the module reads and writes in place (AnyFlow-FAR's per-block
    KV cache ``{"full_cache": (2, B, heads, L, D), ...}``, filled by one call and read by the next): a forward
    pre-hook replaces every tensor in the argument (a tensor, or nested in ``dict`` / ``list`` / ``tuple``) by a
    view of rank ``r``'s ``r``-th of ``degree`` equal contiguous parts along :attr:`dim`, so the processor, whose
    heads are divided, finds its own heads, and what it writes lands in the caller's buffer (the other ranks' parts
    of each rank's buffer stay unused). ``None`` passes unchanged.

    Attributes:
        name: The ``forward`` parameter (by keyword or position).
        dim: The heads dim of its tensors.
    """

    name: str
    dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"LocalArgument.name={self.name!r}: the forward parameter's name")
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise ValueError(f"LocalArgument.dim={self.dim!r}: must be an integer")


@dataclass(frozen=True)
class ExpertShard:
    """Shard a module of packed experts by expert (expert parallelism over the tensor-parallel ranks).

    For a module holding every expert's weights stacked on dim 0 (``gate_up_proj`` ``(E, D, 2I)``, ``down_proj``
    ``(E, I, D)``) and called with the routed tokens sorted by expert and the per-expert token counts (diffusers'
    packed MoE experts). Rank ``r`` keeps experts ``[r E / tp, (r + 1) E / tp)`` of every named parameter; before
    the module runs, its tokens are narrowed to the rows of those experts and its counts to their entries, and after
    it the ranks' rows are all-gathered back into the full ``(rows, D)`` output (trailing padding rows beyond the
    counted tokens come back as zeros, as the module returns them). The router must stay whole so the counts are
    the same on every rank (they are read on the host: one sync per call).

    Attributes:
        parameters: The module's parameters with one entry per expert along dim 0.
        tokens_arg: The ``forward`` argument holding the tokens sorted by expert (rows on dim 0).
        counts_arg: The ``forward`` argument holding the 1-D per-expert token counts.
    """

    parameters: tuple[str, ...]
    tokens_arg: str = "x"
    counts_arg: str = "num_tokens_per_expert"

    def __post_init__(self) -> None:
        if isinstance(self.parameters, str) or not self.parameters:
            raise ValueError(f"ExpertShard.parameters={self.parameters!r}: name the packed expert parameters")
        if not all(isinstance(p, str) and p and "." not in p for p in self.parameters):
            raise ValueError(f"ExpertShard.parameters={self.parameters!r}: attribute names on the module")
        object.__setattr__(self, "parameters", tuple(self.parameters))
        for field_name in ("tokens_arg", "counts_arg"):
            value = getattr(self, field_name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"ExpertShard.{field_name}={value!r}: a forward argument name")


Style = Colwise | Rowwise | ShardedNorm | LocalSlice | SplitParameter | LocalArgument | ExpertShard

# The layer types Colwise / Rowwise split, by exact type: Linear through DTensor, convolutions by channel slices.
LINEAR_TYPES = (torch.nn.Linear,)
CONV_TYPES = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)


@dataclass(frozen=True, kw_only=True)
class TensorParallelPlan:
    """How one transformer family is split over the tensor-parallel ranks.

    Attributes:
        layers: Module path pattern → style. Every pattern must match at least one module.
        divide: Attribute paths (``"transformer_blocks.*.attn.heads"``) divided by the degree after splitting.
        notes: One line for ``docs/models.md`` (what stays replicated and why).
        optional: Patterns of ``layers`` (or of ``divide``, without the attribute) that models of the family may
            lack (an image-to-video model's image projections); every other pattern must match.
        fallback: A plan used when ``tp`` does not divide this one's sizes (e.g. FFN-only for a model whose KV heads
            do not divide the degree); ``None``: such a degree is refused.
        name: What :func:`fastdit.summary` calls this plan (``"full"``, ``"ffn-only"``).
    """

    layers: Mapping[str, Style]
    divide: tuple[str, ...] = ()
    notes: str = ""
    optional: tuple[str, ...] = ()
    fallback: TensorParallelPlan | None = None
    name: str = "full"

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("TensorParallelPlan.layers={}: name at least one layer")
        for path, style in self.layers.items():
            if not isinstance(
                style, (Colwise, Rowwise, ShardedNorm, LocalSlice, SplitParameter, LocalArgument, ExpertShard)
            ):
                raise ValueError(
                    f"TensorParallelPlan.layers[{path!r}]={style!r}: expected Colwise, Rowwise, ShardedNorm, "
                    "LocalSlice, SplitParameter, LocalArgument or ExpertShard"
                )
        known = {*self.layers, *(path.rpartition(".")[0] for path in self.divide)}
        for path in self.optional:
            if path not in known:
                raise ValueError(f"TensorParallelPlan.optional entry {path!r}: not a pattern of layers or divide")
        for path in self.divide:
            if not path or path.endswith(".") or path.startswith("."):
                raise ValueError(f"TensorParallelPlan.divide entry {path!r}: expected 'module.path.attribute'")
        # A copy: the plan is shared by every transformer of the family, whatever the caller does to its dict.
        object.__setattr__(self, "layers", dict(self.layers))


# The norms :class:`ShardedNorm` knows how to split, by exact class.
_NORM_KINDS = {
    "torch.nn.modules.normalization.RMSNorm": "rms",
    "diffusers.models.normalization.RMSNorm": "rms",
    "torch.nn.modules.normalization.LayerNorm": "layer",
}


def norm_kind(module: torch.nn.Module) -> str | None:
    """``"rms"`` or ``"layer"`` for a norm :class:`ShardedNorm` can split, else ``None``."""
    cls = type(module)
    return _NORM_KINDS.get(f"{cls.__module__}.{cls.__qualname__}")


def plan_layers(transformer: torch.nn.Module, plan: TensorParallelPlan) -> list[tuple[str, torch.nn.Module, Style]]:
    """Every module the plan splits, with its style, in module order.

    Raises:
        ValueError: a pattern matches nothing, or a module is matched twice.
    """
    cls = type(transformer).__name__
    found: dict[str, tuple[torch.nn.Module, Style]] = {}
    for pattern, style in plan.layers.items():
        matches = match_modules(transformer, pattern)
        if not matches and pattern not in plan.optional:
            raise ValueError(f"tensor-parallel plan: path {pattern!r} matches no module of {cls}")
        for name, module in matches:
            if name in found:
                raise ValueError(f"tensor-parallel plan: module {name!r} of {cls} is matched by two patterns")
            found[name] = (module, style)
    order = {name: i for i, (name, _) in enumerate(transformer.named_modules())}
    return [(name, module, style) for name, (module, style) in sorted(found.items(), key=lambda kv: order[kv[0]])]


def divided_attributes(
    transformer: torch.nn.Module, plan: TensorParallelPlan
) -> list[tuple[str, torch.nn.Module, str]]:
    """``(module path, module, attribute)`` of every attribute the plan divides.

    Raises:
        ValueError: a path matches no module, or a matched module lacks the attribute or holds no int.
    """
    cls = type(transformer).__name__
    out = []
    for entry in plan.divide:
        path, _, attr = entry.rpartition(".")
        matches = match_modules(transformer, path)
        if not matches and path not in plan.optional:
            raise ValueError(f"tensor-parallel plan: divide {entry!r}: {path!r} matches no module of {cls}")
        for name, module in matches:
            value = getattr(module, attr, None)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(
                    f"tensor-parallel plan: divide {entry!r}: {name!r} ({type(module).__name__}) has no int "
                    f"attribute {attr!r} (got {value!r})"
                )
            out.append((name, module, attr))
    return out


def _feature_count(module: torch.nn.Module, style: Style) -> int:
    if isinstance(style, ShardedNorm):
        return module.weight.shape[0] if getattr(module, "weight", None) is not None else module.normalized_shape[-1]
    if isinstance(module, CONV_TYPES):
        return module.out_channels if isinstance(style, Colwise) else module.in_channels
    return module.out_features if isinstance(style, Colwise) else module.in_features


def unit_size(owner: torch.nn.Module, style: Style, where: str) -> int | None:
    """The absolute size of a style's ``unit`` (``None``: no unit)."""
    unit = getattr(style, "unit", None)
    if unit is None or isinstance(unit, int):
        return unit
    if isinstance(unit, str):
        value = resolve_attr(owner, unit)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"tensor-parallel plan: {where!r} unit {unit!r} reads {value!r}, not a positive int")
        return value
    numerator, denominator = (resolve_attr(owner, path) for path in unit)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (numerator, denominator)):
        raise ValueError(f"tensor-parallel plan: {where!r} unit {unit} reads {numerator!r} / {denominator!r}")
    if numerator % denominator:
        raise ValueError(f"tensor-parallel plan: {where!r} unit {unit}: {numerator} / {denominator} is not whole")
    return numerator // denominator


def segment_sizes(owner: torch.nn.Module | None, module: torch.nn.Module, style: Style, where: str) -> list[int]:
    """The absolute sizes of the style's segments on ``module`` (summing to the split feature count).

    Args:
        owner: The module holding ``module`` (attribute segments are read on it).
        module: The split module.
        style: Its style.
        where: The module's path, for messages.

    Raises:
        ValueError: the segments do not add up to the feature count.
    """
    if isinstance(style, LocalSlice):
        raise ValueError(f"tensor-parallel plan: {where!r}: a LocalSlice's sizes are known only from its output")
    total = _feature_count(module, style)
    if not style.segments:
        return [total]
    if all(isinstance(s, int) for s in style.segments):
        unit, rest = divmod(total, sum(style.segments))
        if rest:
            raise ValueError(
                f"tensor-parallel plan: {where!r} has {total} features, not divisible into segments {style.segments}"
            )
        return [s * unit for s in style.segments]
    sizes = []
    for segment in style.segments:
        if isinstance(segment, int):
            raise ValueError(f"tensor-parallel plan: {where!r} segments {style.segments} mix ints and attributes")
        value = resolve_attr(owner, segment)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"tensor-parallel plan: {where!r} segment {segment!r} is not an int attribute ({value!r})")
        sizes.append(value)
    if sum(sizes) != total:
        raise ValueError(
            f"tensor-parallel plan: {where!r} has {total} features, but its segments {style.segments} add up to "
            f"{sum(sizes)} ({sizes})"
        )
    return sizes


def parent_of(transformer: torch.nn.Module, path: str) -> tuple[torch.nn.Module, str]:
    """The module holding ``path``'s last component, and that component's name."""
    parent_path, _, child = path.rpartition(".")
    return (transformer.get_submodule(parent_path) if parent_path else transformer), child


def _divisors(n: int) -> list[int]:
    return [d for d in range(2, n + 1) if n % d == 0]


def validate_tp_plan(transformer: torch.nn.Module, plan: TensorParallelPlan, degree: int, family: str) -> None:
    """Check ``plan`` against ``transformer`` for ``degree`` ranks, without moving or reading a weight.

    Raises:
        ValueError: naming the family, the path or attribute, its value and the degrees that would work.
    """
    sizes: list[tuple[str, int]] = []
    for name, module, style in plan_layers(transformer, plan):
        if isinstance(style, LocalSlice):
            continue  # any module; its output's sizes are checked when it runs
        if isinstance(style, LocalArgument):  # its tensors' sizes are checked when it runs
            params = list(inspect.signature(type(module).forward).parameters)[1:]
            if style.name not in params:
                raise ValueError(
                    f"tensor-parallel plan of {family!r}: {name!r}.forward has no argument {style.name!r} "
                    f"(LocalArgument); its arguments are {params}"
                )
            continue
        if isinstance(style, ExpertShard):
            sizes += expert_counts(module, style, name, family)
            continue
        if isinstance(style, SplitParameter):
            param = style.parameter(module)
            if param is None and not any(name in {n for n, _ in match_modules(transformer, p)} for p in plan.optional):
                raise ValueError(f"tensor-parallel plan of {family!r}: {name!r} has no parameter {style.name!r}")
            if param is not None and style.splits(param):
                sizes.append((f"{name}.{style.name}", param.shape[style.dim]))
            continue
        _check_layer_type(name, module, style, family)
        owner, _ = parent_of(transformer, name)
        segments = segment_sizes(owner, module, style, name)
        sizes += [(f"{name} segment {i}", s) for i, s in enumerate(segments)]
        unit = unit_size(owner, style, name)
        if unit is not None:
            for i, size in enumerate(segments):
                if size % unit:
                    raise ValueError(f"tensor-parallel plan of {family!r}: {name} segment {i} = {size} is not a "
                                     f"whole number of units of {unit}")  # fmt: skip
                sizes.append((f"{name} segment {i} in units of {unit}", size // unit))
        groups = getattr(module, "groups", 1) if isinstance(module, CONV_TYPES) else 1
        if groups > 1:
            sizes.append((f"{name}.groups", groups))
    for name, module, attr in divided_attributes(transformer, plan):
        sizes.append((f"{name}.{attr}" if name else attr, getattr(module, attr)))
    common = math.gcd(*(size for _, size in sizes))
    for what, size in sizes:
        if size % degree:
            valid = ", ".join(map(str, _divisors(common))) or "none"
            raise ValueError(
                f"tensor-parallel plan of {family!r}: {what} = {size} is not divisible by tp={degree}; "
                f"valid tp degrees for this model: {valid}"
            )


def expert_counts(module: torch.nn.Module, style: ExpertShard, name: str, family: str) -> list[tuple[str, int]]:
    """``(what, experts)`` of each parameter an :class:`ExpertShard` splits; all must hold the same expert count.

    Raises:
        ValueError: a parameter is missing, has no expert dim, or the counts differ; or ``forward`` lacks an argument.
    """
    where = f"tensor-parallel plan of {family!r}: {name!r} ({type(module).__name__})"
    params = list(inspect.signature(type(module).forward).parameters)[1:]
    for arg in (style.tokens_arg, style.counts_arg):
        if arg not in params:
            raise ValueError(f"{where}: forward has no argument {arg!r} (ExpertShard); its arguments are {params}")
    found = []
    for pname in style.parameters:
        param = module._parameters.get(pname)
        if param is None or param.dim() < 1:
            raise ValueError(f"{where} has no packed expert parameter {pname!r} (ExpertShard.parameters)")
        found.append((f"{name}.{pname} experts", param.shape[0]))
    if len({n for _, n in found}) != 1:
        raise ValueError(f"{where}: the expert parameters hold different expert counts {found}")
    return found


def _check_layer_type(name: str, module: torch.nn.Module, style: Style, family: str) -> None:
    where = f"tensor-parallel plan of {family!r}: {name!r} is a {type(module).__name__}"
    if isinstance(style, ShardedNorm):
        if norm_kind(module) is None:
            raise ValueError(f"{where}, which ShardedNorm cannot split (RMSNorm or LayerNorm only)")
        return
    if type(module) in CONV_TYPES:
        if isinstance(style, Colwise) and style.gather_output:
            raise ValueError(f"{where}: gather_output applies to a Linear only")
        if isinstance(style, Rowwise) and module.groups != 1:
            raise ValueError(f"{where} with groups={module.groups}: a grouped convolution splits column-wise only")
        return
    if type(module) not in LINEAR_TYPES:
        raise ValueError(f"{where}, not a torch.nn.Linear or a convolution")


def resolve_tp_plan(
    transformer: torch.nn.Module, plan: TensorParallelPlan, degree: int, family: str
) -> TensorParallelPlan:
    """The plan that fits ``degree``: ``plan`` itself, else the first of its fallbacks that does.

    Raises:
        ValueError: no plan of the chain fits; the message is the first plan's (the one the user expects).
    """
    candidate: TensorParallelPlan | None = plan
    first_error: ValueError | None = None
    while candidate is not None:
        try:
            validate_tp_plan(transformer, candidate, degree, family)
            return candidate
        except ValueError as error:
            first_error = first_error or error
            candidate = candidate.fallback
    raise first_error
