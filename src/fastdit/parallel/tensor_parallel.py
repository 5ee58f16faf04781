"""Apply a :class:`~fastdit.parallel.tp_plan.TensorParallelPlan` to a transformer with DTensor.

Each split ``Linear`` gets its rank's slice of the weight as a ``DTensor`` (``Shard(0)`` column-wise, ``Shard(1)``
row-wise) built from the local slice alone, then torch's ``ColwiseParallel`` / ``RowwiseParallel`` install the
input/output layouts (``parallelize_module`` finds the parameters already distributed and moves nothing). Fused
weights are re-laid on the way: rank ``r``'s slice is the concatenation of every segment's ``r``-th part, so the
logical (global) weight of the DTensor is the segment-interleaved one and the processor's split of the local output
lines up. Norms over split features become :class:`~fastdit.parallel.sharded_norm.ShardedNormModule`; divided
attributes are divided.

Memory: slices are cut where the weights are (the CPU, for a pipeline loaded there) and only the slice moves to the
rank's device; the rest of the transformer (embedders, replicated modulation, norms) is copied to the device. The
original parameters stay referenced for :func:`fastdit.disable`, on the CPU: a full weight that was on an accelerator
is moved to the CPU while the model is split, and moved back when it is restored — so no rank's device ever holds
the full transformer, and ``disable`` gives back the exact original tensors.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from fastdit.hooks.state import Applied
from fastdit.parallel.sharded_norm import ShardedNormModule
from fastdit.parallel.tp_plan import (
    CONV_TYPES,
    Colwise,
    ExpertShard,
    LocalArgument,
    LocalSlice,
    ShardedNorm,
    SplitParameter,
    Style,
    TensorParallelPlan,
    divided_attributes,
    norm_kind,
    parent_of,
    plan_layers,
    resolve_tp_plan,
    segment_sizes,
)

__all__ = ["TensorParallelState", "apply_tensor_parallel", "check_unsplit", "parameter_bytes", "planned_bytes"]

Undo = Callable[[], None]


@dataclass
class TensorParallelState:
    """What tensor parallelism did to one transformer.

    Attributes:
        degree: The TP degree.
        plan: The name of the plan applied (a fallback's when the degree does not fit the full plan).
        num_split_layers: ``Linear`` layers split column- or row-wise.
        num_split_norms: Norms replaced by their split form.
        num_divided_attributes: Attributes divided by the degree.
        split_bytes: Bytes of the split parameters in the unsplit model.
        replicated_bytes: Bytes of the parameters every rank holds whole.
        local_bytes: Parameter bytes this rank holds (``split_bytes / degree + replicated_bytes``).
    """

    degree: int
    plan: str = "full"
    num_split_layers: int = 0
    num_split_norms: int = 0
    num_divided_attributes: int = 0
    split_bytes: int = 0
    replicated_bytes: int = 0
    local_bytes: int = 0

    def stats(self) -> dict[str, Any]:
        """JSON-ready form for :func:`fastdit.summary`."""
        return {
            "degree": self.degree,
            "plan": self.plan,
            "split_layers": self.num_split_layers,
            "split_norms": self.num_split_norms,
            "divided_attributes": self.num_divided_attributes,
            "split_bytes": self.split_bytes,
            "replicated_bytes": self.replicated_bytes,
            "parameter_bytes_per_rank": self.local_bytes,
        }


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def parameter_bytes(module: torch.nn.Module) -> int:
    """Bytes of ``module``'s parameters held by this process (a DTensor counts its local slice)."""
    total = 0
    for p in module.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        total += _bytes(local)
    return total


def planned_bytes(
    transformer: torch.nn.Module, plan: TensorParallelPlan, degree: int, family: str = ""
) -> dict[str, int | str]:
    """Per-rank parameter bytes ``plan`` would leave at ``degree``, computed from shapes alone (works on ``meta``).

    Returns:
        ``plan`` (the name of the plan of the fallback chain that fits), ``split_bytes`` (in the unsplit model),
        ``replicated_bytes`` and ``parameter_bytes_per_rank`` — what :class:`TensorParallelState` reports once applied.

    Raises:
        ValueError: no plan of the chain fits ``degree``.
    """
    plan = resolve_tp_plan(transformer, plan, degree, family)
    split = replicated = 0
    split_modules: set[int] = set()
    split_params: set[int] = set()
    for _, module, style in plan_layers(transformer, plan):
        if isinstance(style, (LocalSlice, LocalArgument)):
            continue
        if isinstance(style, SplitParameter):
            param = style.parameter(module)
            if param is not None and style.splits(param):
                split_params.add(id(param))
                split += _bytes(param)
            continue
        if isinstance(style, ExpertShard):
            for pname in style.parameters:
                param = module._parameters[pname]
                split_params.add(id(param))
                split += _bytes(param)
            continue
        split_modules.add(id(module))
        for name, param in module.named_parameters(recurse=False):
            # A row-wise layer's bias is added once, after the sum: every rank holds it whole.
            if name == "bias" and not isinstance(style, (Colwise, ShardedNorm)):
                replicated += _bytes(param)
            else:
                split += _bytes(param)
    # By owning module, not by parameter: a weight tied between a split layer and a whole one (a language model's
    # head and its token embedding) is held twice once split, as a slice and whole.
    seen: set[int] = set()
    for module in transformer.modules():
        if id(module) in split_modules:
            continue
        for param in module.parameters(recurse=False):
            if id(param) not in seen and id(param) not in split_params:
                seen.add(id(param))
                replicated += _bytes(param)
    return {
        "plan": plan.name,
        "split_bytes": split,
        "replicated_bytes": replicated,
        "parameter_bytes_per_rank": split // degree + replicated,
    }


def check_unsplit(transformer: torch.nn.Module, plan: TensorParallelPlan) -> None:
    """Refuse a model whose planned layers are already split (DTensor) or quantized (a tensor subclass).

    Raises:
        ValueError: naming the layer and what its weight is.
    """
    for name, module, _ in plan_layers(transformer, plan):
        if isinstance(module, ShardedNormModule):
            raise ValueError(f"{name} is already split (a ShardedNormModule): the model is split already")
        for pname, param in module.named_parameters(recurse=False):
            data = param.data if isinstance(param, torch.nn.Parameter) else param
            if isinstance(param, DTensor) or type(data) is not torch.Tensor:
                kind = "split (a DTensor)" if isinstance(param, DTensor) else f"a {type(data).__name__}"
                raise ValueError(
                    f"{name}.{pname} is already {kind}: tensor parallelism splits plain weights; apply it before "
                    "quantizing, and to a model that is not split yet"
                )


def _local_slice(tensor: torch.Tensor, dim: int, sizes: list[int], rank: int, degree: int) -> torch.Tensor:
    """Rank ``rank``'s part of every segment of ``tensor`` along ``dim``, concatenated (the re-laid slice)."""
    parts, offset = [], 0
    for size in sizes:
        chunk = size // degree
        parts.append(tensor.narrow(dim, offset + rank * chunk, chunk))
        offset += size
    return torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0]


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, out = 1, []
    for size in reversed(shape):
        out.append(stride)
        stride *= size
    return tuple(reversed(out))


