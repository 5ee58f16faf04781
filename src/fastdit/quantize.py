"""Quantization of a transformer's linear layers with torchao, undone exactly by :func:`fastdit.disable`.

Which layers: by default every ``nn.Linear`` inside the transformer blocks (the adapter's block lists), and none
outside them — the patch, time and text embedders and the final norm and projection stay in the model's dtype (they
are a small share of the time and the most sensitive to rounding). :class:`~fastdit.config.Quantize` patterns widen
or narrow the set by name; every Linear of the transformer is reported, quantized or skipped with the reason.

How: each chosen layer is quantized on its own with torchao's ``quantize_`` (its weight becomes a torchao tensor
subclass whose matmul torchao dispatches); static FP8 with row-wise weight scales quantizes the weight with torchao
and computes with :mod:`fastdit.quantize_rows` (the layer's forward is that matmul). Under tensor parallelism the
weight is a DTensor whose local slice is what this rank holds: the slice is quantized, and the layer's forward
computes on local tensors and hands the DTensor input/output hooks of tensor parallelism a DTensor of the same layout
the split layer produced (column-wise: sharded on the last dim; row-wise: partial sums, reduced before the bias is
added once).

Undo: the original weight parameters are kept — moved to the CPU while quantized when they were on an accelerator,
so quantizing saves device memory — and put back, the same objects with the same values.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import importlib
import json
import logging
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from fastdit.config import ActivationScales, Quantize, static_fp8_scale
from fastdit.errors import FieldError
from fastdit.hooks.state import Applied, park_on_host
from fastdit.quantize_rows import rowwise_linear

if TYPE_CHECKING:
    from fastdit.fuse import FusedGroup

__all__ = [
    "QuantizeState",
    "ScaleRecorder",
    "apply_quantize",
    "check_quantize",
    "import_torchao",
    "load_scales",
    "plan_layers",
    "rowwise_weight",
    "save_scales",
    "static_coverage",
    "tensor_bytes",
]

TORCHAO_REQUIREMENT = "torchao>=0.18,<0.19"
"""The torchao releases fastdit is tested with (``pip install 'fastdit[quant]'``)."""

SCALES_FORMAT = "fastdit-scales/1"
"""The ``format`` entry of the activation-scale files this version writes and reads."""

# torch._scaled_mm needs both matrix dims of an FP8 matmul divisible by 16.
_FP8_MULTIPLE = 16
# torchao 0.18 tells blockwise from per-tensor scaling by the block size alone, so the one per-tensor block of a
# 128x128 weight passes for a 128x128 block and its matmul then asserts on the input's scaling (both per-tensor
# modes: on the GPU, dynamic per-tensor FP8 of the reference pipeline failed so).
_BLOCK_SHAPE = (128, 128)
_PER_TENSOR_FP8 = ("fp8_tensor", "fp8_static")

Undo = Callable[[], None]


@contextlib.contextmanager
def _quiet_torchao() -> Iterator[None]:
    # Importing torchao logs one line per CUDA extension that does not load (every one, on a CPU-only torch) and
    # warns about deprecated registrations: noise for a user who asked for a mode that needs none of them.
    logger = logging.getLogger("torchao")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def import_torchao() -> Any:
    """Import ``torchao.quantization``.

    Raises:
        ImportError: torchao is not installed; names the package and the extra that brings it.
    """
    try:
        with _quiet_torchao():
            return importlib.import_module("torchao.quantization")
    except ImportError as error:
        raise ImportError(
            f"Quantize needs the package 'torchao': pip install '{TORCHAO_REQUIREMENT}' "
            "(or pip install 'fastdit[quant]')"
        ) from error


def torchao_config(mode: str) -> Any:
    """The torchao config object of a :class:`Quantize` mode.

    Every config is built with ``set_inductor_config=False``: torchao's default rewrites process-wide inductor
    settings (coordinate-descent tuning among them), which no library should change behind its caller's back, and
    which made the first compiled FP8 call of a FLUX.1-sized model take ≈ 250 s instead of ≈ 20 s on an H200
    (228 s of it tuning launch parameters of the quantization kernels) — see docs/quantization.md.
    """
    ao = import_torchao()
    quiet = {"set_inductor_config": False}
    if mode == "fp8":
        return ao.Float8DynamicActivationFloat8WeightConfig(granularity=ao.PerRow(), **quiet)
    if mode == "fp8_tensor":
        return ao.Float8DynamicActivationFloat8WeightConfig(granularity=ao.PerTensor(), **quiet)
    if mode == "fp8_weight":
        return ao.Float8WeightOnlyConfig(**quiet)
    if mode == "int8_weight":
        return ao.Int8WeightOnlyConfig(**quiet)
    if mode == "int8":
        return ao.Int8DynamicActivationInt8WeightConfig(**quiet)
    raise ValueError(f"unknown quantization mode {mode!r} (fp8_static is configured per layer: static_config)")


def static_config(amax: float, ndim: int, headroom: float, device: torch.device) -> Any:
    """torchao's config quantizing one layer with a fixed per-tensor activation scale (``mode='fp8_static'``).

    The scale maps ``amax * headroom`` to e4m3's largest value; it has the input's rank (torchao divides the input
    by it as is). A layer whose inputs were all zero gets the smallest normal float32 as its scale.
    """
    ao = import_torchao()
    scale = torch.full((1,) * ndim, static_fp8_scale(amax, headroom), dtype=torch.float32, device=device)
    return ao.Float8StaticActivationFloat8WeightConfig(
        act_quant_scale=scale, granularity=ao.PerTensor(), set_inductor_config=False
    )


def check_quantize(config: Quantize, device: torch.device, dtype: torch.dtype | None = None) -> None:
    """Refuse a mode the device or the weights' dtype cannot run, before any module is touched.

    Args:
        config: The request.
        device: Where the transformer computes.
        dtype: Its weights' floating-point dtype (``None``: not checked).

    Raises:
        ImportError: torchao is not installed.
        ValueError: an FP8 dynamic mode on a device other than a CUDA GPU of compute capability 8.9 or newer (what
            torchao's float8 matmul needs: it refuses the CPU), static FP8 on a CUDA GPU older than 8.9, or per-row
            FP8 (``mode='fp8'`` or ``weight_scales='row'``) of weights that are not bfloat16.
    """
    import_torchao()
    if not config.fp8_matmuls or config.calibrate:
        return
    from fastdit.process import require_cuda_capability

    fallback = "use mode='fp8_weight' or 'int8_weight' (weight-only, any device)"
    if config.dynamic_fp8 or device.type == "cuda":  # static scales also run on the CPU (torch._scaled_mm there)
        require_cuda_capability(device, (8, 9), f"mode={config.mode!r} computes its matmuls in FP8", fallback)
    if config.mode == "fp8" and dtype is not None and dtype != torch.bfloat16:
        raise ValueError(
            f"mode='fp8' (per-row scales) quantizes bfloat16 weights only (torchao); the transformer's are "
            f"{str(dtype).removeprefix('torch.')}: load it in bfloat16, or use mode='fp8_tensor'"
        )
    if config.weight_scales == "row" and dtype is not None and dtype != torch.bfloat16:
        raise ValueError(
            f"Quantize.weight_scales='row' quantizes bfloat16 weights only (the row-wise FP8 matmul computes in "
            f"bfloat16); the transformer's are {str(dtype).removeprefix('torch.')}: load it in bfloat16, or use "
            "weight_scales='tensor'"
        )


@dataclass(frozen=True)
class LayerChoice:
    """One Linear layer of the transformer and whether it is quantized.

    Attributes:
        name: Its path in the transformer.
        module: The layer.
        reason: Why it is skipped (``None``: quantized).
    """

    name: str
    module: torch.nn.Linear
    reason: str | None = None


def _in_blocks(name: str, block_paths: tuple[str, ...]) -> bool:
    return any(name.startswith(f"{path}.") for path in block_paths)


def _weight_shape(module: torch.nn.Linear) -> tuple[int, ...]:
    weight = module.weight
    return tuple((weight.to_local() if isinstance(weight, DTensor) else weight).shape)


def _skip_reason(name: str, module: torch.nn.Linear, config: Quantize, block_paths: tuple[str, ...]) -> str | None:
    if config.include:
        if not any(fnmatch.fnmatchcase(name, p) for p in config.include):
            return "not matched by include"
    elif not _in_blocks(name, block_paths):
        return "outside the transformer blocks (embedder, final norm or projection)"
    excluded = next((p for p in config.exclude if fnmatch.fnmatchcase(name, p)), None)
    if excluded is not None:
        return f"excluded by {excluded!r}"
    if module.weight.numel() < config.min_size:
        return f"{module.weight.numel()} weight elements < min_size={config.min_size}"
    return _layer_reason(module, config)


def _layer_reason(module: torch.nn.Linear, config: Quantize) -> str | None:
    """Why the weight itself cannot be quantized in this mode (its type, dtype or shape), or ``None``."""
    data = module.weight.to_local() if isinstance(module.weight, DTensor) else module.weight.data
    if type(data) is not torch.Tensor:
        return f"weight is already a {type(data).__name__}"
    if not module.weight.is_floating_point():
        return f"weight dtype {module.weight.dtype} is not floating point"
    shape = _weight_shape(module)
    # Calibration records every candidate whatever its local shape, so all ranks record the same layers.
    if config.fp8_matmuls and not config.calibrate and any(size % _FP8_MULTIPLE for size in shape):
        return f"local weight {list(shape)}: FP8 matmuls need both dims divisible by {_FP8_MULTIPLE}"
    per_tensor = config.mode in _PER_TENSOR_FP8 and config.weight_scales == "tensor"
    if per_tensor and not config.calibrate and shape == _BLOCK_SHAPE:
        return f"weight {list(shape)}: torchao reads a per-tensor scale of a 128x128 weight as 128x128 blockwise"
    return None


def plan_layers(transformer: torch.nn.Module, config: Quantize, block_paths: tuple[str, ...]) -> list[LayerChoice]:
    """Every Linear of ``transformer`` with the reason it is skipped (``None``: quantized), in module order.

    Args:
        transformer: The transformer (possibly split by tensor parallelism: a DTensor weight's local shape counts).
        config: Patterns and sizes.
        block_paths: The dotted paths of the transformer's block lists (the default scope).
    """
    return [
        LayerChoice(name, module, _skip_reason(name, module, config, block_paths))
        for name, module in transformer.named_modules()
        if isinstance(module, torch.nn.Linear)
    ]


def _with_groups(choices: list[LayerChoice], groups: Sequence[FusedGroup], config: Quantize) -> list[LayerChoice]:
    """``choices`` with each fused group's layer in place of its members (quantized when every member would be).

    A calibration records the members themselves (they are still called, each with the group's input)."""
    if not groups or config.calibrate:
        return choices
    owner = {member: group for group in groups for member in group.members}
    reasons = {c.name: c.reason for c in choices}
    out: list[LayerChoice] = []
    for choice in choices:
        group = owner.get(choice.name)
        if group is None:
            out.append(choice)
            continue
        out.append(LayerChoice(choice.name, choice.module, f"fused into {group.name}"))
        if choice.name == group.members[0]:
            member = next((m for m in group.members if reasons[m] is not None), None)
            reason = f"member {member}: {reasons[member]}" if member else _layer_reason(group.linear, config)
            out.append(LayerChoice(group.name, group.linear, reason))
    return out


def _group_scales(
    table: dict[str, tuple[float, int]], groups: Sequence[FusedGroup], component: str
) -> dict[str, tuple[float, int]]:
    """``table`` with an entry per fused group: the largest of its members' input maxima (all recorded on the one
    tensor they share), when every member has one."""
    out = dict(table)
    for group in groups:
        entries = [table.get(f"{component}.{member}") for member in group.members]
        if all(entry is not None for entry in entries):
            out[f"{component}.{group.name}"] = (max(e[0] for e in entries), entries[0][1])
    return out


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes ``tensor`` holds on this process: a DTensor's local slice, a tensor subclass's inner tensors."""
    if isinstance(tensor, DTensor):
        return tensor_bytes(tensor.to_local())
    if isinstance(tensor, torch.nn.Parameter):
        tensor = tensor.data
    if type(tensor) is torch.Tensor:
        return tensor.numel() * tensor.element_size()
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is None:
        return tensor.numel() * tensor.element_size()
    names, _ = flatten()
    return sum(tensor_bytes(getattr(tensor, name)) for name in names if getattr(tensor, name) is not None)


@dataclass
class QuantizeState:
    """What quantization did to one transformer (:func:`fastdit.summary` reports :meth:`stats`).

    Attributes:
        mode: The :class:`Quantize` mode.
        quantized: Names of the quantized layers.
        skipped: Skipped Linear layers, name → reason.
        bytes_before: Weight bytes of the quantized layers before (this rank's slices under tensor parallelism).
        bytes_after: The same weights' bytes once quantized (data and scales).
        weight_scales: Static FP8's weight scaling (``"tensor"`` or ``"row"``; ``"tensor"`` for the other modes).
    """

    mode: str
    quantized: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    bytes_before: int = 0
    bytes_after: int = 0
    weight_scales: str = "tensor"

    def stats(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "mode": self.mode,
            "weight_scales": self.weight_scales,
            "num_quantized": len(self.quantized),
            "num_skipped": len(self.skipped),
            "quantized": list(self.quantized),
            "skipped": dict(self.skipped),
            "bytes_before": self.bytes_before,
            "bytes_after": self.bytes_after,
        }


def _quantize_plain(module: torch.nn.Linear, ao_config: Any) -> Undo | None:
    """Quantize one Linear whose weight is a plain tensor; the undo restores its parameters and attributes
    (``None``: torchao left the layer as it was)."""
    parameters = dict(module._parameters)
    attributes = set(module.__dict__)
    with _quiet_torchao():
        import_torchao().quantize_(module, ao_config)
    if module._parameters["weight"] is parameters["weight"]:  # torchao declined (a shape its kernels do not take)
        return None
    offload = park_on_host(parameters["weight"])

    def undo() -> None:
        for key in set(module.__dict__) - attributes:  # torchao sets an instance extra_repr
            del module.__dict__[key]
        offload()
        module._parameters.clear()
        module._parameters.update(parameters)

    return undo


Matmul = Callable[[torch.Tensor, Any], torch.Tensor]
"""``(x, bias) -> x @ weight.T (+ bias)`` on local tensors, over one layer's quantized weight."""


def _local_forward(matmul: Matmul, bias: Any, placement: Any, mesh: Any) -> Callable[[Any], Any]:
    """The forward of a split Linear computing on this rank's quantized slice (see the module docstring)."""
    column = isinstance(placement, Shard) and placement.dim == 0
    local_bias = bias.to_local() if column and isinstance(bias, DTensor) else None

    def forward(x: Any) -> Any:
        local = x.to_local() if isinstance(x, DTensor) else x
        if column:
            y = matmul(local, local_bias)
            return DTensor.from_local(y, mesh, [Shard(y.dim() - 1)], run_check=False)
        partial = DTensor.from_local(matmul(local, None), mesh, [Partial()], run_check=False)
        out = partial.redistribute(mesh, [Replicate()])
        return out if bias is None else out + bias

    return forward


def _split_placement(weight: DTensor) -> Shard:
    (placement,) = weight.placements
    if not isinstance(placement, Shard) or placement.dim not in (0, 1):
        raise ValueError(f"a split weight with placement {placement}: expected Shard(0) or Shard(1)")
    return placement


def _swap_split(module: torch.nn.Linear, quantized: torch.nn.Parameter, matmul: Matmul) -> Undo:
    """Put this rank's quantized slice in place of a split Linear's DTensor weight, computing with ``matmul``."""
    weight = module.weight
    placement = _split_placement(weight)
    local = weight.to_local()
    kept = local.detach().to("cpu", copy=True)  # the slice, rebuilt into a DTensor by the undo
    spec = (weight.device_mesh, weight.placements, weight.shape, weight.stride(), local.device)
    module._parameters["weight"] = quantized
    module.forward = _local_forward(matmul, module.bias, placement, weight.device_mesh)

    def undo() -> None:
        mesh, placements, shape, stride, device = spec
        module.__dict__.pop("forward", None)
        restored = DTensor.from_local(kept.to(device), mesh, placements, run_check=False, shape=shape, stride=stride)
        module._parameters["weight"] = torch.nn.Parameter(restored, requires_grad=False)

    return undo


def _quantize_split(module: torch.nn.Linear, ao_config: Any) -> Undo | None:
    """Quantize this rank's slice of a Linear split by tensor parallelism (a DTensor weight)."""
    _split_placement(module.weight)
    local = module.weight.to_local()
    holder = torch.nn.Linear(local.shape[1], local.shape[0], bias=False, device="meta")
    holder.weight = torch.nn.Parameter(local.detach(), requires_grad=False)
    with _quiet_torchao():
        import_torchao().quantize_(holder, ao_config)
    quantized = holder.weight
    if type(quantized.data) is torch.Tensor:  # torchao declined
        return None
    return _swap_split(module, quantized, lambda x, bias: F.linear(x, quantized, bias))  # torchao dispatches


def rowwise_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (out × in) in FP8 e4m3 with one float32 scale per output channel: a torchao ``Float8Tensor``,
    which reports ``weight``'s dtype (what :func:`fastdit.quantize_rows.rowwise_linear` computes with)."""
    ao = import_torchao()
    with _quiet_torchao():
        return ao.Float8Tensor.from_hp(weight.detach(), granularity=ao.PerRow())


def _quantize_rows(module: torch.nn.Linear, scale: float) -> Undo:
    """Quantize one Linear for static FP8 with row-wise weight scales (``scale``: its fixed activation scale)."""
    weight = module.weight
    if isinstance(weight, DTensor):
        quantized = torch.nn.Parameter(rowwise_weight(weight.to_local()), requires_grad=False)
        return _swap_split(module, quantized, lambda x, bias: rowwise_linear(x, module.weight, scale, bias))
    parameters = dict(module._parameters)
    module._parameters["weight"] = torch.nn.Parameter(rowwise_weight(weight), requires_grad=False)
    # The weight is read from the module at each call: the module holds the one reference to it.
    module.forward = lambda x: rowwise_linear(x, module.weight, scale, module.bias)
    offload = park_on_host(parameters["weight"])

    def undo() -> None:
        module.__dict__.pop("forward", None)
        offload()
        module._parameters.clear()
        module._parameters.update(parameters)

    return undo


@dataclass
class ScaleRecorder:
    """The input maxima of the layers ``Quantize(mode="fp8_static", calibrate=True)`` watches on one transformer
    (and of the attention inputs ``Attention(calibrate=True)`` watches, by ``<module path>:q`` etc.).

    Attributes:
        layers: The watched layers' names, in module order (the same on every rank).
        amax: Name → the largest absolute input so far (a 0-dim float32 tensor on the input's device; absent:
            never called).
        ndims: Name → the input's rank.
    """

    layers: list[str] = field(default_factory=list)
    amax: dict[str, torch.Tensor] = field(default_factory=dict)
    ndims: dict[str, int] = field(default_factory=dict)

    def hook(self, name: str) -> Callable[[Any, tuple[Any, ...]], None]:
        """A forward pre-hook recording the maximum of the layer's input (on the device: no synchronisation)."""

        def record(_module: Any, args: tuple[Any, ...]) -> None:
            self.observe(name, args[0])

        return record

    def observe(self, name: str, x: torch.Tensor) -> None:
        """Take ``x``'s largest absolute value into ``name``'s maximum (on the device: no synchronisation)."""
        local = x.to_local() if isinstance(x, DTensor) else x  # this rank's part; ranks are reduced later
        if local.numel() == 0:  # nothing to take (an empty shard); amax() of it would raise
            return
        amax = local.detach().abs().amax().float()
        seen = self.amax.get(name)
        self.amax[name] = amax if seen is None else torch.maximum(seen, amax)
        self.ndims[name] = x.dim()

    def stats(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"mode": "fp8_static", "calibrating": True, "num_layers": len(self.layers), "num_seen": len(self.amax)}


def _record(choices: list[LayerChoice]) -> Applied:
    recorder = ScaleRecorder()
    handles = []
    for choice in choices:
        if choice.reason is None:
            recorder.layers.append(choice.name)
            handles.append(choice.module.register_forward_pre_hook(recorder.hook(choice.name)))

    def undo() -> None:
        for handle in handles:
            handle.remove()

    return Applied(undo, recorder)


def static_coverage(
    transformer: torch.nn.Module, config: Quantize, block_paths: tuple[str, ...], component: str
) -> tuple[list[str], list[str]]:
    """The layers a calibration of ``transformer`` records that have a scale in ``config``, and those that have none.

    Args:
        transformer: The denoiser.
        config: A ``mode='fp8_static'`` request with its scales.
        block_paths: Its block lists' paths.
        component: Its name in the pipeline (the prefix of its layers in the scales).
    """
    table = config.scales.lookup() if config.scales is not None else {}
    # The layers a calibration records (shapes aside): what decides whether the scales are this model's.
    recording = dataclasses.replace(config, scales=None, calibrate=True)
    chosen = [c.name for c in plan_layers(transformer, recording, block_paths) if c.reason is None]
    covered = [name for name in chosen if f"{component}.{name}" in table]
    return covered, [name for name in chosen if f"{component}.{name}" not in table]


@dataclass(frozen=True)
class _RowScale:
    """Static FP8 with row-wise weight scales for one layer: its fixed activation scale."""

    scale: float


def _layer_config(
    config: Quantize, key: str, module: torch.nn.Linear, shared: Any, table: dict[str, tuple[float, int]]
) -> Any:
    """The torchao config of one layer: ``shared`` for the dynamic and weight-only modes, or the static scale of
    ``key`` in ``table`` (a :class:`_RowScale` with ``weight_scales='row'``; ``None``: static FP8 and no recorded
    scale)."""
    if config.mode != "fp8_static":
        return shared
    entry = table.get(key)
    if entry is None:
        return None
    if config.weight_scales == "row":
        return _RowScale(static_fp8_scale(entry[0], config.headroom))
    weight = module.weight
    device = (weight.to_local() if isinstance(weight, DTensor) else weight).device
    return static_config(entry[0], entry[1], config.headroom, device)


def _quantize_layer(module: torch.nn.Linear, layer_config: Any) -> Undo | None:
    if isinstance(layer_config, _RowScale):
        return _quantize_rows(module, layer_config.scale)
    split = isinstance(module.weight, DTensor)
    return (_quantize_split if split else _quantize_plain)(module, layer_config)


def apply_quantize(
    transformer: torch.nn.Module,
    config: Quantize,
    block_paths: tuple[str, ...],
    component: str = "transformer",
    groups: Sequence[FusedGroup] = (),
) -> Applied:
    """Quantize the chosen Linear layers of ``transformer`` in place (or, with ``calibrate``, watch their inputs).

    Args:
        transformer: The transformer (possibly split by tensor parallelism).
        config: The mode and the layer choice.
        block_paths: Dotted paths of its block lists (the default scope).
        component: Its name in the pipeline: the prefix of its layers in static FP8's scales.
        groups: Projections fused by :func:`fastdit.fuse.apply_fuse`: each group's layer is quantized instead of
            its members, when every member would be.

    Returns:
        The undo (restores the original weights, bit for bit) and a :class:`QuantizeState` (a
        :class:`ScaleRecorder` when calibrating).

    Raises:
        ImportError: torchao is not installed.
    """
    choices = _with_groups(plan_layers(transformer, config, block_paths), groups, config)
    if config.calibrate:
        return _record(choices)
    shared = None if config.mode == "fp8_static" else torchao_config(config.mode)
    table = _group_scales(config.scales.lookup() if config.scales is not None else {}, groups, component)
    state = QuantizeState(mode=config.mode, weight_scales=config.weight_scales)
    undos: list[Undo] = []

    def undo_all() -> None:
        while undos:
            undos.pop()()

    try:
        for choice in choices:
            if choice.reason is not None:
                state.skipped[choice.name] = choice.reason
                continue
            module = choice.module
            ao_config = _layer_config(config, f"{component}.{choice.name}", module, shared, table)
            if ao_config is None:
                state.skipped[choice.name] = "no recorded activation scale (not called on the calibration runs)"
                continue
            before = tensor_bytes(module.weight)
            undo = _quantize_layer(module, ao_config)
            if undo is None:
                state.skipped[choice.name] = "torchao left it unquantized (a shape or dtype its kernels do not take)"
                continue
            undos.append(undo)
            state.bytes_before += before
            state.bytes_after += tensor_bytes(module.weight)
            state.quantized.append(choice.name)
    except BaseException:
        undo_all()
        raise
    return Applied(undo_all, state)


def save_scales(
    path: str | os.PathLike[str], scales: ActivationScales, *, provenance: dict[str, Any] | None = None
) -> None:
    """Write ``scales`` to ``path`` as JSON, atomically.

    The file is ``{"format": "fastdit-scales/1", "model": ..., "layers": {name: {"amax": ..., "ndim": ...}},
    "provenance": {...}}``; ``provenance`` (JSON-ready: what the scales were recorded and checked on) is kept as
    given and not read back.
    """
    from fastdit.io import write_json

    layers = {name: {"amax": amax, "ndim": ndim} for name, (amax, ndim) in scales.lookup().items()}
    data = {"format": SCALES_FORMAT, "model": scales.model, "layers": layers}
    write_json(path, data if provenance is None else {**data, "provenance": provenance})


def load_scales(path: str | os.PathLike[str]) -> ActivationScales:
    """Read a file :func:`save_scales` wrote.

    Raises:
        FileNotFoundError: No such file.
        ValueError: Not JSON, another format, or values :class:`ActivationScales` refuses (named in the message).
    """
    with open(path, encoding="utf-8") as handle:
        try:
            data = json.load(handle)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not a scales file (not JSON: {error})") from None
    if not isinstance(data, dict) or data.get("format") != SCALES_FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(
            f"{path}: format {found!r}, expected {SCALES_FORMAT!r} (written by fastdit calibrate --scales)"
        )
    layers = data.get("layers")
    if not isinstance(layers, dict) or not all(isinstance(v, dict) for v in layers.values()):
        raise ValueError(f"{path}: 'layers' must map layer names to {{'amax': ..., 'ndim': ...}}")
    try:
        return ActivationScales(
            layers=tuple(layers),
            amax=tuple(v.get("amax") for v in layers.values()),
            ndims=tuple(v.get("ndim") for v in layers.values()),
            model=data.get("model", "unknown"),
        )
    except FieldError as error:
        raise ValueError(f"{path}: {error}") from None
