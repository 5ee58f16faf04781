# ruff: noqa: N803, N806 - shape suffixes (q_BSHD) name tensor layouts in attention code
"""The one entry point attention goes through under context parallelism.

diffusers attention processors compute q/k/v and call ``dispatch_attention_fn`` — a name each transformer module
imports from ``diffusers.models.attention_dispatch`` — passing their own ``_parallel_config``. Its backend registry is
keyed by a closed ``Enum`` and cannot take a new backend, so routing works in two removable steps:

1. :func:`route_modules` rebinds ``dispatch_attention_fn`` in the named modules to a thin router. The router sends a
   call to fastdit only when its ``parallel_config`` is a :class:`ContextParallelAttention`; every other call goes to
   the original function unchanged. Other models of the same family, in this or another thread, are unaffected.
   Rebinding is reference-counted per module and guarded by a lock, so several transformers may be routed at once.
2. :func:`mark_processors` sets ``_parallel_config`` of one transformer's attention processors to its
   :class:`ContextParallelAttention`. Processors that deliberately pass ``parallel_config=None`` (Wan's
   cross-attention to replicated text) and those of the modules the plan lists as local keep running locally.

Processors that call ``F.scaled_dot_product_attention`` themselves (``(B, H, S, D)`` tensors) are routed the same
two-step way: :func:`route_sdpa_modules` rebinds the module-global ``F`` of the named modules to a
:class:`FunctionalProxy` (reference-counted like step 1), and :func:`mark_attention_modules` hooks one transformer's
non-local attention modules so that, only while one of them runs in this thread, the proxy's SDPA goes to its
:class:`ContextParallelAttention`. Every other call (other models, local modules, other threads) is the real SDPA.

:class:`ContextParallelAttention` then runs Ulysses (``ulysses > 1``), ring (``ring > 1``) or USP (both), with the
local attention backend chosen by :func:`local_attention` (SDPA flash / cuDNN / efficient / math, flash-attn,
SageAttention).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import threading
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from fastdit.config import Attention
from fastdit.cuda_graph import current_call_signature
from fastdit.parallel.attention.comm import gather_lengths
from fastdit.parallel.attention.ulysses import LocalAttention, SeqLayout, mask_in_shard_order, ulysses_attention

__all__ = [
    "ContextParallelAttention",
    "ForwardLayout",
    "FunctionalProxy",
    "RoutedAttention",
    "attention_processors",
    "local_attention",
    "mark_attention_modules",
    "mark_processors",
    "processor_sites",
    "route_modules",
    "route_sdpa_calls",
    "route_sdpa_modules",
]

ENTRY_POINT = "dispatch_attention_fn"

_SDPA_KERNELS = {
    "flash": "FLASH_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
}
_PACKAGES = {"flash-attn": ("flash_attn", "flash-attn"), "sage": ("sageattention", "sageattention")}


# --- local attention backends ---


def _repeat_kv(q_BSHD: torch.Tensor, x_BSHD: torch.Tensor) -> torch.Tensor:
    group = q_BSHD.shape[2] // x_BSHD.shape[2]
    return x_BSHD if group == 1 else x_BSHD.repeat_interleave(group, dim=2)


def _import_backend(backend: str) -> Any:
    module_name, package = _PACKAGES[backend]
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(
            f"Attention(backend={backend!r}) needs the {package!r} package: pip install {package}"
        ) from exc


def local_attention(config: Attention | None = None) -> LocalAttention:
    """Build the local attention function for ``config`` (``(q, k, v, mask, scale) -> out``, all ``BSHD``).

    Raises:
        ImportError: the backend's package (flash-attn, sageattention, nvidia-cudnn-frontend) is not installed; names
            the package.
    """
    config = config or Attention()
    repeat = config.gqa == "repeat"
    if config.backend in _PACKAGES:
        module = _import_backend(config.backend)
        return _external(config.backend, module, repeat=repeat or config.backend == "sage")
    if config.backend == "cudnn-fp8":
        return _cudnn_fp8()
    kernel = _SDPA_KERNELS.get(config.backend)

    def sdpa(q_BSHD, k_BSHD, v_BSHD, attn_mask=None, scale=None):
        if repeat:
            k_BSHD, v_BSHD = _repeat_kv(q_BSHD, k_BSHD), _repeat_kv(q_BSHD, v_BSHD)
        gqa = k_BSHD.shape[2] != q_BSHD.shape[2]
        args = (q_BSHD.transpose(1, 2), k_BSHD.transpose(1, 2), v_BSHD.transpose(1, 2))
        with _sdpa_kernel(kernel):
            out_BHSD = F.scaled_dot_product_attention(*args, attn_mask=attn_mask, scale=scale, enable_gqa=gqa)
        return out_BHSD.transpose(1, 2)

    return sdpa


def _cudnn_fp8() -> LocalAttention:
    from fastdit.parallel.attention.cudnn_fp8 import cudnn_fp8_attention, import_frontend

    import_frontend()  # a missing package raises now, naming it, not at the first call

    def run(q_BSHD, k_BSHD, v_BSHD, attn_mask=None, scale=None, static=None):
        # The fused kernel takes equal head counts: grouped K/V heads are repeated to the query's.
        k_BSHD, v_BSHD = _repeat_kv(q_BSHD, k_BSHD), _repeat_kv(q_BSHD, v_BSHD)
        return cudnn_fp8_attention(q_BSHD, k_BSHD, v_BSHD, attn_mask=attn_mask, scale=scale, static=static)

    return run


def _sdpa_kernel(kernel: str | None) -> contextlib.AbstractContextManager:
    if kernel is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(getattr(SDPBackend, kernel))


def _external(backend: str, module: Any, *, repeat: bool) -> LocalAttention:
    def run(q_BSHD, k_BSHD, v_BSHD, attn_mask=None, scale=None):
        if attn_mask is not None:
            raise ValueError(f"Attention(backend={backend!r}) takes no attention mask; use backend='sdpa'")
        if repeat:
            k_BSHD, v_BSHD = _repeat_kv(q_BSHD, k_BSHD), _repeat_kv(q_BSHD, v_BSHD)
        if backend == "flash-attn":
            return module.flash_attn_func(q_BSHD, k_BSHD, v_BSHD, softmax_scale=scale)
        return module.sageattn(q_BSHD, k_BSHD, v_BSHD, tensor_layout="NHD", is_causal=False, sm_scale=scale)

    return run


# --- what the split hooks tell attention about the current forward ---


# Entries of ForwardLayout.known_lens before it starts over (exchange points × input signatures seen).
_MAX_KNOWN_LENS = 4096


@dataclass
class ForwardLayout:
    """How the current transformer forward's sequences were split (written by the context-parallel hooks).

    Attributes:
        splits: Per split tensor name, every rank's length along the split dim.
        even: Whether every split of this forward gave all ranks the same length. Derived from global sizes only,
            so every rank holds the same value and takes the same branch.
        calls: Length exchanges so far in this forward (the same count on every rank).
        known_lens: Every rank's integers of each exchange in calls served by CUDA graphs (see
            :meth:`shard_lengths`), by (the call's input signature, the exchange's position in the call); kept across
            forwards. Both parts of the key are equal on every rank, so all ranks find an entry or all exchange.
    """

    splits: dict[str, list[int]] = field(default_factory=dict)
    even: bool = True
    calls: int = 0
    known_lens: dict[tuple, list[list[int]]] = field(default_factory=dict)

    def reset(self) -> None:
        """Forget the previous forward's splits."""
        self.splits.clear()
        self.even = True
        self.calls = 0

    def signature(self) -> tuple:
        """This forward's splits so far as a hashable value, equal on every rank (global sizes only)."""
        return tuple((name, tuple(lens)) for name, lens in self.splits.items())

    def shard_lengths(
        self, local: list[int], exchange: Callable[[list[int]], list[list[int]]], rank: int
    ) -> list[list[int]]:
        """Every rank's ``local`` integers (shard lengths) for the exchange now due in this forward.

        Called only under uneven splits, by every rank at the same point of the forward. ``exchange`` is a collective
        and a host read, which a CUDA graph cannot record. Inside a call served by CUDA graphs the call's input
        signature fixes its control flow (the graph relies on that too), so the same point of a call with the same
        signature has the same lengths: they are exchanged in the first such call (a warm-up) and remembered. Other
        calls exchange every time — the attention calls a model makes may depend on more than the split sizes.

        Raises:
            RuntimeError: inside a graph-served call, this rank's lengths differ from those remembered for the same
                signature and point (control flow that depends on tensor values, which graphs cannot serve).
        """
        self.calls += 1
        signature = current_call_signature()
        if signature is None:
            return exchange(local)
        # The splits too: with graphs per block the signature holds local shards, and under uneven splits two
        # different global layouts can give one rank the same shard but not another.
        memo = (signature, self.signature(), self.calls)
        known = self.known_lens.get(memo)
        if known is None:
            known = exchange(local)
            if len(self.known_lens) >= _MAX_KNOWN_LENS:
                self.known_lens.clear()
            self.known_lens[memo] = known
        if list(known[rank]) != list(local):
            raise RuntimeError(
                f"context parallel: exchange {self.calls} of this call has lengths {local} on rank {rank}, but "
                f"{known[rank]} in an earlier call with the same input signature: the model's control flow depends "
                "on tensor values, which Compile.cuda_graph cannot serve"
            )
        return known

    def record(self, name: str, lens: list[int]) -> None:
        """Note that tensor ``name`` was split into ``lens``."""
        self.splits[name] = lens
        self.even = self.even and len(set(lens)) == 1

    def layout(self, segments: tuple[str, ...]) -> SeqLayout | None:
        """The :class:`SeqLayout` of ``segments`` concatenated, if all of them were split in this forward."""
        if not segments or any(name not in self.splits for name in segments):
            return None
        per_rank = zip(*(self.splits[name] for name in segments), strict=True)
        return SeqLayout(tuple(tuple(row) for row in per_rank))