def _distributed(
    tensor: torch.Tensor, mesh: DeviceMesh, device: torch.device, dim: int | None, sizes: list[int]
) -> torch.nn.Parameter:
    """A DTensor parameter from this rank's slice of ``tensor`` (``dim=None``: replicated), cut before moving."""
    rank, degree = mesh.get_local_rank(), mesh.size()
    with torch.no_grad():
        if dim is None:
            local, placement = tensor.detach().to(device, copy=True), Replicate()
        else:
            local, placement = _local_slice(tensor.detach(), dim, sizes, rank, degree), Shard(dim)
            local = local.to(device, copy=True).contiguous()
    dtensor = DTensor.from_local(
        local, mesh, [placement], run_check=False, shape=tensor.shape, stride=_contiguous_stride(tensor.shape)
    )
    return torch.nn.Parameter(dtensor, requires_grad=False)


def _keep_on_cpu(originals: dict[str, torch.nn.Parameter]) -> Undo:
    """Move the original full weights off the accelerator while the model is split; the undo moves them back."""
    moved = []
    for param in originals.values():
        if param is not None and param.device.type != "cpu":
            moved.append((param, param.device))
            param.data = param.data.to("cpu")

    def undo() -> None:
        for param, device in moved:
            param.data = param.data.to(device)

    return undo


def _hook_dicts(module: torch.nn.Module) -> tuple[dict, ...]:
    return (module._forward_pre_hooks, module._forward_hooks)


