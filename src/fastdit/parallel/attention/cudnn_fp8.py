# ruff: noqa: N803 - shape suffixes (q_BSHD) name tensor layouts in attention code
"""FP8 attention through cuDNN's fused FP8 SDPA (the ``nvidia-cudnn-frontend`` package; Hopper or newer).

PyTorch's SDPA refuses float8 inputs, so FP8 attention comes from the cuDNN frontend's graph API: one graph per
input geometry, built once and executed on the caller's stream. The call is split in three so that compiled code
keeps what it can fuse:

1. :func:`quantize_per_tensor` — a per-tensor absmax scale and the cast to e4m3, plain torch ops that inductor fuses
   into whatever produced ``q``/``k``/``v`` (RoPE, QK-norm);
2. ``torch.ops.fastdit.cudnn_sdpa_fp8`` — the cuDNN kernel as an opaque custom op (so ``torch.compile`` traces around
   it without a graph break, and CUDA graphs capture it: it allocates nothing per call);
3. the output's dequantization, again plain torch (it fuses into the next layer's input cast).

Scales need no host sync: they stay on the device. They are each call's absmax of Q, K and V, or fixed per
attention module by a calibration (:class:`StaticScales`): then step 1 is a multiply, a clamp and a cast, which keeps
the fused QK-norm + RoPE producers free of a reduction over the whole tensor. The output scale is fixed before the
kernel from V's scale, because a softmax-weighted average of value rows can never exceed ``max |V|``; the
probabilities are scaled by e4m3's maximum, since they lie in [0, 1]. On Hopper the fused kernel writes FP8 outputs
only (cuDNN 9.13 adds bf16 outputs on Blackwell), which is why the output carries its own scale.
"""

from __future__ import annotations

import importlib
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fastdit.config import static_fp8_scale

__all__ = ["StaticScales", "cudnn_fp8_attention", "import_frontend", "quantize_per_tensor", "quantize_static"]

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)
_PACKAGE = "nvidia-cudnn-frontend"


def import_frontend() -> Any:
    """The ``cudnn`` module of ``nvidia-cudnn-frontend``.

    Raises:
        ImportError: the package is not installed (names it).
    """
    try:
        return importlib.import_module("cudnn")
    except ImportError as exc:
        raise ImportError(f"FP8 attention needs the {_PACKAGE!r} package: pip install {_PACKAGE}") from exc


def quantize_per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` scaled by its absmax into e4m3, and the descale (a ``(1, 1, 1, 1)`` float32 tensor on its device)."""
    amax = x.detach().abs().amax().float().clamp(min=1e-12)
    x8 = (x.float() * (E4M3_MAX / amax)).to(E4M3)
    return x8, (amax / E4M3_MAX).reshape(1, 1, 1, 1)


def quantize_static(x: torch.Tensor, descale: torch.Tensor, inverse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` in e4m3 at a fixed scale (``x * inverse``, clipped to e4m3's range), and its ``descale``."""
    return (x.float() * inverse).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), descale


@dataclass(frozen=True, eq=False)
class StaticScales:
    """Fixed per-tensor FP8 scales of one attention module's Q, K and V (from a calibration).

    Attributes:
        descale: Of Q, K and V: ``amax * headroom / 448``, each a ``(1, 1, 1, 1)`` float32 tensor.
        inverse: Their reciprocals (what the inputs are multiplied by before the cast).
    """

    descale: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    inverse: tuple[torch.Tensor, torch.Tensor, torch.Tensor]

    @classmethod
    def of(cls, amax: Sequence[float], headroom: float, device: torch.device) -> StaticScales:
        """The scales mapping ``amax[i] * headroom`` (Q, K, V) to e4m3's largest value; a tensor that was all zeros
        on the calibration gets the smallest normal float32 as its scale."""
        if len(amax) != 3:
            raise ValueError(f"StaticScales needs three maxima (Q, K, V), got {len(amax)}")
        values = [static_fp8_scale(float(a), headroom) for a in amax]
        descale = tuple(torch.full((1, 1, 1, 1), v, dtype=torch.float32, device=device) for v in values)
        return cls(descale=descale, inverse=tuple(1.0 / d for d in descale))  # type: ignore[arg-type]

    @property
    def device(self) -> torch.device:
        """Where the scales are."""
        return self.descale[0].device

    def to(self, device: torch.device) -> StaticScales:
        """The same scales on ``device``."""
        return StaticScales(
            descale=tuple(d.to(device) for d in self.descale),  # type: ignore[arg-type]
            inverse=tuple(i.to(device) for i in self.inverse),  # type: ignore[arg-type]
        )


