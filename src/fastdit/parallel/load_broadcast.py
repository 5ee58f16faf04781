"""Read a pipeline's weights on one rank (of the job, or of each node) and broadcast every tensor to the others.

With :class:`~fastdit.config.Loading` ``mode="rank0"`` global rank 0 reads the checkpoint (``from_pretrained``) and
every other rank builds the same pipeline from the configs in the model directory with its parameters on the
``meta`` device (:func:`build_empty_pipeline`: tokenizers, schedulers and configs are read, weights are not). Then
every parameter and buffer of every component — transformer, text encoders, VAE; persistent or not — goes over
``torch.distributed.broadcast`` into the receiving rank's final storage on its device: a tensor of
:data:`BUCKET_BYTES` or more in place (in pieces of at most :data:`CHUNK_BYTES`), smaller ones packed through one
buffer of that size, so a receiving rank holds its own copy and one bucket, never more. ``"node-rank0"`` does the
same per node: each node's local rank 0 reads and broadcasts over a group of its node's ranks.

Every rank walks the same tensors in the same order, derived from the module structure alone (components by name,
then each one's parameters and buffers in registration order, a tied tensor once under all its names). Before any
tensor moves, one all-gather compares a digest of that walk (names, aliases, shapes, component classes) and whether
each rank loaded at all, so a rank that failed, or that sees another model directory, makes every rank raise the
same clear error instead of leaving the others blocked in a broadcast. Dtypes are the one thing taken from the
reader (one small broadcast of a code per tensor, once the walks agree): the libraries decide them while reading
(``_keep_in_fp32_modules``, buffers cast or not), so the configs alone cannot tell them. The result is bit-identical
to reading the files on every rank: same names, ties, dtypes and values.

Tensors are sent as raw bytes (any dtype, NaN payloads included) over the default group's backend: NCCL for
pipelines on CUDA, which then never pass through the receivers' host memory, gloo on the CPU.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fastdit.config import Loading
from fastdit.errors import FieldError
from fastdit.parallel.topology import node_key

__all__ = [
    "BUCKET_BYTES",
    "CHUNK_BYTES",
    "LoadBroadcastError",
    "build_empty_pipeline",
    "is_reader",
    "load_broadcast",
    "tensor_walk",
]

CHUNK_BYTES = 256 * 2**20
"""The largest single broadcast: larger tensors go in pieces (gloo and NCCL both take 2 GiB+ embeddings badly)."""

# Every dtype a checkpoint can hold, in a fixed order: the reader sends each tensor's index in this table.
BUCKET_BYTES = 16 * 2**20
"""Tensors smaller than this travel packed together, in broadcasts of up to this size (through one such buffer)."""

_DTYPE_NAMES = (
    "float32 float16 bfloat16 float64 int64 int32 int16 int8 uint8 bool complex64 complex128 "
    "float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz uint16 uint32 uint64"
)
_DTYPES: tuple[torch.dtype, ...] = tuple(
    getattr(torch, name) for name in _DTYPE_NAMES.split() if isinstance(getattr(torch, name, None), torch.dtype)
)
_DTYPE_CODES = {dtype: index for index, dtype in enumerate(_DTYPES)}
_DIGEST_WORDS = 4  # 256 bits of sha256 as four int64


class LoadBroadcastError(RuntimeError):
    """The ranks could not share the weights: a rank failed to read or build the pipeline, or the ranks' pipelines
    differ in structure (raised on every rank alike, before any weight is sent)."""


@dataclass
class _Tensor:
    """One tensor of a component and every place that holds it (a tied weight has several)."""

    component: str
    kind: str  # "parameter" or "buffer"
    names: list[str]
    places: list[tuple[torch.nn.Module, str]]
    tensor: torch.Tensor

    def describe(self) -> str:
        """The line of the structure digest: everything every rank must agree on, except the dtype."""
        return f"{self.component}|{self.kind}|{','.join(self.names)}|{tuple(self.tensor.shape)}"


@dataclass
class _Plan:
    """Who reads and whom each rank receives from, as every rank derived it from the gathered status."""

    src: int
    group: Any  # None: the default group
    size: int
    owned: list[Any] = field(default_factory=list)  # groups this plan created (destroyed after loading)


def _slots(module: torch.nn.Module, kind: str) -> Iterator[tuple[str, torch.nn.Module, str, torch.Tensor]]:
    attr = "_parameters" if kind == "parameter" else "_buffers"
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for key, tensor in getattr(sub, attr).items():
            if tensor is not None:
                yield (f"{prefix}.{key}" if prefix else key), sub, key, tensor


def _module_components(pipe: Any) -> list[tuple[str, torch.nn.Module]]:
    components = getattr(pipe, "components", {})
    return sorted((name, c) for name, c in components.items() if isinstance(c, torch.nn.Module))


def tensor_walk(pipe: Any) -> list[_Tensor]:
    """Every distinct tensor of ``pipe``'s module components, in the order every rank derives from the structure.

    Components by name; in each, parameters then buffers in registration order (:meth:`torch.nn.Module.named_modules`
    order, shared submodules under every name). A tensor held in several places (tied weights) comes once, at its
    first place, with all its names.
    """
    walk: list[_Tensor] = []
    for component, module in _module_components(pipe):
        seen: dict[int, _Tensor] = {}
        for kind in ("parameter", "buffer"):
            for name, sub, key, tensor in _slots(module, kind):
                entry = seen.get(id(tensor))
                if entry is None:
                    seen[id(tensor)] = entry = _Tensor(component, kind, [], [], tensor)
                    walk.append(entry)
                elif entry.kind != kind:
                    raise LoadBroadcastError(f"{component}.{name} is both a parameter and a buffer")
                entry.names.append(name)
                entry.places.append((sub, key))
    return walk


def _listing(walk: Sequence[_Tensor], pipe: Any) -> list[str]:
    """What the ranks must agree on: the pipeline and component classes, the dtype table, every tensor's line."""
    classes = ",".join(f"{name}:{type(c).__qualname__}" for name, c in _module_components(pipe))
    return [f"{type(pipe).__qualname__}|{classes}|{','.join(map(str, _DTYPES))}", *(e.describe() for e in walk)]


