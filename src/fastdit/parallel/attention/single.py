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

On the first route each processor can have its own :class:`AttentionSite` in front of the shared backend: one that
records its largest |Q|, |K|, |V| (``Attention(calibrate=True)``, for :func:`fastdit.calibration.calibrate_scales`)
or one holding its static FP8 scales (``Attention(backend="cudnn-fp8", scales=...)``). The scales are tensors the
site holds, so compiled blocks take them as graph inputs: one compiled graph still serves every block.
"""

from __future__ import annotations

from collections.abc import Callable
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
    processor_sites,
    route_modules,
    route_sdpa_calls,
)
from fastdit.parallel.attention.ulysses import LocalAttention
from fastdit.process import require_cuda_capability

if TYPE_CHECKING:
    from fastdit.parallel.attention.cudnn_fp8 import StaticScales
    from fastdit.parallel.plan import AttentionRouting
    from fastdit.quantize import ScaleRecorder

__all__ = [
    "MASKED_BACKENDS",
    "AttentionSite",
    "SingleDeviceAttention",
    "apply_attention_backend",
    "attention_sites",
    "check_attention_backend",
    "dispatch_routed",
]

# Devices the FP8 kernel runs on (a test registers a host stand-in for the kernel and adds "cpu").
_FP8_DEVICES = ("cuda",)

# The three inputs a calibration records per attention module, as name suffixes in the scales.
QKV = (":q", ":k", ":v")

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
        sites: The processors' own :class:`AttentionSite` by site (module path), when they have one.
        recorder: With ``Attention(calibrate=True)``: the sites' recorded maxima.
    """

    backend: str
    route: str
    local: LocalAttention
    takes_masks: bool
    served: int = 0
    passed: dict[str, int] = field(default_factory=dict)
    sites: dict[str, AttentionSite] = field(default_factory=dict)
    recorder: ScaleRecorder | None = None

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
        static: StaticScales | None = None,
        **_: Any,
    ) -> torch.Tensor:
        """``dispatch_attention_fn``'s call (``(B, S, H, D)`` tensors): :meth:`sdpa` on the heads-major views."""
        args = (query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2))
        return self.sdpa(*args, attn_mask, dropout_p, is_causal, scale, enable_gqa, static=static).transpose(1, 2)

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
        static: StaticScales | None = None,
    ) -> torch.Tensor:
        """``F.scaled_dot_product_attention`` (``(B, H, S, D)`` tensors) by the backend where it can take the call
        (with ``static``, the FP8 backend's fixed scales of this call site)."""
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
        extra = {} if static is None else {"static": static}
        out_BSHD = self.local(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=attn_mask, scale=scale, **extra
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
        if self.backend == "cudnn-fp8" and query.device.type not in _FP8_DEVICES:
            return "not on a CUDA device"
        return None

    def stats(self) -> dict[str, Any]:
        """What the backend served, for summaries."""
        out: dict[str, Any] = {
            "backend": self.backend,
            "route": self.route,
            "served_calls": self.served,
            "sdpa_calls": dict(self.passed),
        }
        if self.recorder is not None:
            out["calibrating_sites"] = len(self.sites)
        elif self.sites:
            static = sum(site.static is not None for site in self.sites.values())
            out["static_scale_sites"] = static
            out["dynamic_scale_sites"] = len(self.sites) - static
        return out


@dataclass(eq=False)
class AttentionSite(RoutedAttention):
    """One attention processor's calls on their way to the shared backend: recorded, or with its static scales.

    Attributes:
        name: The site: the first module path using the processor.
        backend: The transformer's shared backend (its counters count every site's calls).
        static: This site's fixed FP8 scales (``None``: the backend's own, dynamic for ``cudnn-fp8``).
        recorder: Records this site's largest |Q|, |K|, |V| (``Attention(calibrate=True)``).
    """

    name: str
    backend: SingleDeviceAttention
    static: StaticScales | None = None
    recorder: ScaleRecorder | None = None

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
        """``dispatch_attention_fn``'s call, through the shared backend."""
        if self.recorder is not None:
            for suffix, x in zip(QKV, (query, key, value), strict=True):
                self.recorder.observe(self.name + suffix, x)
        static = self.static
        if static is not None and static.device != query.device:  # placed where the weights were, computed elsewhere
            static = static.to(query.device)
        return self.backend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, static=static)


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
    if (attention.scales is not None or attention.calibrate) and not dispatch_routed(routing):
        what = "static attention scales" if attention.scales is not None else "calibrate=True"
        raise ValueError(
            f"{what} need each attention module's calls, and this family's attention is not routed through "
            "diffusers' dispatch_attention_fn (its SDPA calls cannot be told apart by module); use dynamic scales"
        )
    if compiled and not dispatch_routed(routing):
        raise ValueError(
            "this family's attention is not routed through diffusers' dispatch_attention_fn, so the backend takes "
            "every SDPA call of the forward through a torch function mode, which torch.compile cannot trace; run "
            "without Compile, or keep the default backend"
        )
    if attention.backend != "cudnn-fp8":
        return
    what = f"backend={attention.backend!r} runs cuDNN's FP8 attention kernel"
    require_cuda_capability(device, (9, 0), what)