@dataclass
class _Plan:
    graph: Any
    workspace: torch.Tensor
    tensors: tuple[Any, ...]  # q, k, v, descale_q, descale_k, descale_v, descale_s, scale_s, scale_o, out, amaxes…


_PLANS: dict[tuple[Any, ...], _Plan] = {}
_HANDLES: dict[int, Any] = {}
_LOCK = threading.RLock()  # _build takes the handle while the plan table is held


def _handle(device: torch.device) -> Any:
    cudnn = import_frontend()
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _LOCK:
        if index not in _HANDLES:
            with torch.cuda.device(index):
                _HANDLES[index] = cudnn.create_handle()
        return _HANDLES[index]


def _dims(x_BSHD: torch.Tensor) -> tuple[list[int], list[int]]:
    """``(B, H, S, D)`` dims and strides of a ``BSHD`` tensor: cuDNN reads the heads-major view in place."""
    b, s, h, d = x_BSHD.shape
    sb, ss, sh, sd = x_BSHD.stride()
    return [b, h, s, d], [sb, sh, ss, sd]


def _build(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, out: torch.Tensor, attn_scale: float) -> _Plan:
    cudnn = import_frontend()
    handle = _handle(q8.device)
    e4m3, fp32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=fp32, compute_data_type=fp32, handle=handle)

    def operand(name: str, x: torch.Tensor) -> Any:
        dims, strides = _dims(x)
        return graph.tensor(name=name, dim=dims, stride=strides, data_type=e4m3)

    scalar = {"dim": [1, 1, 1, 1], "stride": [1, 1, 1, 1], "data_type": fp32}
    q, k, v = operand("q", q8), operand("k", k8), operand("v", v8)
    scales = [graph.tensor(name=n, **scalar) for n in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s")]
    scale_o = graph.tensor(name="scale_o", **scalar)
    o, _, amax_s, amax_o = graph.sdpa_fp8(
        q=q,
        k=k,
        v=v,
        descale_q=scales[0],
        descale_k=scales[1],
        descale_v=scales[2],
        descale_s=scales[3],
        scale_s=scales[4],
        scale_o=scale_o,
        generate_stats=False,
        attn_scale=attn_scale,
        use_causal_mask=False,
    )
    dims, strides = _dims(out)
    o.set_output(True).set_dim(dims).set_stride(strides).set_data_type(e4m3)
    for amax in (amax_s, amax_o):
        amax.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(fp32)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    workspace = torch.empty(max(graph.get_workspace_size(), 1), dtype=torch.uint8, device=q8.device)
    return _Plan(graph=graph, workspace=workspace, tensors=(q, k, v, *scales, scale_o, o, amax_s, amax_o))


def _key(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, attn_scale: float) -> tuple[Any, ...]:
    return (q8.device, attn_scale, *(tuple(x.shape) + tuple(x.stride()) for x in (q8, k8, v8)))


_CONSTANTS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _probability_scales(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Descale and scale of the softmax probabilities (in [0, 1]: scaled to e4m3's whole range)."""
    if device not in _CONSTANTS:
        one = torch.ones(1, 1, 1, 1, dtype=torch.float32, device=device)
        _CONSTANTS[device] = (one / E4M3_MAX, one * E4M3_MAX)
    return _CONSTANTS[device]


@torch.library.custom_op("fastdit::cudnn_sdpa_fp8", mutates_args=())
def cudnn_sdpa_fp8(
    q8: torch.Tensor,
    k8: torch.Tensor,
    v8: torch.Tensor,
    descale_q: torch.Tensor,
    descale_k: torch.Tensor,
    descale_v: torch.Tensor,
    scale_o: torch.Tensor,
    attn_scale: float,
) -> torch.Tensor:
    """cuDNN FP8 attention of ``BSHD`` e4m3 tensors; the e4m3 output is ``O * scale_o`` (``BSHD``, contiguous)."""
    out = torch.empty(q8.shape[:-1] + v8.shape[-1:], dtype=E4M3, device=q8.device)
    key = _key(q8, k8, v8, attn_scale)
    plan = _PLANS.get(key)
    if plan is None:
        with _LOCK:
            plan = _PLANS.get(key) or _build(q8, k8, v8, out, attn_scale)
            _PLANS[key] = plan
    cudnn = import_frontend()
    handle = _handle(q8.device)
    cudnn.set_stream(handle, torch.cuda.current_stream(q8.device).cuda_stream)
    descale_s, scale_s = _probability_scales(q8.device)
    amax = torch.empty(2, 1, 1, 1, dtype=torch.float32, device=q8.device)
    values = (q8, k8, v8, descale_q, descale_k, descale_v, descale_s, scale_s, scale_o, out, amax[0:1], amax[1:2])
    plan.graph.execute(dict(zip(plan.tensors, values, strict=True)), plan.workspace, handle=handle)
    return out


@cudnn_sdpa_fp8.register_fake
def _(q8, k8, v8, descale_q, descale_k, descale_v, scale_o, attn_scale):
    return torch.empty(q8.shape[:-1] + v8.shape[-1:], dtype=E4M3, device=q8.device)


def cudnn_fp8_attention(
    q_BSHD: torch.Tensor,
    k_BSHD: torch.Tensor,
    v_BSHD: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    static: StaticScales | None = None,
) -> torch.Tensor:
    """Attention of ``BSHD`` tensors in FP8 (per-tensor scales), returned in the inputs' dtype.

    Args:
        q_BSHD: Queries.
        k_BSHD: Keys (as many heads as the queries).
        v_BSHD: Values.
        attn_mask: Must be ``None``.
        scale: The softmax scale (default ``1 / sqrt(head_dim)``).
        static: Fixed scales of Q, K and V (on the inputs' device); ``None``: each tensor's own absmax.

    Raises:
        ValueError: a mask was given, or K/V have other head counts than Q (neither is offered by the kernel here).
        ImportError: ``nvidia-cudnn-frontend`` is not installed.
    """
    if attn_mask is not None:
        raise ValueError("FP8 attention (cuDNN) takes no attention mask; use an SDPA backend for masked attention")
    if k_BSHD.shape[2] != q_BSHD.shape[2]:
        raise ValueError(
            f"FP8 attention (cuDNN) needs as many K/V heads as Q heads (got {k_BSHD.shape[2]} and {q_BSHD.shape[2]})"
        )
    attn_scale = float(scale) if scale is not None else 1.0 / math.sqrt(q_BSHD.shape[-1])
    inputs = (q_BSHD, k_BSHD, v_BSHD)
    if static is None:
        (q8, dq), (k8, dk), (v8, dv) = (quantize_per_tensor(x) for x in inputs)
    else:
        triples = zip(inputs, static.descale, static.inverse, strict=True)
        (q8, dq), (k8, dk), (v8, dv) = (quantize_static(x, d, i) for x, d, i in triples)
    out8 = torch.ops.fastdit.cudnn_sdpa_fp8(q8, k8, v8, dq, dk, dv, 1.0 / dv, attn_scale)
    return (out8.float() * dv.reshape(1, 1, 1, 1)).to(q_BSHD.dtype)