def _digest(walk: Sequence[_Tensor], pipe: Any) -> list[int]:
    text = "\n".join(_listing(walk, pipe))
    raw = hashlib.sha256(text.encode()).digest()
    return [int.from_bytes(raw[8 * i : 8 * i + 8], "little", signed=True) for i in range(_DIGEST_WORDS)]


def is_reader(loading: Loading, environ: Any = None) -> bool:
    """Whether this process reads the files under ``loading`` (read from the launcher's variables, no collective).

    Raises:
        FieldError: Owner ``"Loading"``, field ``"mode"``: ``"node-rank0"`` without ``LOCAL_RANK``.
    """
    from fastdit.process import local_rank, process_rank

    environ = os.environ if environ is None else environ
    if loading.mode == "every-rank":
        return True
    if loading.mode == "rank0":
        return process_rank(environ) == 0
    index = local_rank(environ)
    if index is None:
        raise FieldError("Loading", "mode", loading.mode, "needs LOCAL_RANK, which torchrun sets on every rank")
    return index == 0


# --- building the pipeline without its weights -------------------------------------------------------------------


def _component_class(library: str, class_name: str) -> type | None:
    for module_name in (library, f"diffusers.pipelines.{library}"):
        try:
            cls = getattr(importlib.import_module(module_name), class_name, None)
        except ImportError:
            continue
        if isinstance(cls, type):
            return cls
    return None


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """``torch.set_default_dtype`` for a block, as diffusers' ``from_pretrained`` builds a model under it (so tensors
    a constructor computes as plain attributes get the same dtype as on the reading rank)."""
    previous = torch.get_default_dtype()
    if dtype.is_floating_point:
        torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _empty_model(cls: type, folder: Path, dtype: torch.dtype) -> torch.nn.Module | None:
    """A diffusers or transformers model built from ``folder``'s config with its parameters on ``meta``."""
    from accelerate import init_empty_weights
    from diffusers import ModelMixin
    from transformers import PreTrainedModel

    if issubclass(cls, ModelMixin):
        config = cls.load_config(folder)
        with _default_dtype(dtype), init_empty_weights():
            model = cls.from_config(config)
        model.register_to_config(_name_or_path=str(folder))
    elif issubclass(cls, PreTrainedModel):
        config = cls.config_class.from_pretrained(folder)
        with init_empty_weights():
            model = cls._from_config(config, dtype=dtype)
        model.tie_weights()  # from_pretrained ties after reading; on meta the tie is made the same way
        model.config.name_or_path = str(folder)
        _generation_config(model, folder)
    else:
        return None
    return model.eval()


