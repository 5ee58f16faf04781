"""Context parallelism: split a transformer's sequence over ranks per its plan, route attention, gather the output.

:func:`apply_context_parallel` reads the adapter's :class:`~fastdit.parallel.plan.ContextParallelPlan` and installs

* a hook on the transformer (layer ``PARALLEL_INPUT``, name ``cp.root``) that starts a forward (forgets the previous
  forward's split record) and splits the root ``forward`` arguments the plan names;
* for plan paths below the root, a split of the named ``forward`` arguments (layer ``PARALLEL_INPUT``): it nests
  outside a cache hook on the same module (``Layer.SKIP``), so a cache hook on ``blocks.0`` sees the split tensors,
  exactly as if the model's own loop had passed them. Leading-token counts (:class:`LeadingCount`) are adjusted by
  hooks installed after every split hook (same layer, later in order), so they see this forward's split record;
* on modules whose output is split or gathered, a hook at ``PARALLEL_OUTPUT`` (``cp.output``): outside every hook
  that may skip the call, so a cached last block still gathers;
* the attention routing (:mod:`fastdit.parallel.attention.dispatch`: ``dispatch_attention_fn`` and/or the ``F``
  of processors that call SDPA themselves); the processors of the attention modules the
  plan lists as ``local`` stay unmarked and run ordinary attention, and those it lists as ``head_parallel`` run on
  the whole sequence of the rank's heads (:mod:`fastdit.parallel.attention.head_parallel`).

Sizes that do not divide the degree are split unevenly (the first ``size % degree`` ranks get one more; one log
line says so). Every decision that leads to a collective depends only on global sizes, never on a rank's own share.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from fastdit.config import Attention, Parallel
from fastdit.errors import ShardError
from fastdit.hooks import layers
from fastdit.hooks.args import ForwardArgs
from fastdit.hooks.state import Applied
from fastdit.parallel.attention.comm import gather_lengths, shard_sizes
from fastdit.parallel.attention.dispatch import (
    ContextParallelAttention,
    ForwardLayout,
    local_attention,
    mark_attention_modules,
    mark_processors,
    route_marked_dispatch,
    route_modules,
    route_sdpa_calls,
    route_sdpa_modules,
)
from fastdit.parallel.attention.head_parallel import install_head_parallel
from fastdit.parallel.plan import (
    ContextParallelPlan,
    GatherInput,
    GatherOutput,
    LeadingCount,
    LengthLogBase,
    LocalExtent,
    SplitInput,
    SplitOutput,
    head_parallel_paths,
    linear_attention_paths,
    local_attention_paths,
    match_modules,
    passes_whole,
    sdpa_call_paths,
    unit_argument,
    validate_plan,
)
from fastdit.parallel.runtime import ParallelRuntime
from fastdit.parallel.token_mixing import install_halos, install_token_sums

__all__ = ["OUTPUT_HOOK", "ROOT_HOOK", "apply_context_parallel", "context_parallel_group"]

ROOT_HOOK = "cp.root"
OUTPUT_HOOK = "cp.output"
INPUT_HOOK = "cp.input"

logger = logging.getLogger(__name__)


def context_parallel_group(runtime: ParallelRuntime) -> dist.ProcessGroup | None:
    """The group the sequence is split over: ring × Ulysses ranks, ring-major (``None`` without parallelism)."""
    parallel = runtime.parallel
    if runtime.mesh is None:
        return None
    if parallel.ring == 1:
        return runtime.group("ulysses")
    if parallel.ulysses == 1:
        return runtime.group("ring")
    # USP: the split runs over both dims; a flattened sub-mesh gives the ring-major rank order USP expects.
    return runtime.flat_group(("ring", "ulysses"))


class _Splitter:
    """Splits and gathers tensors over the context-parallel group, recording what it split."""

    def __init__(self, group: dist.ProcessGroup | None, layout: ForwardLayout, *, log: bool) -> None:
        self.group = group
        self.degree = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.layout = layout
        self._log = log
        self._logged: set[tuple[str, int]] = set()

    def split(
        self,
        tensor: Any,
        dim: int,
        expected_dims: int | None,
        name: str,
        unit: int = 1,
        keep_singleton: bool | None = None,
        allow_empty: bool = False,
    ) -> Any:
        if isinstance(tensor, (tuple, list)):  # e.g. a (cos, sin) RoPE pair passed as one argument
            return type(tensor)(
                self.split(t, dim, expected_dims, name, unit, keep_singleton, allow_empty) for t in tensor
            )
        if isinstance(tensor, dict):  # e.g. RoPE tables by role, {"query": ..., "key": ...} (AnyFlow)
            return {
                k: self.split(t, dim, expected_dims, name, unit, keep_singleton, allow_empty) for k, t in tensor.items()
            }
        if not isinstance(tensor, torch.Tensor) or (expected_dims is not None and tensor.ndim != expected_dims):
            return tensor
        if self.degree > 1 and not allow_empty and passes_whole(tensor, dim, keep_singleton):
            return tensor  # one row broadcast against the split tokens: every rank needs it whole (not recorded)
        total = tensor.shape[dim]
        if unit < 1 or total % unit:  # global sizes: every rank raises alike
            raise ShardError(
                f"context parallel: {name} has {total} tokens along dim {dim}, not a multiple of its split unit {unit}"
            )
        if total // unit < self.degree and not allow_empty:
            what = "tokens" if unit == 1 else f"units of {unit} tokens"
            raise ShardError(
                f"context parallel: {name} has {total // unit} {what} along dim {dim}, fewer than the "
                f"{self.degree} ranks"
            )
        sizes = [n * unit for n in shard_sizes(total // unit, self.degree)]
        self.layout.record(name, sizes)
        if len(set(sizes)) > 1 and self._log and (name, total) not in self._logged:
            self._logged.add((name, total))
            logger.info(
                "context parallel: %s has %d tokens along dim %d, split unevenly over %d ranks as %s",
                name,
                total,
                dim,
                self.degree,
                sizes,
            )
        return tensor.narrow(dim, sum(sizes[: self.rank]), sizes[self.rank])

    def split_like(self, tensor: Any, dim: int, expected_dims: int | None, name: str, like: str) -> Any:
        """``tensor``, as long along ``dim`` as the split input ``like``, split with that input's shard sizes."""
        if isinstance(tensor, (tuple, list)):
            return type(tensor)(self.split_like(t, dim, expected_dims, name, like) for t in tensor)
        if not isinstance(tensor, torch.Tensor) or (expected_dims is not None and tensor.ndim != expected_dims):
            return tensor
        sizes = self.layout.splits.get(like)
        if sizes is None:
            return tensor  # ``like`` is whole in this forward
        if sum(sizes) != tensor.shape[dim]:  # global sizes: every rank raises alike
            raise ValueError(
                f"context parallel: {name} has {tensor.shape[dim]} tokens along dim {dim}, but {like} (SplitOutput."
                f"like) was split from {sum(sizes)}"
            )
        self.layout.record(name, list(sizes))
        return tensor.narrow(dim, sum(sizes[: self.rank]), sizes[self.rank])

    def split_segments(
        self, tensor: Any, dim: int, expected_dims: int | None, name: str, segments: tuple[str, ...]
    ) -> Any:
        """``tensor``, the concatenation of ``segments`` along ``dim``, split per segment as those were in this call."""
        if isinstance(tensor, (tuple, list)):
            return type(tensor)(self.split_segments(t, dim, expected_dims, name, segments) for t in tensor)
        if not isinstance(tensor, torch.Tensor) or (expected_dims is not None and tensor.ndim != expected_dims):
            return tensor
        # The record holds every rank's sizes, so every rank takes the same branch and raises alike.
        missing = [s for s in segments if s not in self.layout.splits]
        if missing:
            raise ValueError(f"context parallel: {name} spans segments {segments}, but {missing} were not split")
        sizes = [self.layout.splits[s] for s in segments]
        if sum(map(sum, sizes)) != tensor.shape[dim]:
            raise ValueError(
                f"context parallel: {name} has {tensor.shape[dim]} tokens along dim {dim}, but its segments "
                f"{segments} have {[sum(s) for s in sizes]}"
            )
        pieces, start = [], 0
        for lens in sizes:
            pieces.append(tensor.narrow(dim, start + sum(lens[: self.rank]), lens[self.rank]))
            start += sum(lens)
        self.layout.record(name, [sum(row) for row in zip(*sizes, strict=True)])
        return torch.cat(pieces, dim=dim)

    def split_groups(self, tensor: Any, dim: int, expected_dims: int | None, name: str, of: str) -> Any:
        """``tensor`` whose ``dim`` flattens groups of ``of``'s global tokens, each group split as ``of`` was."""
        if isinstance(tensor, (tuple, list)):
            return type(tensor)(self.split_groups(t, dim, expected_dims, name, of) for t in tensor)
        if not isinstance(tensor, torch.Tensor) or (expected_dims is not None and tensor.ndim != expected_dims):
            return tensor
        lens = self.layout.splits.get(of)
        if lens is None:
            return tensor  # ``of`` is whole in this forward, so are its groups
        dim = dim % tensor.ndim
        group, size = sum(lens), tensor.shape[dim]
        if size % group:  # global sizes: every rank raises alike
            raise ShardError(
                f"context parallel: {name} has {size} rows along dim {dim}, not whole groups of the {group} tokens of "
                f"{of} (SplitInput.groups_of)"
            )
        groups = tensor.unflatten(dim, (size // group, group))
        local = groups.narrow(dim + 1, sum(lens[: self.rank]), lens[self.rank]).flatten(dim, dim + 1)
        self.layout.record(name, [n * (size // group) for n in lens])
        return local

    def split_tail(self, tensor: Any, dim: int, expected_dims: int | None, name: str, of: str) -> Any:
        """``tensor``, lined up with the last tokens of the split input ``of``: the part inside this rank's shard."""
        if isinstance(tensor, (tuple, list)):
            return type(tensor)(self.split_tail(t, dim, expected_dims, name, of) for t in tensor)
        if not isinstance(tensor, torch.Tensor) or (expected_dims is not None and tensor.ndim != expected_dims):
            return tensor
        lens = self.layout.splits.get(of)
        if lens is None:  # ``of`` passed whole in this forward: so does its tail
            return tensor
        total, length = sum(lens), tensor.shape[dim]
        if length > total:  # global sizes: every rank raises alike
            raise ShardError(f"context parallel: {name} has {length} tokens along dim {dim}, more than {of} ({total})")
        offset = total - length  # the tokens of ``of`` before its tail
        start = sum(lens[: self.rank])
        first = max(start, offset)
        return tensor.narrow(dim, first - offset, max(start + lens[self.rank] - first, 0))

    def count(self, value: Any, of: str, *, trailing: bool = False) -> Any:
        """A count ``value`` of leading (or, ``trailing``, last) tokens of ``of``, narrowed to this rank's contiguous
        shard of ``of``."""
        lens = self.layout.splits.get(of)
        if lens is None or not isinstance(value, int) or isinstance(value, bool):
            return value  # not split in this forward (tokens whole), or not a count
        start = sum(lens[: self.rank])
        if trailing:  # the last ``value`` tokens begin at total - value
            return min(max(start + lens[self.rank] - (sum(lens) - value), 0), lens[self.rank])
        return min(max(value - start, 0), lens[self.rank])

    def extent(self, value: Any, of: str) -> Any:
        """A grid extent ``value`` (e.g. rows) of the tokens of ``of``, narrowed to this rank's share of them."""
        lens = self.layout.splits.get(of)
        if lens is None or not isinstance(value, int) or isinstance(value, bool):
            return value
        total = sum(lens)
        if value < 1 or any(n * value % total for n in lens):  # every rank's lengths: all raise alike
            raise ValueError(
                f"context parallel: the shards {lens} of {of} are not whole parts of its extent {value} (split it "
                "with SplitInput.unit so that every shard holds whole rows)"
            )
        return lens[self.rank] * value // total

    def log_base(self, value: Any, of: str) -> Any:
        """A logarithm base ``value`` that, over this rank's shard of ``of``, measures the global length of ``of``."""
        lens = self.layout.splits.get(of)
        if lens is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            return value  # not split in this forward, or no base (no proportional attention)
        if min(lens) < 2:  # every rank's lengths: all raise alike
            raise ShardError(
                f"context parallel: the shards {lens} of {of} include one of a single token, whose length has no "
                "logarithm to rescale (LengthLogBase); use fewer ranks"
            )
        return math.exp(math.log(value) * math.log(lens[self.rank]) / math.log(sum(lens)))

    def gather(self, tensor: Any, dim: int, expected_dims: int | None) -> Any:
        if not isinstance(tensor, torch.Tensor) or (expected_dims is not None and tensor.ndim != expected_dims):
            return tensor
        dim = dim % tensor.ndim
        local = tensor.shape[dim]
        if self.layout.even:
            sizes = [local] * self.degree
        else:  # the flag is global: every rank comes here
            rows = self.layout.shard_lengths(
                [local], lambda values: gather_lengths(values, self.group, tensor.device), self.rank
            )
            sizes = [row[0] for row in rows]
        longest = max(sizes)
        padded = tensor
        if local < longest:
            pad_shape = list(tensor.shape)
            pad_shape[dim] = longest - local
            padded = torch.cat([tensor, tensor.new_zeros(pad_shape)], dim=dim)
        parts = [torch.empty_like(padded) for _ in range(self.degree)]
        dist.all_gather(parts, padded.contiguous(), group=self.group)
        return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes, strict=True)], dim=dim)


_Spec = SplitInput | LeadingCount | LocalExtent | LengthLogBase | GatherInput


class _ArgPositions:
    """Splits the named arguments of one module's calls per their specs."""

    def __init__(self, module: torch.nn.Module, specs: Mapping[str, _Spec]) -> None:
        # A name absent from the signature arrives through *args at the position the plan gives (validated).
        self.args = ForwardArgs(module, specs, {name: getattr(spec, "position", None) for name, spec in specs.items()})

    def split(self, args: tuple, kwargs: dict, specs: Mapping[str, _Spec], splitter: _Splitter) -> tuple:
        args = list(args)
        for name, spec in specs.items():
            if not self.args.passed(name, args, kwargs):
                continue
            value = self.args.get(name, args, kwargs)
            self.args.replace(name, spec.adjust(value, splitter, name, self._unit(spec, args, kwargs)), args, kwargs)
        return tuple(args), kwargs

    def _unit(self, spec: _Spec, args: list, kwargs: dict) -> int:
        """The product of the integer arguments a ``SplitInput.unit`` names (1 without a unit)."""
        unit = 1
        for name in getattr(spec, "unit", ()):
            param, element = unit_argument(name)
            value = self.args.param(param, args, kwargs)  # validated: a forward parameter
            if element is not None:  # "THW[1]": an element of a tuple argument
                value = value[element] if isinstance(value, (tuple, list)) and element < len(value) else value
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"context parallel: split unit {name!r} is {value!r}, not an int")
            unit *= value
        return unit


def _splits_then_counts(specs: Mapping[str, _Spec]) -> tuple[dict[str, _Spec], dict[str, _Spec]]:
    """``specs`` divided into plain splits, then the items that read this forward's split record: leading-token
    counts, local extents, segment-wise splits and gathered inputs."""
    splits = {n: s for n, s in specs.items() if not s.reads_record}
    counts = {n: s for n, s in specs.items() if n not in splits}
    return splits, counts


def _at_index(output: Any, index: int | tuple[int, ...] | None, fn: Callable[[Any], Any]) -> Any:
    """``fn`` applied to ``output``, or with ``index`` only to that element (or those elements) of a tuple/list."""
    if index is None or not isinstance(output, (tuple, list)):
        return fn(output)
    items = list(output)
    for i in index if isinstance(index, tuple) else (index,):
        items[i] = fn(items[i])
    return type(output)(items) if isinstance(output, tuple) else items


class _RootHook(layers.LayerHook):
    """Begins a forward (fresh split record) and splits the root's inputs."""

    def __init__(self, module: torch.nn.Module, specs: Mapping[str, _Spec], splitter: _Splitter) -> None:
        splits, counts = _splits_then_counts(specs)
        self.specs = {**splits, **counts}  # counts after the splits they read
        self.splitter = splitter
        self._args = _ArgPositions(module, self.specs)

    def pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self.splitter.layout.reset()
        return self._args.split(args, kwargs, self.specs, self.splitter)


class _InputHook(layers.LayerHook):
    """Splits (or, for counts, narrows) a sub-module's named arguments."""

    def __init__(self, module: torch.nn.Module, specs: Mapping[str, _Spec], splitter: _Splitter) -> None:
        self.specs = dict(specs)
        self.splitter = splitter
        self._args = _ArgPositions(module, self.specs)

    def pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return self._args.split(args, dict(kwargs), self.specs, self.splitter)


class _OutputHook(layers.LayerHook):
    """Splits or gathers a module's output."""

    def __init__(self, path: str, splits: tuple[SplitOutput, ...], gather: GatherOutput | None, splitter: _Splitter):
        self.path = path
        self.splits = splits
        self.gather = gather
        self.splitter = splitter

    def post(self, module: torch.nn.Module, output: Any) -> Any:
        for spec in self.splits:
            name = self.path if spec.index is None else f"{self.path}[{spec.index}]"

            def split(value: Any, spec: SplitOutput = spec, name: str = name) -> Any:
                if spec.like:
                    return self.splitter.split_like(value, spec.dim, spec.expected_dims, name, spec.like)
                return self.splitter.split(value, spec.dim, spec.expected_dims, name, 1, spec.keep_singleton)

            if spec.index is None:
                output = split(output)
            else:
                items = list(output)
                items[spec.index] = split(items[spec.index])
                output = type(output)(items) if isinstance(output, tuple) else items
        if self.gather is not None:
            spec = self.gather
            output = _at_index(output, spec.index, lambda t: self.splitter.gather(t, spec.dim, spec.expected_dims))
        return output


def _install_hooks(transformer: torch.nn.Module, plan: ContextParallelPlan, splitter: _Splitter) -> Callable[[], None]:
    undo: list[Callable[[], None]] = []
    root = _RootHook(transformer, dict(plan.inputs.get("", {})), splitter)
    undo.append(layers.install(transformer, layers.Layer.PARALLEL_INPUT, ROOT_HOOK, root))
    # Two passes: hooks of one layer run in installation order, so on any module the counts (and segment-wise
    # splits) follow every plain split (from any path matching it) and read this forward's split record.
    for which in (0, 1):
        for path, all_specs in plan.inputs.items():
            specs = _splits_then_counts(all_specs)[which]
            if path == "" or not specs:
                continue
            for _, module in match_modules(transformer, path):
                hook = _InputHook(module, specs, splitter)
                undo.append(layers.install(module, layers.Layer.PARALLEL_INPUT, f"{INPUT_HOOK}.{which}.{path}", hook))
    for path in dict.fromkeys([*plan.outputs, *plan.gather]):
        for _, module in match_modules(transformer, path):
            # One hook object per module and path.
            hook = _OutputHook(path, plan.outputs.get(path, ()), plan.gather.get(path), splitter)
            undo.append(layers.install(module, layers.Layer.PARALLEL_OUTPUT, f"{OUTPUT_HOOK}.{path}", hook))

    def remove() -> None:
        for fn in reversed(undo):
            fn()

    return remove


def _marker(
    plan: ContextParallelPlan,
    parallel: Parallel,
    runtime: ParallelRuntime,
    group: dist.ProcessGroup | None,
    attention: Attention | None,
) -> ContextParallelAttention:
    """The context-parallel attention the routed processors of one transformer call."""
    return ContextParallelAttention(
        cp_group=group,
        ulysses_group=runtime.group("ulysses") if parallel.ulysses > 1 else None,
        ring_group=runtime.group("ring") if parallel.ring > 1 else None,
        ulysses_degree=parallel.ulysses,
        ring_degree=parallel.ring,
        local=local_attention(attention),
        mask_segments=plan.attention.mask_segments,
        fp8=parallel.comm_fp8,
        chunks=parallel.ulysses_chunks,
        mask_transform=plan.attention.mask_transform,
        exchange_lengths=plan.attention.exchange_lengths,
    )


def _install_routing(
    transformer: torch.nn.Module,
    plan: ContextParallelPlan,
    marker: ContextParallelAttention,
    group: dist.ProcessGroup | None,
    undo: list[Callable[[], None]],
) -> None:
    """Route the plan's attention to ``marker`` (and linear attention, halos to their hooks); undos go to ``undo``."""
    routing = plan.attention
    linear = linear_attention_paths(transformer, routing)
    heads = head_parallel_paths(transformer, routing)
    # Linear and head-parallel attention are not routed like softmax attention: their modules are left unmarked.
    local_paths = local_attention_paths(transformer, routing, plan.optional) | set(linear) | set(heads)
    if linear:
        undo.append(install_token_sums(transformer, linear, group))
    if heads:
        undo.append(install_head_parallel(transformer, heads, marker))
    if plan.halo:
        undo.append(install_halos(transformer, plan.halo, group))
    if routing.modules:
        undo.append(route_modules(routing.modules))
        undo.append(mark_processors(transformer, marker, local_paths))
    if routing.sdpa_modules:
        undo.append(route_sdpa_modules(routing.sdpa_modules))
    if routing.dispatch_modules:
        undo.append(route_marked_dispatch(routing.dispatch_modules))
    if routing.sdpa_modules or routing.dispatch_modules:
        undo.append(mark_attention_modules(transformer, marker, local_paths))
    if routing.sdpa_calls:
        undo.append(route_sdpa_calls(transformer, sdpa_call_paths(transformer, routing), marker))


def apply_context_parallel(
    transformer: torch.nn.Module,
    plan: ContextParallelPlan,
    parallel: Parallel,
    runtime: ParallelRuntime,
    *,
    attention: Attention | None = None,
    family: str = "model",
) -> Applied:
    """Split ``transformer``'s sequence over the ring × Ulysses ranks of ``runtime`` per ``plan``.

    Args:
        transformer: The denoiser (its weights already on this rank's device).
        plan: Its context-parallel plan (:attr:`ModelAdapter.cp_plan`).
        parallel: The parallel layout (``ulysses`` and/or ``ring`` > 1).
        runtime: Process groups of this run.
        attention: Local attention backend (default SDPA).
        family: The family's name, for messages.

    Returns:
        The undo (removes every hook and routing again); its ``state`` is the forward's split layout
        (:class:`ForwardLayout`, whose ``signature`` is equal on every rank).

    Raises:
        ValueError: the plan does not fit the module tree (nothing is installed).
    """
    validate_plan(transformer, plan, parallel.ulysses)
    if plan.attention.exchange_lengths and parallel.ulysses > 1 and parallel.ring > 1:
        raise ValueError(
            f"parallel={parallel}: model family {family!r} has attention lengths that depend on the data "
            "(AttentionRouting.exchange_lengths), which USP (ulysses and ring together) cannot take; use one of them"
        )
    group = context_parallel_group(runtime)
    marker = _marker(plan, parallel, runtime, group, attention)
    splitter = _Splitter(group, marker.forward, log=runtime.is_main)
    undo: list[Callable[[], None]] = []
    try:
        _install_routing(transformer, plan, marker, group, undo)
        undo.append(_install_hooks(transformer, plan, splitter))
    except BaseException:
        for fn in reversed(undo):
            fn()
        raise

    def remove() -> None:
        for fn in reversed(undo):
            fn()

    return Applied(remove, marker.forward)
