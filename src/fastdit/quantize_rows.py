"""Static FP8 with one scale per output channel: ``Quantize(mode="fp8_static", weight_scales="row")``.

torchao 0.18's static FP8 config scales weights per tensor only: its row-wise weights need row-wise activation scales,
one per token, which a fixed calibration cannot give for inputs of any length. The matmul here pairs the two anyway:
the weight keeps one scale per output channel (a torchao ``Float8Tensor`` with ``PerRow`` granularity, so the layer's
weight still reports the model's dtype and moves like any tensor), the activation one fixed scale, repeated for every
row where ``torch._scaled_mm``'s row-wise kernels want one scale per row of each operand. Row-wise scales keep a
weight's small output channels apart from its large ones, and on Hopper the row-wise kernels are the ones torchao's
dynamic per-row mode runs.

Inside compiled blocks the activation's scaling and cast fuse into the kernel that produces the activation, as they
do for the per-tensor mode.
"""

from __future__ import annotations

import torch

from fastdit.config import FP8_MAX

__all__ = ["rowwise_linear"]


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor, scale: float, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` in FP8: ``x`` cast with the fixed activation ``scale``, ``weight`` a row-wise torchao
    ``Float8Tensor`` (:func:`fastdit.quantize.rowwise_weight`); the output in ``x``'s dtype."""
    flat = x.reshape(-1, x.shape[-1])
    quantized = (flat.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    # The row-wise kernels read one activation scale per row: the fixed scale, repeated (a tiny fill per call).
    scale_a = torch.full((flat.shape[0], 1), scale, dtype=torch.float32, device=x.device)
    out = torch._scaled_mm(
        quantized,
        weight.qdata.t(),
        scale_a=scale_a,
        scale_b=weight.scale.reshape(1, -1),
        bias=bias,
        out_dtype=x.dtype,
        use_fast_accum=True,
    )
    return out.reshape(*x.shape[:-1], out.shape[-1])