def _generation_config(model: Any, folder: Path) -> None:
    """Read ``generation_config.json`` as ``from_pretrained`` does for a model that can generate."""
    if not (folder / "generation_config.json").is_file() or not model.can_generate():
        return
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig.from_pretrained(folder)


def build_empty_pipeline(pipeline_class: type, path: Path, dtype: torch.dtype) -> Any:
    """``pipeline_class`` from the directory ``path`` with every model component's parameters on ``meta``.

    The diffusers and transformers models that ``model_index.json`` lists are built from their configs (buffers
    computed by their constructors, on the CPU); ``from_pretrained`` then reads the rest (tokenizers, schedulers,
    processors), and any other module component with its weights.

    Args:
        pipeline_class: The pipeline class the reading rank loads.
        path: The ``save_pretrained`` directory.
        dtype: The dtype the reading rank loads in (the default dtype while models are built).

    Returns:
        The pipeline, for :func:`load_broadcast` to fill.
    """
    from fastdit.pipeline_dir import read_index

    models: dict[str, torch.nn.Module] = {}
    for name, entry in read_index(path).items():
        if name.startswith("_") or not isinstance(entry, list) or len(entry) != 2 or None in entry:
            continue
        cls = _component_class(*entry)
        model = _empty_model(cls, path / name, dtype) if cls is not None else None
        if model is not None:
            models[name] = model
    return pipeline_class.from_pretrained(path, dtype=dtype, local_files_only=True, **models)


# --- the collectives ---------------------------------------------------------------------------------------------


def _all_gather_rows(row: list[int], device: torch.device) -> list[list[int]]:
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    rows = torch.empty(dist.get_world_size() * len(row), dtype=torch.int64, device=device)
    # torch 2.13 renamed the collective; the range we support (>= 2.7) has one or the other.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(rows, mine)
    return rows.view(dist.get_world_size(), len(row)).tolist()


def _raise_failures(failure: BaseException | None, failed: list[int]) -> None:
    """Every rank learns why the failed ranks failed; each raises its own error, the others the first one's."""
    reason: Any = None
    if failure is not None:
        reason = failure if isinstance(failure, FieldError) else f"{type(failure).__name__}: {failure}"
    reasons: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, reason)
    if failure is not None:
        raise failure
    first = reasons[failed[0]]
    if isinstance(first, FieldError):  # a bad model directory: the same error a rank reading it would raise
        raise first
    raise LoadBroadcastError(f"rank {failed[0]} could not load the pipeline ({first}); ranks failed: {failed}")


def _raise_mismatch(walk: Sequence[_Tensor], pipe: Any, differing: list[int]) -> None:
    """Every rank names the first entry where a differing rank's walk parts from rank 0's, then raises."""
    mine = _listing(walk, pipe)
    listings: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(listings, mine)
    rank = differing[0]
    reference, other = listings[0], listings[rank]
    index = next((i for i, (a, b) in enumerate(zip(reference, other, strict=False)) if a != b), None)
    if index is None:
        where = f"rank 0 has {len(reference) - 1} tensors, rank {rank} {len(other) - 1}"
    else:
        where = f"rank 0 has {reference[index]!r} where rank {rank} has {other[index]!r}"
    raise LoadBroadcastError(
        f"the ranks' pipelines differ, so the weights cannot be broadcast (ranks {differing} differ from rank 0; "
        f"{where}): every rank must see the same model directory, or load with Loading(mode='every-rank')"
    )