# --- the context-parallel attention itself ---


class RoutedAttention:
    """What routed processors call instead of diffusers' attention dispatch (set as their ``_parallel_config``).

    Subclasses take ``dispatch_attention_fn``'s arguments: ``(B, S, H, D)`` query, key and value, then ``attn_mask``,
    ``dropout_p``, ``is_causal``, ``scale``, ``enable_gqa``.
    """

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError


@dataclass(eq=False)
class ContextParallelAttention(RoutedAttention):
    """Context-parallel attention of one transformer; set as its processors' ``_parallel_config``.

    Attributes:
        cp_group: The group the sequence is split over (ring × Ulysses ranks, ring-major).
        ulysses_group: Process group of the Ulysses dim (``None`` when ``ulysses_degree == 1``).
        ring_group: Process group of the ring dim (``None`` when ``ring_degree == 1``).
        ulysses_degree: Ulysses degree.
        ring_degree: Ring degree.
        local: Attention on whole sequences of local heads (Ulysses; ring and USP use their own kernels).
        mask_segments: Split tensor names whose concatenation, in this order, is the joint sequence a mask built by
            the model indexes (e.g. ``("encoder_hidden_states", "hidden_states")``).
        fp8: Ulysses exchanges in float8.
        chunks: Head chunks pipelined through Ulysses (see :func:`ulysses_attention`).
        mask_transform: Applied to every mask first (see :class:`~fastdit.parallel.plan.AttentionRouting`).
        exchange_lengths: Shard lengths depend on the data: exchange them at every call.
        forward: What the split hooks recorded for the current forward.
    """

    cp_group: dist.ProcessGroup | None
    ulysses_group: dist.ProcessGroup | None = None
    ring_group: dist.ProcessGroup | None = None
    ulysses_degree: int = 1
    ring_degree: int = 1
    local: LocalAttention = field(default_factory=local_attention)
    mask_segments: tuple[str, ...] = ()
    fp8: bool = False
    chunks: int = 1
    mask_transform: Callable[[torch.Tensor], torch.Tensor] | None = None
    exchange_lengths: bool = False
    forward: ForwardLayout = field(default_factory=ForwardLayout)

    # Compiled blocks break their graph here once: dynamo must not trace into the exchanges (async collectives and
    # their work handles, shard bookkeeping), where it would compile many small guarded fragments and recompile them.
    @torch.compiler.disable
    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
        attention_kwargs: dict[str, Any] | None = None,
        **_: Any,
    ) -> torch.Tensor:
        """Attention on sequence shards ``(B, S_local, H, D)``; same signature as ``dispatch_attention_fn``."""
        if dropout_p or is_causal or attention_kwargs:
            raise ValueError(
                "context-parallel attention supports neither dropout, causal masks nor backend-specific "
                f"attention_kwargs (got dropout_p={dropout_p}, is_causal={is_causal}, kwargs={attention_kwargs})"
            )
        if _is_block_mask(attn_mask):
            raise ValueError(
                "context-parallel attention got a flex BlockMask: a BlockMask is built over the whole sequence and "
                "cannot be reordered or sliced for a rank's token shard; declare the attention module in "
                "AttentionRouting.head_parallel, which runs its processor (and the BlockMask) on the whole sequence "
                "of the rank's heads"
            )
        if attn_mask is not None and self.mask_transform is not None:
            attn_mask = self.mask_transform(attn_mask)
        q_lens, kv_lens = self._lengths(query, key)
        layout = self.forward.layout(self.mask_segments) if attn_mask is not None else None
        if layout is not None and layout.rank_lens not in (q_lens, kv_lens):
            layout = None  # this attention's sequence is not the declared joint sequence: one contiguous split
        # A layout of the keys only (queries from one segment attending to the joint keys, NucleusMoE's image
        # queries over [image, text]) reorders the mask's key dim; a query dim other than 1 is then refused.
        if self.ring_degree > 1:
            return self._ring(query, key, value, attn_mask, scale, q_lens, kv_lens, layout)
        return ulysses_attention(
            query,
            key,
            value,
            group=self.ulysses_group,
            attn_mask=attn_mask,
            scale=scale,
            local=self.local,
            q_lens=q_lens,
            kv_lens=kv_lens,
            layout=layout,
            fp8=self.fp8,
            chunks=self.chunks,
        )

    def _lengths(self, query: torch.Tensor, key: torch.Tensor) -> tuple[list[int], list[int]]:
        """Every rank's query and key shard lengths, in cp-group order."""
        rows = self.shard_lengths([query.shape[1], key.shape[1]], query.device)
        return [row[0] for row in rows], [row[1] for row in rows]

    def shard_lengths(self, local: list[int], device: torch.device) -> list[list[int]]:
        """Every rank's ``local`` shard lengths (one list per rank, cp-group order); called by every rank alike.

        Derived without communication when every split of this forward was even; exchanged otherwise (or recalled in
        calls served by CUDA graphs, see :meth:`ForwardLayout.shard_lengths`), and always with
        :attr:`exchange_lengths`.
        """
        degree = self.ulysses_degree * self.ring_degree
        if self.exchange_lengths:  # data-dependent lengths: nothing can be derived or remembered
            return gather_lengths(local, self.cp_group, device)
        if self.forward.even:
            return [list(local) for _ in range(degree)]
        # Some split was uneven (a decision on global sizes: all ranks come here): exchange, or recall under graphs.
        return self.forward.shard_lengths(
            list(local), lambda values: gather_lengths(values, self.cp_group, device), dist.get_rank(self.cp_group)
        )

    def _ring(self, query, key, value, attn_mask, scale, q_lens, kv_lens, layout) -> torch.Tensor:
        """Ring (or USP) attention; a mask becomes this rank's query rows over keys in shard order."""
        mask = mask_in_shard_order(attn_mask, self.cp_group, q_lens=q_lens, kv_lens=kv_lens, layout=layout)
        if mask is not None and mask.shape[-2] != 1:
            rank = dist.get_rank(self.cp_group)
            mask = mask.narrow(-2, sum(q_lens[:rank]), q_lens[rank])
        if self.ulysses_degree > 1:
            from fastdit.parallel.attention.usp import usp_attention

            return usp_attention(
                query,
                key,
                value,
                ulysses_group=self.ulysses_group,
                ring_group=self.ring_group,
                attn_mask=mask,
                scale=scale,
                seq_lens=q_lens if q_lens == kv_lens else None,
            )
        from fastdit.parallel.attention.ring import ring_attention

        return ring_attention(query, key, value, group=self.ring_group, attn_mask=mask, scale=scale, kv_lens=kv_lens)