def dispatch_routed(routing: AttentionRouting | None) -> bool:
    """Whether a family's attention goes through diffusers' dispatch (so each processor's calls can be told apart)."""
    return routing is not None and bool(routing.modules)


def attention_sites(transformer: torch.nn.Module, component: str = "transformer") -> list[str]:
    """The names a calibration records for ``transformer``'s attention modules (``<component>.<path>:q`` etc.)."""
    return [f"{component}.{path}{suffix}" for path in processor_sites(transformer) for suffix in QKV]


def _site_factory(
    marker: SingleDeviceAttention, attention: Attention, component: str, device: torch.device
) -> Callable[[str], AttentionSite] | None:
    """What gives each processor its own :class:`AttentionSite` (``None``: they all share ``marker``)."""
    if attention.calibrate:
        from fastdit.quantize import ScaleRecorder

        recorder = marker.recorder = ScaleRecorder()
    elif attention.scales is None:
        return None
    table = attention.scales.lookup() if attention.scales is not None else {}

    def site(path: str) -> AttentionSite:
        names = [f"{component}.{path}{suffix}" for suffix in QKV]
        if attention.calibrate:
            recorder.layers.extend(name.removeprefix(f"{component}.") for name in names)
            made = AttentionSite(name=path, backend=marker, recorder=recorder)
        else:
            found = [table.get(name) for name in names]
            static = None
            if all(entry is not None for entry in found):  # a module never called on the calibration: dynamic
                static = _static_scales([entry[0] for entry in found], attention.headroom, device)
            made = AttentionSite(name=path, backend=marker, static=static)
        marker.sites[path] = made
        return made

    return site


def _static_scales(amax: list[float], headroom: float, device: torch.device) -> StaticScales:
    from fastdit.parallel.attention.cudnn_fp8 import StaticScales

    return StaticScales.of(amax, headroom, device)


def apply_attention_backend(
    transformer: torch.nn.Module,
    attention: Attention,
    routing: AttentionRouting | None = None,
    *,
    component: str = "transformer",
    device: torch.device | None = None,
) -> Applied:
    """Send ``transformer``'s attention calls to ``attention``'s backend.

    Args:
        transformer: The denoiser.
        attention: The backend.
        routing: The family's attention routing (its context-parallel plan's): with ``modules``, the processors
            there are pointed at the backend through diffusers' dispatch; otherwise every SDPA call of the forward.
        component: The denoiser's name in the pipeline (the prefix of its sites in ``attention.scales``).
        device: Where it computes (where static scales are placed; default: its parameters' device).

    Returns:
        The undo; its ``state`` is the :class:`SingleDeviceAttention` (its counts say what the backend served;
        with ``calibrate``, its ``recorder`` holds the maxima by ``<path>:q`` etc.).
    """
    marker = SingleDeviceAttention(
        backend=attention.backend,
        route="dispatch" if dispatch_routed(routing) else "sdpa calls",
        local=local_attention(attention),
        takes_masks=attention.backend in MASKED_BACKENDS,
    )
    if not dispatch_routed(routing):
        return Applied(route_sdpa_calls(transformer, [""], sdpa=marker.sdpa), marker)
    if device is None:
        param = next(transformer.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
    sites = _site_factory(marker, attention, component, device)
    undo = [route_modules(routing.modules)]
    try:
        undo.append(mark_processors(transformer, marker if sites is None else sites))
    except BaseException:
        undo[0]()
        raise

    def undo_all() -> None:
        for fn in reversed(undo):
            fn()

    return Applied(undo_all, marker)