def _plan(loading: Loading, rows: list[list[int]], timeout_s: float) -> _Plan:
    """The source and group of this rank, from the gathered ``[ok, node, reader, ...]`` rows (alike on every rank)."""
    readers = [rank for rank, row in enumerate(rows) if row[2]]
    if loading.mode == "rank0":
        return _Plan(src=0, group=None, size=len(rows))
    nodes: dict[int, list[int]] = {}
    for rank, row in enumerate(rows):
        nodes.setdefault(row[1], []).append(rank)
    bad = [ranks for ranks in nodes.values() if len([r for r in ranks if r in readers]) != 1]
    if bad:
        raise LoadBroadcastError(
            f"Loading(mode='node-rank0') needs exactly one rank with LOCAL_RANK=0 per node; nodes of ranks {bad} "
            f"have {[len([r for r in ranks if r in readers]) for ranks in bad]}"
        )
    mine = next(ranks for ranks in nodes.values() if dist.get_rank() in ranks)
    src = next(r for r in mine if r in readers)
    if len(nodes) == 1:
        return _Plan(src=src, group=None, size=len(rows))
    group, _ = dist.new_subgroups_by_enumeration(list(nodes.values()), timeout=timedelta(seconds=timeout_s))
    return _Plan(src=src, group=group, size=len(mine), owned=[group])