def _is_block_mask(mask: Any) -> bool:
    """Whether ``mask`` is a flex-attention ``BlockMask`` (imported lazily: flex attention is optional)."""
    if mask is None or isinstance(mask, torch.Tensor):
        return False
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError:  # pragma: no cover - torch without flex attention has no BlockMask to receive
        return False
    return isinstance(mask, BlockMask)


# --- routing: rebinding the entry point in processor modules ---

_LOCK = threading.Lock()
# (module name, global name) -> (original object, reference count, wrapper factory)
_ROUTED: dict[tuple[str, str], tuple[Any, int, Callable[[Any], Any]]] = {}


def _routing(original: Callable[..., Any], choose: Callable[[Any], RoutedAttention | None]) -> Callable[..., Any]:
    """A ``dispatch_attention_fn`` sending a call to ``choose(parallel_config)`` when that is not ``None``."""

    def dispatch_attention_fn(*args: Any, parallel_config: Any = None, **kwargs: Any) -> Any:
        marker = choose(parallel_config)
        if marker is not None:
            kwargs.pop("backend", None)
            return marker(*args, **kwargs)
        return original(*args, parallel_config=parallel_config, **kwargs)

    dispatch_attention_fn.__wrapped__ = original  # type: ignore[attr-defined]
    dispatch_attention_fn._fastdit_router = True  # type: ignore[attr-defined]
    return dispatch_attention_fn


