"""A third-party DiT (not a diffusers class) with its own block signature and a sampler loop, for cache tests."""

from __future__ import annotations

import torch
from torch import nn

from fastdit.models.base import BlockGroup, ForwardPattern, ModelAdapter


class ToyBlock(nn.Module):
    """``forward(x, cond, scale=1.0) -> x``: a pre-norm MLP residual block conditioned on ``cond``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.mod = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cond: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x + scale * self.mlp(self.norm(x) * (1 + self.mod(cond)[:, None]))


class ToyDiT(nn.Module):
    """Blocks called positionally, with an extra operation between blocks (a running skip average)."""

    def __init__(self, dim: int = 16, depth: int = 6) -> None:
        super().__init__()
        self.embed = nn.Linear(4, dim)
        self.time = nn.Linear(1, dim)
        self.layers = nn.ModuleList(ToyBlock(dim) for _ in range(depth))
        self.out = nn.Linear(dim, 4)

    def forward(self, sample: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        x = self.embed(sample)
        cond = self.time(t.reshape(-1, 1).float())
        skip = torch.zeros_like(x)
        for layer in self.layers:
            x = layer(x, cond, 0.5)
            skip = 0.5 * skip + 0.5 * x  # loop-body work the cache must not disturb
        return self.out(x + 0.1 * skip)


TOY_ADAPTER = ModelAdapter(
    family="toy",
    transformer_classes=(f"{ToyDiT.__module__}.ToyDiT",),
    block_groups=(BlockGroup(path="layers", pattern=ForwardPattern.P3, hidden_arg="x"),),
    timestep_arg="t",
)


def sample(model: ToyDiT, steps: int = 10, seed: int = 0, cfg: bool = False) -> torch.Tensor:
    """Euler sampling from t=1 to 0; with ``cfg`` two forwards per step (cond then uncond), no cache context."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 8, 4, generator=generator)
    ts = torch.linspace(1.0, 0.0, steps + 1)
    with torch.no_grad():
        for i in range(steps):
            t = ts[i].expand(2)
            v = model(x, t)
            if cfg:
                v = 2.0 * v - model(x * 0.5, t)
            x = x + (ts[i + 1] - ts[i]) * v
    return x