def _wait_output(_module: torch.nn.Module, _args: Any, output: Any) -> Any:
    return output.wait() if isinstance(output, funcol.AsyncCollectiveTensor) else output


def _split_linear(
    module: torch.nn.Linear, style: Style, sizes: list[int], mesh: DeviceMesh, device: torch.device
) -> tuple[Undo, int, int]:
    """Split one ``Linear``; return its undo and the bytes of its original split and replicated parameters."""
    originals = dict(module._parameters)
    column = isinstance(style, Colwise)
    bias_bytes = 0 if module.bias is None else _bytes(module.bias)
    split_bytes = _bytes(module.weight) + (bias_bytes if column else 0)
    replicated_bytes = 0 if column else bias_bytes
    module._parameters["weight"] = _distributed(module.weight, mesh, device, 0 if column else 1, sizes)
    if module.bias is not None:
        # A column-split bias follows the output features; a row-split one is added once, after the sum.
        bias_dim = 0 if column else None
        module._parameters["bias"] = _distributed(module.bias, mesh, device, bias_dim, sizes if column else [])
    hooks_before = [set(d) for d in _hook_dicts(module)]
    if column:
        parallel = ColwiseParallel(output_layouts=Replicate() if style.gather_output else Shard(-1))
    else:
        parallel = RowwiseParallel()
    parallelize_module(module, mesh, parallel)
    # DTensor redistributes the output asynchronously; wait at once, while its buffers are still referenced here
    # (an output of another shape reusing freed memory under an in-flight gloo collective corrupted the heap).
    module.register_forward_hook(_wait_output)
    offload = _keep_on_cpu(originals)

    def undo() -> None:
        for hooks, before in zip(_hook_dicts(module), hooks_before, strict=True):
            for key in set(hooks) - before:
                del hooks[key]
        module.__dict__.pop("_distribute_module_applied", None)
        offload()
        for name, param in originals.items():
            module._parameters[name] = param

    return undo, split_bytes, replicated_bytes


def _plain(
    tensor: torch.Tensor, device: torch.device, dim: int, sizes: list[int], mesh: DeviceMesh
) -> torch.nn.Parameter:
    """A plain parameter holding this rank's slice of ``tensor`` along ``dim``, cut before it moves."""
    with torch.no_grad():
        local = _local_slice(tensor.detach(), dim, sizes, mesh.get_local_rank(), mesh.size())
        return torch.nn.Parameter(local.to(device, copy=True).contiguous(), requires_grad=False)