def _router(original: Callable[..., Any]) -> Callable[..., Any]:
    """Routes the calls whose processor passed its marker as ``parallel_config``."""
    return _routing(original, lambda config: config if isinstance(config, RoutedAttention) else None)


def _marked_router(original: Callable[..., Any]) -> Callable[..., Any]:
    """Routes the calls without a ``parallel_config`` made while a marked attention module runs."""
    return _routing(original, lambda config: _ACTIVE.get() if config is None else None)


def _rebind(names: list[str], modules: list[Any], attr: str, wrap: Callable[[Any], Any]) -> Callable[[], None]:
    """Set global ``attr`` of each module to ``wrap(original)`` (reference-counted); return the undo."""
    with _LOCK:
        for name in names:
            kind = _ROUTED.get((name, attr), (None, 0, wrap))[2]
            if kind is not wrap:  # before changing anything
                raise ValueError(
                    f"module {name!r}: {attr} is already routed by {kind.__name__} for another transformer; one "
                    f"module cannot also be routed by {wrap.__name__}"
                )
        for name, module in zip(names, modules, strict=True):
            original, count, _ = _ROUTED.get((name, attr), (getattr(module, attr), 0, wrap))
            if count == 0:
                setattr(module, attr, wrap(original))
            _ROUTED[name, attr] = (original, count + 1, wrap)

    def undo() -> None:
        with _LOCK:
            for name, module in zip(names, modules, strict=True):
                original, count, _ = _ROUTED[name, attr]
                if count == 1:
                    setattr(module, attr, original)
                    del _ROUTED[name, attr]
                else:
                    _ROUTED[name, attr] = (original, count - 1, wrap)

    return undo


