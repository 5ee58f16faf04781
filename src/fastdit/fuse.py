"""Fusion of the projections that share an input: one matmul per group instead of one per layer.

A transformer block often applies several Linear layers to one tensor: FLUX's single blocks project the normalised
hidden states with ``attn.to_q``, ``attn.to_k``, ``attn.to_v`` and ``proj_mlp``, its double blocks each stream with
three. Each matmul alone is narrower than a large GPU likes (a 512-token text stream's projection fills about a third
of an H100's SMs). Fusing concatenates a group's weights and biases along the output dim into one layer; the first
member called computes the whole group's output, and the others, called with the same tensor, take their columns of
it. The model's code is untouched: each member keeps its place and its call; only what its call computes changes.

Which layers share an input is family data (:attr:`fastdit.models.base.ModelAdapter.fused_projections`: per block
list, member paths relative to a block), checked against the module tree before anything is touched, and for every
family's tiny pipelines against a traced call (:func:`shared_input_groups`). A member called with another tensor than
the one its group last computed on computes the group again on its own input: correct, only slower, and counted as
a miss in :func:`fastdit.summary` — a wrong declaration can cost time, never results.

Under ``torch.compile`` the same Python logic is traced: dynamo sees one matmul and the members' slices, so inductor
emits one GEMM per group. CUDA graphs capture what a call ran. Quantization, applied after fusion, quantizes each
group's layer in place of its members (static FP8 takes the largest of the members' recorded input maxima, all
recorded on the same tensor).

Undo: the members' forwards are restored and their weights and biases — moved to the host while the group's copy is
in use, when they were on an accelerator — moved back: the same objects with the same values.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fastdit.attrs import expand_path, is_pattern, resolve_attr
from fastdit.config import Fuse
from fastdit.hooks.state import Applied, park_on_host

__all__ = [
    "FuseState",
    "FusedGroup",
    "apply_fuse",
    "declared_form",
    "expand_group",
    "group_name",
    "plan_groups",
    "shared_input_groups",
]

Undo = Callable[[], None]
ProjectionGroups = Mapping[str, tuple[tuple[str, ...], ...]]
"""Block-list path → groups of member paths relative to one block of that list (the adapter's declaration)."""


def group_name(block: str, members: Sequence[str]) -> str:
    """The name of a fused group in the summary and the quantization report: ``block.[member,member,...]``."""
    return f"{block}.[{','.join(members)}]"


@dataclass
class FusedGroup:
    """One group of Linear layers computed by one matmul.

    Attributes:
        name: :func:`group_name` of the group (the block's path and the members' paths in it).
        members: The members' paths in the transformer, in declaration order.
        linear: The concatenated layer (not registered in the module tree: the model's state dict keeps its own
            keys). Quantization may quantize it in place.
        spans: Each member's columns ``(start, stop)`` in the group's output.
    """

    name: str
    members: tuple[str, ...]
    linear: torch.nn.Linear
    spans: tuple[tuple[int, int], ...]
    hits: int = 0
    misses: int = 0
    _input: torch.Tensor | None = field(default=None, repr=False)
    _version: int = field(default=-1, repr=False)
    _output: torch.Tensor | None = field(default=None, repr=False)
    _left: int = field(default=0, repr=False)

    def member_forward(self, index: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """The forward of member ``index``: its columns of the group's output on its input."""
        start, stop = self.spans[index]

        def forward(x: torch.Tensor) -> torch.Tensor:
            return self._compute(x)[..., start:stop]

        return forward

    def _compute(self, x: torch.Tensor) -> torch.Tensor:
        # Identity, not value: the members of a block receive the very same tensor; the version counter catches an
        # in-place change between two members' calls. Under dynamo the counters and the version are left out (an
        # integer read there would be guarded on, and recompile every call); what remains traces to one matmul.
        # Tensors made under torch.inference_mode have no version counter: identity alone decides for them.
        compiling = torch.compiler.is_compiling()
        versioned = not compiling and not x.is_inference()
        if self._output is not None and self._input is x and (not versioned or self._version == x._version):
            output = self._output
            self._left -= 1
            if self._left <= 0:
                self._release()
            if not compiling:
                self.hits += 1
            return output
        if not compiling and self._output is not None:
            self.misses += 1  # a member before this one was left uncalled, or called on another tensor
        output = self.linear(x)
        self._input, self._output, self._left = x, output, len(self.spans) - 1
        if versioned:
            self._version = x._version
        return output

    def _release(self) -> None:
        self._input = self._output = None
        self._left = 0

    def stats(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "members": list(self.members),
            "out_features": [stop - start for start, stop in self.spans],
            "hits": self.hits,
            "misses": self.misses,
        }


@dataclass
class FuseState:
    """What fusion did to one transformer (:func:`fastdit.summary` reports :meth:`stats`).

    Attributes:
        groups: The fused groups, in module order.
        skipped: Declared groups left unfused, name → reason (an excluded member).
    """

    groups: list[FusedGroup] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def stats(self) -> dict[str, Any]:
        """JSON-ready form: the groups with their hit and miss counts (eager calls; compiled calls are not counted)."""
        return {
            "num_groups": len(self.groups),
            "num_layers": sum(len(g.members) for g in self.groups),
            "hits": sum(g.hits for g in self.groups),
            "misses": sum(g.misses for g in self.groups),
            "groups": {g.name: g.stats() for g in self.groups},
            "skipped": dict(self.skipped),
        }


@dataclass(frozen=True)
class PlannedGroup:
    """A declared group resolved on one transformer: its name and its members (path, layer)."""

    name: str
    members: tuple[tuple[str, torch.nn.Linear], ...]


def _block_lists(transformer: torch.nn.Module, declared: ProjectionGroups) -> Iterator[tuple[str, Any]]:
    for path in declared:
        names = expand_path(transformer, path) if is_pattern(path) else [path]
        for name in names:
            try:
                blocks = resolve_attr(transformer, name)
            except (AttributeError, IndexError):
                raise ValueError(f"fused projections of {path!r}: the transformer has no block list {name!r}") from None
            if not isinstance(blocks, torch.nn.ModuleList):
                raise ValueError(f"fused projections of {path!r}: {name!r} is a {type(blocks).__name__}, not a list")
            yield path, (name, blocks)


def _member(block: torch.nn.Module, block_name: str, path: str) -> torch.nn.Linear:
    where = f"{block_name}.{path}"
    try:
        module = resolve_attr(block, path)
    except (AttributeError, IndexError):
        raise ValueError(f"fused projection {where!r} does not exist") from None
    if type(module) is not torch.nn.Linear:
        raise ValueError(f"fused projection {where!r} is a {type(module).__name__}, not a torch.nn.Linear")
    weight = module.weight
    if type(weight.data) is not torch.Tensor:  # a DTensor (tensor parallelism) or a quantized torchao tensor
        kind = type(weight.data).__name__
        raise ValueError(f"fused projection {where!r}: its weight is a {kind}, not a plain tensor")
    if "forward" in module.__dict__:
        raise ValueError(f"fused projection {where!r}: its forward is already replaced (another technique)")
    return module


def expand_group(block: torch.nn.Module, group: tuple[str, ...]) -> list[tuple[str, ...]]:
    """``group`` made concrete in ``block``: itself, or — when its members have ``*`` components (one routed expert's
    projections, ``("ff.experts.*.w1", "ff.experts.*.w3")``) — one group per match of its first member, the other
    members' stars filled with the same names, in module order."""
    if not is_pattern(group[0]):
        return [group]
    stars = [i for i, part in enumerate(group[0].split(".")) if part == "*"]
    out = []
    for match in expand_path(block, group[0]):
        values = [match.split(".")[i] for i in stars]
        concrete = []
        for member in group:
            parts = member.split(".")
            for value, index in zip(values, (i for i, part in enumerate(parts) if part == "*"), strict=False):
                parts[index] = value
            concrete.append(".".join(parts))
        out.append(tuple(concrete))
    return out


def _check_group(block_name: str, members: list[tuple[str, torch.nn.Linear]]) -> None:
    first_path, first = members[0]
    for path, module in members[1:]:
        mismatch = [
            what
            for what, a, b in (
                ("in_features", first.in_features, module.in_features),
                ("dtype", first.weight.dtype, module.weight.dtype),
                ("device", first.weight.device, module.weight.device),
            )
            if a != b
        ]
        if mismatch:
            raise ValueError(
                f"fused projections {block_name}.{first_path} and {block_name}.{path} differ in {', '.join(mismatch)}: "
                "a group's layers must take one input"
            )


def plan_groups(transformer: torch.nn.Module, declared: ProjectionGroups, config: Fuse) -> tuple[list, dict]:
    """Resolve the declared groups on ``transformer``; nothing is changed.

    Args:
        transformer: The denoiser.
        declared: Its family's :attr:`~fastdit.models.base.ModelAdapter.fused_projections`.
        config: The request (its ``exclude`` patterns).

    Returns:
        The groups to fuse (:class:`PlannedGroup`, in module order) and those left out, name → reason.

    Raises:
        ValueError: A member is missing, not a plain ``torch.nn.Linear``, already altered, in two groups, or the
            members of a group differ in input size, dtype or device (the message names them).
    """
    planned: list[PlannedGroup] = []
    skipped: dict[str, str] = {}
    seen: set[str] = set()
    for path, (list_name, blocks) in _block_lists(transformer, declared):
        for index, block in enumerate(blocks):
            block_name = f"{list_name}.{index}"
            for group in (g for declared_group in declared[path] for g in expand_group(block, declared_group)):
                members = [(rel, _member(block, block_name, rel)) for rel in group]
                _check_group(block_name, members)
                full = tuple(f"{block_name}.{rel}" for rel in group)
                twice = seen.intersection(full)
                if twice:
                    raise ValueError(f"fused projection {sorted(twice)[0]!r} is declared in two groups")
                seen.update(full)
                name = group_name(block_name, group)
                excluded = next((p for n in full for p in config.exclude if fnmatch.fnmatchcase(n, p)), None)
                if excluded is not None:
                    skipped[name] = f"excluded by {excluded!r}"
                    continue
                planned.append(PlannedGroup(name, tuple(zip(full, (m for _, m in members), strict=True))))
    return planned, skipped


def _concatenated(members: Sequence[torch.nn.Linear]) -> tuple[torch.nn.Linear, tuple[tuple[int, int], ...]]:
    first = members[0].weight
    spans, start = [], 0
    for module in members:
        spans.append((start, start + module.out_features))
        start += module.out_features
    with torch.no_grad():
        weight = torch.cat([m.weight.detach() for m in members])
        # A member without a bias adds zeros: exact, and the group keeps one addmm.
        bias = None
        if any(m.bias is not None for m in members):
            bias = torch.cat(
                [m.bias.detach() if m.bias is not None else first.new_zeros(m.out_features) for m in members]
            )
    linear = torch.nn.Linear(first.shape[1], start, bias=bias is not None, device="meta")
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = torch.nn.Parameter(bias, requires_grad=False)
    return linear, tuple(spans)


def _install(group: PlannedGroup) -> tuple[FusedGroup, Undo]:
    modules = [module for _, module in group.members]
    linear, spans = _concatenated(modules)
    fused = FusedGroup(group.name, tuple(name for name, _ in group.members), linear, spans)
    undos: list[Undo] = []
    for index, module in enumerate(modules):
        module.forward = fused.member_forward(index)
        undos.append(lambda module=module: module.__dict__.pop("forward", None))
        undos += [park_on_host(p) for p in (module.weight, module.bias) if p is not None]

    def undo() -> None:
        fused._release()
        for fn in reversed(undos):
            fn()

    return fused, undo


def apply_fuse(transformer: torch.nn.Module, declared: ProjectionGroups, config: Fuse) -> Applied:
    """Fuse the declared groups of ``transformer`` in place.

    Args:
        transformer: The denoiser (one device; not split by tensor parallelism).
        declared: Its family's declaration.
        config: The request.

    Returns:
        The undo and a :class:`FuseState`.

    Raises:
        ValueError: As :func:`plan_groups`.
    """
    planned, skipped = plan_groups(transformer, declared, config)
    state = FuseState(skipped=skipped)
    undos: list[Undo] = []

    def undo_all() -> None:
        while undos:
            undos.pop()()

    try:
        for group in planned:
            fused, undo = _install(group)
            undos.append(undo)
            state.groups.append(fused)
    except BaseException:
        undo_all()
        raise
    return Applied(undo_all, state)


def shared_input_groups(blocks: torch.nn.Module, run: Callable[[], Any]) -> dict[str, list[tuple[str, ...]]]:
    """The Linear layers of ``blocks`` that one call of ``run`` applied to the very same tensor, per block.

    What a family's declaration must say (the family tests compare them). Each Linear's first input of the call is
    recorded by identity; layers given one tensor form a group, in call order.

    Args:
        blocks: A block list (``ModuleList``).
        run: Calls the model once (e.g. the tiny pipeline).

    Returns:
        Block index (as a string) → the groups of ≥ 2 member paths relative to that block.
    """
    seen: dict[str, torch.Tensor] = {}
    handles = []
    linears = [
        (f"{index}.{name}", module)
        for index, block in enumerate(blocks)
        for name, module in block.named_modules()
        if isinstance(module, torch.nn.Linear)
    ]

    def recorder(path: str) -> Callable:
        def record(_module: Any, args: tuple[Any, ...]) -> None:
            if args and isinstance(args[0], torch.Tensor):
                seen.setdefault(path, args[0])  # kept alive, so identities are not reused within the call

        return record

    try:
        for path, module in linears:
            handles.append(module.register_forward_pre_hook(recorder(path)))
        run()
    finally:
        for handle in handles:
            handle.remove()
    found: dict[str, list[tuple[str, ...]]] = {}
    by_input: dict[tuple[str, int], list[str]] = {}
    for path in seen:  # call order
        index, rel = path.split(".", 1)
        by_input.setdefault((index, id(seen[path])), []).append(rel)
    for (index, _), members in by_input.items():
        if len(members) > 1:
            found.setdefault(index, []).append(tuple(members))
    return found


def _common(per_block: Sequence[Sequence[tuple[str, ...]]]) -> tuple[tuple[str, ...], ...]:
    first, *rest = per_block
    return tuple(g for g in first if all(set(g) in [set(h) for h in other] for other in rest))


def declared_form(
    transformer: torch.nn.Module, block_groups: Sequence[Any], run: Callable[[], Any]
) -> dict[str, tuple[tuple[str, ...], ...]]:
    """What :attr:`~fastdit.models.base.ModelAdapter.fused_projections` should declare for ``transformer``: per block
    list (keyed as the adapter's :class:`~fastdit.models.base.BlockGroup` names it), the groups every one of its
    blocks applied to one tensor in a call of ``run``; lists with none are left out.

    Args:
        transformer: The denoiser.
        block_groups: Its adapter's block groups.
        run: Calls the model once; called once per concrete list.
    """
    from fastdit.models.validate import concrete_groups

    lists: dict[str, list[str]] = {}
    for group in block_groups:
        for key, declared in ((group.path, group), (getattr(group.interleaved, "path", None), group.interleaved)):
            if declared is None:
                continue
            concrete = [g.path for g in concrete_groups(transformer, [declared])]
            lists.setdefault(key, []).extend(concrete)
    out: dict[str, tuple[tuple[str, ...], ...]] = {}
    for key, paths in lists.items():
        per_block: list[list[tuple[str, ...]]] = []
        for path in paths:
            blocks = resolve_attr(transformer, path)
            found = shared_input_groups(blocks, run)
            per_block += [found.get(str(index), []) for index in range(len(blocks))]
        common = _common(per_block) if per_block else ()
        if common:
            out[key] = common
    return out