def _split_conv(
    module: torch.nn.Module, style: Style, sizes: list[int], mesh: DeviceMesh, device: torch.device
) -> tuple[Undo, int, int, list[torch.nn.Parameter]]:
    """Split one convolution by channel with plain local slices (DTensor has no convolution styles).

    Column-wise: the rank's output channels (a grouped convolution keeps whole groups: ``groups`` is divided).
    Row-wise: the rank's input channels; the partial outputs are summed over the ranks, then the bias is added once.
    """
    degree = mesh.size()
    originals = dict(module._parameters)
    attrs = {name: getattr(module, name) for name in ("in_channels", "out_channels", "groups")}
    bias = module.bias
    bias_bytes = 0 if bias is None else _bytes(bias)
    column = isinstance(style, Colwise)
    module._parameters["weight"] = _plain(module.weight, device, 0 if column else 1, sizes, mesh)
    handle = None
    if column:
        if bias is not None:
            module._parameters["bias"] = _plain(bias, device, 0, sizes, mesh)
        module.out_channels //= degree
        if module.groups > 1:
            module.groups //= degree
            module.in_channels //= degree
    else:
        module.in_channels //= degree
        whole_bias = None if bias is None else bias.detach().to(device, copy=True)
        module._parameters["bias"] = None
        group = mesh.get_group()
        shape = (1, -1) + (1,) * (module.weight.dim() - 2)

        def reduce(_module: torch.nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
            output = funcol.all_reduce(output.contiguous(), "sum", group)
            return output if whole_bias is None else output + whole_bias.to(output.dtype).view(shape)

        handle = module.register_forward_hook(reduce)
    split = [p for p in module._parameters.values() if p is not None]
    offload = _keep_on_cpu(originals)

    def undo() -> None:
        if handle is not None:
            handle.remove()
        offload()
        for name, value in attrs.items():
            setattr(module, name, value)
        for name, param in originals.items():
            module._parameters[name] = param

    split_bytes = _bytes(originals["weight"]) + (bias_bytes if column else 0)
    return undo, split_bytes, 0 if column else bias_bytes, split


def _slice_output(module: torch.nn.Module, style: LocalSlice, mesh: DeviceMesh, where: str) -> Undo:
    """Keep this rank's slice of every tensor ``module`` returns (a table computed for all heads)."""
    rank, degree = mesh.get_local_rank(), mesh.size()

    def cut(tensor: Any) -> Any:
        if not isinstance(tensor, torch.Tensor):
            return tensor
        dim = style.dim_for(tensor.dim())
        if dim is None:
            raise ValueError(
                f"tensor-parallel plan: {where!r} returned a {tensor.dim()}-dim tensor; LocalSlice.dim={style.dim} "
                "names no dim for it"
            )
        total = tensor.shape[dim]
        weights = style.segments or (1,)
        unit, rest = divmod(total, sum(weights))
        sizes = [w * unit for w in weights]
        if rest or any(size % degree for size in sizes):
            raise ValueError(
                f"tensor-parallel plan: {where!r} returned a tensor of {total} along dim {dim}, which does not "
                f"split into {degree} parts per segment {weights}"
            )
        return _local_slice(tensor, dim, sizes, rank, degree)

    def hook(_module: torch.nn.Module, _args: Any, output: Any) -> Any:
        if isinstance(output, (tuple, list)):
            return type(output)(cut(t) for t in output)
        return cut(output)

    return module.register_forward_hook(hook).remove


def _slice_argument(module: torch.nn.Module, style: LocalArgument, mesh: DeviceMesh, where: str) -> Undo:
    """Pass ``module`` a view of this rank's part of every tensor in its argument ``style.name``."""
    from fastdit.hooks.args import ForwardArgs

    rank, degree = mesh.get_local_rank(), mesh.size()
    args_of = ForwardArgs(module, (style.name,))

    def cut(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: cut(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(cut(v) for v in value)
        if not isinstance(value, torch.Tensor):
            return value
        total = value.shape[style.dim]
        if total % degree:  # a global size: every rank raises alike
            raise ValueError(
                f"tensor-parallel plan: {where}.forward got {style.name} with {total} along dim {style.dim}, not "
                f"divisible by tp={degree} (LocalArgument)"
            )
        part = total // degree
        return value.narrow(style.dim, rank * part, part)  # a view: writes land in the caller's buffer

    def hook(_module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if not args_of.passed(style.name, args, kwargs):
            return args, kwargs
        args, kwargs = list(args), dict(kwargs)
        args_of.replace(style.name, cut(args_of.get(style.name, args, kwargs)), args, kwargs)
        return tuple(args), kwargs

    return module.register_forward_pre_hook(hook, with_kwargs=True).remove


def _split_parameter(
    module: torch.nn.Module, style: SplitParameter, mesh: DeviceMesh, device: torch.device
) -> tuple[Undo, int, list[torch.nn.Parameter]]:
    """Keep this rank's part of one parameter along ``style.dim``; return its undo, original bytes and the slice."""
    param = style.parameter(module)
    if param is None or not style.splits(param):  # absent (optional) or broadcast: left whole
        return (lambda: None), 0, []
    size = param.shape[style.dim]
    module._parameters[style.name] = _plain(param, device, style.dim, [size], mesh)
    offload = _keep_on_cpu({style.name: param})

    def undo() -> None:
        offload()
        module._parameters[style.name] = param

    return undo, _bytes(param), [module._parameters[style.name]]


def _shard_experts(
    module: torch.nn.Module, style: ExpertShard, mesh: DeviceMesh, device: torch.device
) -> tuple[Undo, int, list[torch.nn.Parameter]]:
    """Keep this rank's experts of a packed-experts module and run only their rows (see :class:`ExpertShard`).

    Returns its undo, the original bytes of the split parameters and the rank's slices.
    """
    rank, degree = mesh.get_local_rank(), mesh.size()
    group = mesh.get_group()
    originals = {name: module._parameters[name] for name in style.parameters}
    experts = next(iter(originals.values())).shape[0]
    per_rank = experts // degree
    for name, param in originals.items():
        module._parameters[name] = _plain(param, device, 0, [experts], mesh)
    signature = inspect.signature(type(module).forward)
    pending: list[tuple[list[int], int, int]] = []  # per call in flight: rows of every rank, all rows, counted rows

    def before(mod: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        bound = signature.bind(mod, *args, **kwargs)
        tokens, counts = bound.arguments[style.tokens_arg], bound.arguments[style.counts_arg]
        if counts.dim() != 1 or counts.shape[0] != experts:
            raise ValueError(
                f"ExpertShard: {style.counts_arg} of shape {tuple(counts.shape)} does not count {experts} experts"
            )
        # The router is replicated, so these counts are equal on every rank and so is every size derived here.
        per_expert = [int(c) for c in counts.tolist()]
        rows = [sum(per_expert[r * per_rank : (r + 1) * per_rank]) for r in range(degree)]
        pending.append((rows, tokens.shape[0], sum(per_expert)))
        bound.arguments[style.tokens_arg] = tokens.narrow(0, sum(rows[:rank]), rows[rank])
        bound.arguments[style.counts_arg] = counts.narrow(0, rank * per_rank, per_rank)
        return bound.args[1:], bound.kwargs

    def after(_mod: torch.nn.Module, _args: Any, _kwargs: Any, output: torch.Tensor) -> torch.Tensor:
        rows, total, counted = pending.pop()
        longest = max(rows)
        local = output.narrow(0, 0, rows[rank])
        if rows[rank] < longest:
            local = torch.cat([local, local.new_zeros((longest - rows[rank], *local.shape[1:]))])
        gathered = funcol.all_gather_tensor(local.contiguous(), 0, group)
        if isinstance(gathered, funcol.AsyncCollectiveTensor):
            gathered = gathered.wait()
        pieces = [gathered.narrow(0, r * longest, rows[r]) for r in range(degree)]
        if total > counted:  # padding rows past the counted tokens: zeros, as the module returns them
            pieces.append(output.new_zeros((total - counted, *output.shape[1:])))
        return torch.cat(pieces)

    handles = [
        module.register_forward_pre_hook(before, with_kwargs=True),
        module.register_forward_hook(after, with_kwargs=True),
    ]
    offload = _keep_on_cpu(originals)

    def undo() -> None:
        for handle in handles:
            handle.remove()
        offload()
        for name, param in originals.items():
            module._parameters[name] = param

    return undo, sum(_bytes(p) for p in originals.values()), [module._parameters[n] for n in style.parameters]


def _split_norm(
    transformer: torch.nn.Module,
    path: str,
    module: torch.nn.Module,
    sizes: list[int],
    mesh: DeviceMesh,
    device: torch.device,
) -> tuple[Undo, int]:
    """Replace one norm over split features by its sharded form; return its undo and its original bytes."""
    rank, degree = mesh.get_local_rank(), mesh.size()
    originals = dict(module.named_parameters(recurse=False))
    split_bytes = sum(_bytes(p) for p in originals.values())

    def part(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        return _local_slice(t.detach(), 0, sizes, rank, degree).to(device, copy=True).contiguous()

    eps = module.eps if module.eps is not None else torch.finfo(module.weight.dtype).eps
    sharded = ShardedNormModule(
        norm_kind(module),
        sum(sizes),
        float(eps),
        part(getattr(module, "weight", None)),
        part(getattr(module, "bias", None)),
        mesh.get_group(),
    )
    parent, child = parent_of(transformer, path)
    setattr(parent, child, sharded)
    offload = _keep_on_cpu(originals)

    def undo() -> None:
        offload()
        setattr(parent, child, module)

    return undo, split_bytes


def _divide(transformer: torch.nn.Module, plan: TensorParallelPlan, degree: int) -> tuple[Undo, int]:
    changed = []
    for _, module, attr in divided_attributes(transformer, plan):
        value = getattr(module, attr)
        changed.append((module, attr, value))
        setattr(module, attr, value // degree)

    def undo() -> None:
        for module, attr, value in reversed(changed):
            setattr(module, attr, value)

    return undo, len(changed)


def _place_rest(transformer: torch.nn.Module, device: torch.device, split: set[int]) -> tuple[Undo, int]:
    """Copy the parameters and buffers that are not split to ``device``; return the undo and their bytes.

    ``split`` holds the ids of plain parameters that already are this rank's slices (split convolutions).
    """
    replaced: list[tuple[dict, str, Any]] = []
    copies: dict[int, Any] = {}  # tied parameters stay tied
    counted: set[int] = set()  # and are counted once (T5's shared embedding), wherever they already are
    total = 0
    for module in transformer.modules():
        if isinstance(module, ShardedNormModule):  # its parameters are already the rank's slices, on the device
            continue
        for table, is_param in ((module._parameters, True), (module._buffers, False)):
            for name, value in list(table.items()):
                if value is None or isinstance(value, DTensor) or id(value) in split:
                    continue
                if is_param and id(value) not in counted:
                    counted.add(id(value))
                    total += _bytes(value)
                if value.device == device:
                    continue
                if id(value) not in copies:
                    with torch.no_grad():
                        moved = value.detach().to(device, copy=True)
                    copies[id(value)] = (
                        torch.nn.Parameter(moved, requires_grad=value.requires_grad) if is_param else moved
                    )
                replaced.append((table, name, value))
                table[name] = copies[id(value)]

    def undo() -> None:
        for table, name, value in reversed(replaced):
            table[name] = value

    return undo, total


def apply_tensor_parallel(
    transformer: torch.nn.Module,
    plan: TensorParallelPlan,
    mesh: DeviceMesh,
    *,
    device: torch.device | None = None,
    family: str = "",
) -> Applied:
    """Split ``transformer`` over the 1-D tensor-parallel ``mesh`` as ``plan`` says.

    Args:
        transformer: The transformer; its weights may be on the CPU or on ``device``.
        plan: The family's plan.
        mesh: The tensor-parallel mesh (a size-1 mesh runs the same code path unsplit).
        device: This rank's device (default: the mesh's device type, current index).
        family: Family name, for messages.

    Returns:
        The undo (restores the original parameters, modules and attributes) and a :class:`TensorParallelState`.

    Raises:
        ValueError: the plan does not fit the module tree or the degree, or the model is already split or quantized.
    """
    degree = mesh.size()
    check_unsplit(transformer, plan)
    plan = resolve_tp_plan(transformer, plan, degree, family)
    if device is None:
        cuda = mesh.device_type == "cuda"
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device(mesh.device_type)
    state = TensorParallelState(degree=degree, plan=plan.name)
    undos: list[Undo] = []

    def undo_all() -> None:
        while undos:
            undos.pop()()

    split: set[int] = set()
    hook_bytes = 0  # row-split convolutions' biases, held by their reduce hooks rather than as parameters
    try:
        for name, module, style in plan_layers(transformer, plan):
            if isinstance(style, LocalSlice):
                undos.append(_slice_output(module, style, mesh, name))
                continue
            if isinstance(style, LocalArgument):
                undos.append(_slice_argument(module, style, mesh, name))
                continue
            if isinstance(style, (SplitParameter, ExpertShard)):
                shard = _split_parameter if isinstance(style, SplitParameter) else _shard_experts
                undo, nbytes, params = shard(module, style, mesh, device)
                undos.append(undo)
                split.update(id(p) for p in params)
                state.split_bytes += nbytes
                continue
            owner, _ = parent_of(transformer, name)
            sizes = segment_sizes(owner, module, style, name)  # before any attribute is divided
            if isinstance(style, ShardedNorm):
                undo, nbytes = _split_norm(transformer, name, module, sizes, mesh, device)
                state.num_split_norms += 1
            else:
                if isinstance(module, CONV_TYPES):
                    undo, nbytes, whole, params = _split_conv(module, style, sizes, mesh, device)
                    split.update(id(p) for p in params)
                    hook_bytes += whole
                else:
                    undo, nbytes, whole = _split_linear(module, style, sizes, mesh, device)
                state.num_split_layers += 1
                state.replicated_bytes += whole
            undos.append(undo)
            state.split_bytes += nbytes
        undo, state.num_divided_attributes = _divide(transformer, plan, degree)
        undos.append(undo)
        undo, rest_bytes = _place_rest(transformer, device, split)
        undos.append(undo)
        state.replicated_bytes += rest_bytes
    except BaseException:
        undo_all()
        raise
    state.local_bytes = parameter_bytes(transformer) + hook_bytes
    return Applied(undo_all, state)