def route_marked_dispatch(module_names: Iterable[str]) -> Callable[[], None]:
    """Rebind ``dispatch_attention_fn`` in each named module to a router keyed on the running attention module.

    For processors that pass no ``parallel_config``: a call goes to the context-parallel attention of the marked
    attention module running in this thread (see :func:`mark_attention_modules`), any other call to diffusers
    unchanged. Reference-counted like :func:`route_modules`; returns the undo.

    Raises:
        ValueError: a module has no ``dispatch_attention_fn`` global.
    """
    return _route_entry_point(module_names, _marked_router)


def route_modules(module_names: Iterable[str]) -> Callable[[], None]:
    """Rebind ``dispatch_attention_fn`` in each named module to the router; return the undo.

    Raises:
        ValueError: a module has no ``dispatch_attention_fn`` global.
    """
    return _route_entry_point(module_names, _router)


def _route_entry_point(module_names: Iterable[str], wrap: Callable[[Any], Any]) -> Callable[[], None]:
    names = list(dict.fromkeys(module_names))
    modules = [importlib.import_module(name) for name in names]
    for name, module in zip(names, modules, strict=True):
        if not callable(getattr(module, ENTRY_POINT, None)):
            raise ValueError(f"module {name!r} has no {ENTRY_POINT}: its attention cannot be routed")
    return _rebind(names, modules, ENTRY_POINT, wrap)


