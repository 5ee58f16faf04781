"""A norm over features split across the tensor-parallel ranks (Wan's QK-norm over the whole inner dim).

Column-parallel q/k projections leave each rank with a slice of the features; a norm over the *whole* feature dim
(RMSNorm or LayerNorm across heads) computed on that slice alone is silently wrong. This module holds the rank's
slice of the norm's weight and sums the statistics over the TP group, so its output is the original norm's output
restricted to the rank's features.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

__all__ = ["ShardedNormModule"]


class ShardedNormModule(torch.nn.Module):
    """RMSNorm / LayerNorm over ``num_features`` features of which this rank holds a slice.

    Statistics are computed in float32 and summed over ``group`` (RMS: one all-reduce of the sum of
    squares; LayerNorm: the sum, then the centred sum of squares); the affine weight (and bias) is the rank's slice.

    Args:
        kind: ``"rms"`` or ``"layer"``.
        num_features: The full feature count the statistics are taken over.
        eps: The original norm's epsilon.
        weight: The rank's slice of the weight, or ``None``.
        bias: The rank's slice of the bias (LayerNorm), or ``None``.
        group: The tensor-parallel process group.
    """

    def __init__(
        self,
        kind: str,
        num_features: int,
        eps: float,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        group: dist.ProcessGroup,
    ) -> None:
        super().__init__()
        if kind not in ("rms", "layer"):
            raise ValueError(f"ShardedNormModule.kind={kind!r}: must be 'rms' or 'layer'")
        self.kind = kind
        self.num_features = num_features
        self.eps = eps
        self.group = group
        self.weight = None if weight is None else torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        # Functional collective: traceable by torch.compile and capturable in a CUDA graph.
        return funcol.all_reduce(t.contiguous(), "sum", self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        if self.kind == "rms":
            mean_square = self._sum(x32.pow(2).sum(-1, keepdim=True)) / self.num_features
            y = x32 * torch.rsqrt(mean_square + self.eps)
        else:
            # Two passes (mean, then centred squares) as LayerNorm does: E[x²] − E[x]² cancels badly.
            centred = x32 - self._sum(x32.sum(-1, keepdim=True)) / self.num_features
            var = self._sum(centred.pow(2).sum(-1, keepdim=True)) / self.num_features
            y = centred * torch.rsqrt(var + self.eps)
        if self.weight is not None:
            y = y * self.weight.float()
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        local = None if self.weight is None else self.weight.shape[0]
        return f"kind={self.kind}, num_features={self.num_features}, local={local}, eps={self.eps}"
