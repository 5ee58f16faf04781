# ruff: noqa: N806 - shape suffixes (out_BSHD) name tensor layouts in attention code
"""An attention backend of one's choosing on a single device (no context parallelism).

Under context parallelism the local kernel is :attr:`ContextParallelAttention.local`. Without it, the attention
calls of the transformer go to the backend :func:`local_attention` builds for an :class:`~fastdit.config.Attention`,
routed one of two ways:

* **through diffusers' dispatch** — for families whose context-parallel plan routes ``dispatch_attention_fn`` by
  the processors' ``parallel_config`` (:attr:`AttentionRouting.modules`: FLUX, Qwen-Image, Wan, HunyuanVideo and
  most others): the processors are pointed at a :class:`SingleDeviceAttention`, which compiled blocks trace in place
  (no graph break), so the FP8 backend's quantization fuses into the producers of ``q``/``k``/``v``;
* **every SDPA call** of the transformer's forward, however spelled, for the other families: a torch function mode
  entered by a forward pre-hook and left by a forward hook, so nothing outside this transformer is affected.
  Dynamo cannot trace tensor methods under a user mode, so this route is refused with compiled blocks.

Calls the backend cannot take (an attention mask for kernels without one, dropout, causal masks) run the ordinary
SDPA instead and are counted, so :func:`fastdit.summary` says how much of the attention the backend served.
Processors that deliberately pass no ``parallel_config`` (Wan's cross-attention to the text) keep diffusers'
default on the first route.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from fastdit.config import Attention
from fastdit.hooks.state import Applied
from fastdit.parallel.attention.dispatch import (
    RoutedAttention,
    local_attention,
    mark_processors,
    route_modules,
    route_sdpa_calls,
)
from fastdit.parallel.attention.ulysses import LocalAttention
from fastdit.process import require_cuda_capability

if TYPE_CHECKING:
    from fastdit.parallel.plan import AttentionRouting

__all__ = ["MASKED_BACKENDS", "SingleDeviceAttention", "apply_attention_backend", "check_attention_backend"]

# Backends whose kernels take an attention mask (the others serve unmasked calls; masked ones run SDPA).
MASKED_BACKENDS = frozenset({"sdpa", "flash", "cudnn", "efficient", "math"})


@dataclass(eq=False)
class SingleDeviceAttention(RoutedAttention):
    """The SDPA calls of one transformer, sent to one local backend.

    Attributes:
        backend: The :attr:`Attention.backend` name.
        route: ``"dispatch"`` (the processors' dispatch) or ``"sdpa calls"`` (every SDPA call of the forward).
        local: The backend's kernel.
        takes_masks: Whether the kernel takes an attention mask.
        served: Calls the backend computed, counted in eager code only (compiled blocks and CUDA graph replays do
            not count: a Python counter in traced code would recompile at every call).
        passed: Calls it could not take, computed by SDPA instead, by reason (counted the same way).
    """

    backend: str
    route: str
    local: LocalAttention
    takes_masks: bool
    served: int = 0
    passed: dict[str, int] = field(default_factory=dict)

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
        **_: Any,
    ) -> torch.Tensor:
        """``dispatch_attention_fn``'s call (``(B, S, H, D)`` tensors): :meth:`sdpa` on the heads-major views."""
        args = (query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2))
        return self.sdpa(*args, attn_mask, dropout_p, is_causal, scale, enable_gqa).transpose(1, 2)

    def sdpa(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        """``F.scaled_dot_product_attention`` (``(B, H, S, D)`` tensors) by the backend where it can take the call."""
        reason = self._refusal(query, key, attn_mask, dropout_p, is_causal)
        self._count(reason)
        if reason is not None:
            return F.scaled_dot_product_attention(
                query,
                key,
                value,
                attn_mask=attn_mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=scale,
                enable_gqa=enable_gqa,
            )
        out_BSHD = self.local(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=attn_mask, scale=scale
        )
        return out_BSHD.transpose(1, 2)

    def _count(self, reason: str | None) -> None:
        # Not while dynamo traces: a counter it saw change would be a guard that fails at every call (a recompile
        # each time, until the recompile limit sends the block back to eager code).
        if torch.compiler.is_compiling():
            return
        if reason is None:
            self.served += 1
        else:
            self.passed[reason] = self.passed.get(reason, 0) + 1

    def _refusal(
        self, query: torch.Tensor, key: torch.Tensor, mask: Any, dropout_p: float, is_causal: bool
    ) -> str | None:
        if dropout_p:
            return "dropout"
        if is_causal:
            return "causal"
        if mask is not None and not self.takes_masks:
            return "mask"
        if query.ndim != 4 or key.ndim != 4:
            return "not 4-D"
        if self.backend == "cudnn-fp8" and query.device.type != "cuda":
            return "not on a CUDA device"
        return None

    def stats(self) -> dict[str, Any]:
        """What the backend served, for summaries."""
        return {
            "backend": self.backend,
            "route": self.route,
            "served_calls": self.served,
            "sdpa_calls": dict(self.passed),
        }


def check_attention_backend(
    attention: Attention, device: torch.device, routing: AttentionRouting | None = None, compiled: bool = False
) -> None:
    """Refuse a backend that cannot run on ``device`` (or a route compiled blocks cannot trace), before any module is
    touched.

    Raises:
        ImportError: the backend's package is not installed (names it).
        ValueError: ``cudnn-fp8`` on a device other than a CUDA GPU of compute capability 9.0 or newer; compiled
            blocks with a family whose attention is not routed through diffusers' dispatch.
    """
    local_attention(attention)  # imports the backend's package: a missing one raises here, naming it
    if compiled and not _dispatched(routing):
        raise ValueError(
            "this family's attention is not routed through diffusers' dispatch_attention_fn, so the backend takes "
            "every SDPA call of the forward through a torch function mode, which torch.compile cannot trace; run "
            "without Compile, or keep the default backend"
        )
    if attention.backend != "cudnn-fp8":
        return
    what = f"backend={attention.backend!r} runs cuDNN's FP8 attention kernel"
    require_cuda_capability(device, (9, 0), what)


def _dispatched(routing: AttentionRouting | None) -> bool:
    return routing is not None and bool(routing.modules)


def apply_attention_backend(
    transformer: torch.nn.Module, attention: Attention, routing: AttentionRouting | None = None
) -> Applied:
    """Send ``transformer``'s attention calls to ``attention``'s backend.

    Args:
        transformer: The denoiser.
        attention: The backend.
        routing: The family's attention routing (its context-parallel plan's): with ``modules``, the processors
            there are pointed at the backend through diffusers' dispatch; otherwise every SDPA call of the forward.

    Returns:
        The undo; its ``state`` is the :class:`SingleDeviceAttention` (its counts say what the backend served).
    """
    marker = SingleDeviceAttention(
        backend=attention.backend,
        route="dispatch" if _dispatched(routing) else "sdpa calls",
        local=local_attention(attention),
        takes_masks=attention.backend in MASKED_BACKENDS,
    )
    if not _dispatched(routing):
        return Applied(route_sdpa_calls(transformer, [""], sdpa=marker.sdpa), marker)
    undo = [route_modules(routing.modules)]
    try:
        undo.append(mark_processors(transformer, marker))
    except BaseException:
        undo[0]()
        raise

    def undo_all() -> None:
        for fn in reversed(undo):
            fn()

    return Applied(undo_all, marker)