# --- routing of processors that call F.scaled_dot_product_attention themselves ---

SDPA_ALIAS = "F"

# The context-parallel attention of the marked attention module running now in this thread (None: none is).
_ACTIVE: contextvars.ContextVar[ContextParallelAttention | None] = contextvars.ContextVar(
    "fastdit_cp_attention", default=None
)


class FunctionalProxy:
    """Stands in for ``torch.nn.functional`` as a processor module's ``F``: everything but SDPA is forwarded.

    ``scaled_dot_product_attention`` goes to the context-parallel attention of the marked attention module that is
    running in this thread (see :func:`mark_attention_modules`), converting ``(B, H, S, D)`` to the ``(B, S, H, D)``
    :class:`ContextParallelAttention` takes and back; any other call goes to the real function unchanged.
    """

    def __init__(self, functional: Any) -> None:
        self._functional = functional

    def __getattr__(self, name: str) -> Any:
        return getattr(self._functional, name)

    def scaled_dot_product_attention(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        marker = _ACTIVE.get()
        if marker is None:
            return self._functional.scaled_dot_product_attention(*args, **kwargs)
        return _routed_sdpa(marker, *args, **kwargs)


def _routed_sdpa(
    marker: ContextParallelAttention,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    if query.ndim != 4:
        raise ValueError(f"context-parallel attention expects (B, H, S, D) tensors, got query of shape {query.shape}")
    out_BSHD = marker(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
    )
    return out_BSHD.transpose(1, 2)


def _sdpa_proxy(original: Any) -> FunctionalProxy:
    return FunctionalProxy(original)


def route_sdpa_modules(module_names: Iterable[str]) -> Callable[[], None]:
    """Rebind the ``F`` (``torch.nn.functional``) global of each named module to a :class:`FunctionalProxy`.

    Reference-counted like :func:`route_modules`; returns the undo.

    Raises:
        ValueError: a module has no ``F`` global that is ``torch.nn.functional``.
    """
    names = list(dict.fromkeys(module_names))
    modules = [importlib.import_module(name) for name in names]
    for name, module in zip(names, modules, strict=True):
        alias = getattr(module, SDPA_ALIAS, None)
        if alias is not F and not isinstance(alias, FunctionalProxy):
            raise ValueError(f"module {name!r} has no global {SDPA_ALIAS} = torch.nn.functional to route")
    return _rebind(names, modules, SDPA_ALIAS, _sdpa_proxy)


def mark_attention_modules(
    transformer: torch.nn.Module, marker: ContextParallelAttention, local: Collection[str] = ()
) -> Callable[[], None]:
    """While an attention module of ``transformer`` not in ``local`` runs, route ``F`` proxies' SDPA to ``marker``.

    A forward pre-hook sets the marker for this thread; a forward hook that runs even when forward raises restores
    the previous value. Returns the undo (removes the hooks).
    """
    local = set(local)
    tokens = threading.local()

    def enter(module: torch.nn.Module, args: tuple) -> None:
        stack = tokens.__dict__.setdefault("stack", [])
        stack.append(_ACTIVE.set(marker))

    def leave(module: torch.nn.Module, args: tuple, output: Any) -> None:
        _ACTIVE.reset(tokens.stack.pop())

    handles = []
    for path, module in transformer.named_modules():
        if getattr(module, "processor", None) is None or path in local:
            continue
        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave, always_call=True))

    def undo() -> None:
        for handle in handles:
            handle.remove()

    return undo