def _send_dtypes(walk: Sequence[_Tensor], plan: _Plan, reader: bool, device: torch.device) -> list[tuple]:
    """The reader's dtype and ``requires_grad`` of each tensor, on every rank of its group."""
    codes = torch.zeros(len(walk), dtype=torch.int64, device=device)
    if reader:
        codes.copy_(torch.tensor([2 * _DTYPE_CODES[e.tensor.dtype] + e.tensor.requires_grad for e in walk]))
    dist.broadcast(codes, src=plan.src, group=plan.group)
    return [(_DTYPES[code // 2], bool(code % 2)) for code in codes.tolist()]


def _materialize(entry: _Tensor, dtype: torch.dtype, requires_grad: bool, device: torch.device) -> torch.Tensor:
    """Put an empty tensor of the reader's dtype on ``device`` in every place ``entry`` is held (ties kept)."""
    new: torch.Tensor = torch.empty(entry.tensor.shape, dtype=dtype, device=device)
    if entry.kind == "parameter":
        new = torch.nn.Parameter(new, requires_grad=requires_grad)
    for module, key in entry.places:
        getattr(module, "_parameters" if entry.kind == "parameter" else "_buffers")[key] = new
    entry.tensor = new
    return new


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of ``tensor`` (a contiguous copy of a strided view, which only the reader may hold)."""
    source = tensor.detach()
    return (source if source.is_contiguous() else source.contiguous()).reshape(-1).view(torch.uint8)


def _send_bytes(flat: torch.Tensor, plan: _Plan, chunk_bytes: int) -> None:
    for start in range(0, flat.numel(), chunk_bytes):
        dist.broadcast(flat[start : start + chunk_bytes], src=plan.src, group=plan.group)


def _buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive tensors in groups: each tensor of ``bucket_bytes`` or more alone, smaller ones packed together up
    to ``bucket_bytes`` (a broadcast costs a round trip whatever its size: a checkpoint's hundreds of biases and
    norms would cost more in latency than in bytes)."""
    bucket: list[torch.Tensor] = []
    size = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            continue
        if bucket and (size + nbytes > bucket_bytes or nbytes >= bucket_bytes):
            yield bucket
            bucket, size = [], 0
        bucket.append(tensor)
        size += nbytes
    if bucket:
        yield bucket


def _send_bucket(bucket: list[torch.Tensor], plan: _Plan, reader: bool, chunk_bytes: int) -> None:
    """Broadcast the tensors of ``bucket``: one alone in place, several packed through one buffer."""
    if len(bucket) == 1:
        _send_bytes(_bytes_of(bucket[0]), plan, chunk_bytes)
        return
    views = [tensor.detach().reshape(-1).view(torch.uint8) if not reader else _bytes_of(tensor) for tensor in bucket]
    buffer = torch.empty(sum(v.numel() for v in views), dtype=torch.uint8, device=bucket[0].device)
    offsets = [0]
    for view in views:
        offsets.append(offsets[-1] + view.numel())
    if reader:
        for view, start, end in zip(views, offsets, offsets[1:], strict=False):
            buffer[start:end].copy_(view)
    _send_bytes(buffer, plan, chunk_bytes)
    if not reader:
        for view, start, end in zip(views, offsets, offsets[1:], strict=False):
            view.copy_(buffer[start:end])


def _check_reader(walk: Sequence[_Tensor]) -> None:
    for entry in walk:
        tensor = entry.tensor
        if entry.tensor.dtype not in _DTYPE_CODES or type(tensor) not in (torch.Tensor, torch.nn.Parameter):
            raise LoadBroadcastError(
                f"{entry.component}.{entry.names[0]} is a {type(tensor).__name__} of {tensor.dtype}: only plain "
                "tensors can be broadcast; load with Loading(mode='every-rank')"
            )


def _prepare(read: Callable[[], Any], build: Callable[[], Any], reader: bool) -> tuple[Any, list[_Tensor]]:
    pipe = read() if reader else build()
    walk = tensor_walk(pipe)
    if reader:
        _check_reader(walk)
    return pipe, walk


def load_broadcast(
    read: Callable[[], Any],
    build: Callable[[], Any],
    *,
    loading: Loading,
    device: torch.device,
    chunk_bytes: int | None = None,
) -> Any:
    """Read the pipeline on the reading rank(s) of ``loading`` and broadcast its tensors to the others.

    A collective over the default process group: every rank of the job calls it alike.

    Args:
        read: Loads the whole pipeline onto ``device`` (what every rank would do without broadcasting).
        build: Builds the same pipeline without weights (:func:`build_empty_pipeline`).
        loading: ``mode`` ``"rank0"`` or ``"node-rank0"``.
        device: Where the pipeline's tensors end on this rank.
        chunk_bytes: The largest single broadcast (default :data:`CHUNK_BYTES`).

    Returns:
        The pipeline, equal to ``read()`` on every rank.

    Raises:
        LoadBroadcastError: On every rank, if any rank could not read or build the pipeline (a
            :class:`~fastdit.errors.FieldError` of the reading rank is raised as it is instead), or the ranks'
            pipelines differ in structure.
    """
    # Rank 0 of the group the caller made may not be RANK=0 of the environment: ask the group.
    reader = dist.get_rank() == 0 if loading.mode == "rank0" else is_reader(loading)
    pipe, walk, failure = None, [], None
    try:
        pipe, walk = _prepare(read, build, reader)
    except Exception as error:  # told to every rank below, so that none waits in a broadcast
        failure = error
    digest = _digest(walk, pipe) if failure is None else [0] * _DIGEST_WORDS
    rows = _all_gather_rows([int(failure is None), node_key(), int(reader), len(walk), *digest], device)
    failed = [rank for rank, row in enumerate(rows) if not row[0]]
    if failed:
        _raise_failures(failure, failed)
    differing = [rank for rank, row in enumerate(rows) if row[3:] != rows[0][3:]]
    if differing:
        _raise_mismatch(walk, pipe, differing)
    plan = _plan(loading, rows, loading.timeout_s)
    try:
        _broadcast_walk(walk, plan, reader, device, chunk_bytes or CHUNK_BYTES, BUCKET_BYTES)
    finally:
        for group in plan.owned:
            dist.destroy_process_group(group)
    return pipe


def _broadcast_walk(
    walk: Sequence[_Tensor], plan: _Plan, reader: bool, device: torch.device, chunk_bytes: int, bucket_bytes: int
) -> None:
    if plan.size == 1:
        return  # a node of one rank: it read the files itself
    dtypes = _send_dtypes(walk, plan, reader, device)
    tensors = [
        entry.tensor if reader else _materialize(entry, dtype, requires_grad, device)
        for entry, (dtype, requires_grad) in zip(walk, dtypes, strict=True)
    ]
    with torch.no_grad():
        for bucket in _buckets(tensors, bucket_bytes):
            _send_bucket(bucket, plan, reader, chunk_bytes)