class _SdpaCallMode(TorchFunctionMode):
    """Sends every ``scaled_dot_product_attention`` call made while it is active to one context-parallel attention.

    A torch function mode sees the call however the model spells it (``F.``, ``torch.nn.functional.``, a name
    imported from either); the mode is off inside its own handler, so the local kernels the context-parallel
    attention runs are the real ones.
    """

    def __init__(self, sdpa: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.sdpa = sdpa

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is F.scaled_dot_product_attention:
            return self.sdpa(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def route_sdpa_calls(
    transformer: torch.nn.Module,
    paths: Iterable[str],
    marker: ContextParallelAttention | None = None,
    *,
    sdpa: Callable[..., torch.Tensor] | None = None,
) -> Callable[[], None]:
    """While a module of ``transformer`` at one of ``paths`` runs, its SDPA calls go to ``marker``; returns the undo.

    A forward pre-hook enters a :class:`_SdpaCallMode`, a forward hook that runs even when forward raises leaves it.
    ``sdpa`` replaces the marker: a function with SDPA's own signature (``(B, H, S, D)`` tensors) that receives the
    calls instead (``""`` in ``paths`` is the transformer itself).
    """
    if (marker is None) == (sdpa is None):
        raise ValueError("route_sdpa_calls: give exactly one of marker and sdpa")
    handler = sdpa if sdpa is not None else functools.partial(_routed_sdpa, marker)
    tokens = threading.local()

    def enter(module: torch.nn.Module, args: tuple) -> None:
        mode = _SdpaCallMode(handler)
        mode.__enter__()
        tokens.__dict__.setdefault("stack", []).append(mode)

    def leave(module: torch.nn.Module, args: tuple, output: Any) -> None:
        tokens.stack.pop().__exit__(None, None, None)

    handles = []
    for path in paths:
        module = transformer.get_submodule(path)
        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave, always_call=True))

    def undo() -> None:
        for handle in handles:
            handle.remove()

    return undo


def attention_processors(transformer: torch.nn.Module) -> dict[str, Any]:
    """The attention processors of ``transformer`` by module path (modules with a ``processor`` attribute)."""
    return {name: m.processor for name, m in transformer.named_modules() if getattr(m, "processor", None) is not None}


def processor_sites(transformer: torch.nn.Module, local: Collection[str] = ()) -> dict[str, Any]:
    """The attention processors of ``transformer`` outside ``local``, each once, by the first module path using it.

    A processor object several modules share is one call site (its calls cannot be told apart).
    """
    sites: dict[str, Any] = {}
    seen: set[int] = set()
    for path, processor in attention_processors(transformer).items():
        if path not in local and id(processor) not in seen:
            seen.add(id(processor))
            sites[path] = processor
    return sites


def mark_processors(
    transformer: torch.nn.Module,
    marker: RoutedAttention | Callable[[str], RoutedAttention],
    local: Collection[str] = (),
) -> Callable[[], None]:
    """Point the attention processors of ``transformer`` at ``marker``, except those of the modules in ``local``.

    Args:
        transformer: The denoiser.
        marker: What its processors dispatch to: one object for all, or a function of a processor's site (its
            first module path, see :func:`processor_sites`) giving each processor its own.
        local: Module paths whose processors stay unmarked (ordinary local attention on what they receive).

    Returns:
        The undo.

    Raises:
        ValueError: a processor already has a parallel config (diffusers' own context parallelism is enabled), or
            one processor object serves both a local and a context-parallel module (it can only be one of them).
    """
    by_path = attention_processors(transformer)
    local = set(local)
    local_ids = {id(p): path for path, p in by_path.items() if path in local}
    for path, processor in by_path.items():
        if path not in local and id(processor) in local_ids:
            raise ValueError(
                f"{type(processor).__name__} is one object shared by {local_ids[id(processor)]!r} (local in the "
                f"context-parallel plan) and {path!r} (context-parallel): give the modules separate processors "
                "or list both as local"
            )
    sites = processor_sites(transformer, local)
    for processor in sites.values():
        current = getattr(processor, "_parallel_config", None)
        if current is not None and not isinstance(current, RoutedAttention):
            raise ValueError(
                f"{type(processor).__name__} already has a parallel config ({type(current).__name__}): "
                "disable diffusers' own parallelism before fastdit context parallelism"
            )
    markers = {path: marker if isinstance(marker, RoutedAttention) else marker(path) for path in sites}
    saved = [(p, p.__dict__.get("_parallel_config", _MISSING)) for p in sites.values()]
    for path, processor in sites.items():
        processor._parallel_config = markers[path]

    def undo() -> None:
        for processor, before in saved:
            if before is _MISSING:
                processor.__dict__.pop("_parallel_config", None)
            else:
                processor._parallel_config = before

    return undo


_MISSING = object()
