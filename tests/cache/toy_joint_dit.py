"""A third-party dual-stream DiT unknown to fastdit, written the way such models often are.

Its blocks live in an unusual list (``stages``), are called by keyword with their own argument names, return
``(txt, img)`` except the last, which returns only ``img``, and the sampler's loop does work between blocks that
depends on the block index. The text and image streams have the same shape, so only their values tell them apart.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional
from torch import nn


class JointBlock(nn.Module):
    """Joint attention over ``cat(txt, img)`` and one MLP per stream; the last block drops the text stream."""

    def __init__(self, dim: int, heads: int, last: bool = False) -> None:
        super().__init__()
        self.heads, self.last = heads, last
        self.norm_img, self.norm_txt = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv_img, self.qkv_txt = nn.Linear(dim, 3 * dim), nn.Linear(dim, 3 * dim)
        self.out_img, self.out_txt = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.mlp_img = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.mlp_txt = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.mod = nn.Linear(dim, 2 * dim)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.heads, -1)).transpose(1, 2)

    def forward(
        self, img: torch.Tensor, txt: torch.Tensor, vec: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
        shift, scale = self.mod(vec)[:, None].chunk(2, dim=-1)
        n_txt = txt.shape[1]
        qkv = torch.cat([self.qkv_txt(self.norm_txt(txt)), self.qkv_img(self.norm_img(img) * (1 + scale) + shift)], 1)
        q, k, v = (self._heads(t) for t in qkv.chunk(3, dim=-1))
        # Spelled through the module path, not a module-level ``F``.
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        img = img + 0.5 * self.out_img(attn[:, n_txt:])
        img = img + 0.5 * self.mlp_img(img)
        if self.last:
            return img
        txt = txt + 0.5 * self.out_txt(attn[:, :n_txt])
        return txt + 0.5 * self.mlp_txt(txt), img


class ToyJointDiT(nn.Module):
    """``forward(latents, context, sigma)``; blocks in ``stages``, the last of which returns only ``img``."""

    def __init__(self, dim: int = 16, heads: int = 2, depth: int = 5) -> None:
        super().__init__()
        self.embed, self.embed_txt = nn.Linear(4, dim), nn.Linear(6, dim)
        self.time = nn.Linear(1, dim)
        self.stages = nn.ModuleList(JointBlock(dim, heads, last=i == depth - 1) for i in range(depth))
        self.proj = nn.Linear(dim, 4)

    def forward(self, latents: torch.Tensor, context: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        img, txt = self.embed(latents), self.embed_txt(context)
        vec = self.time(sigma.reshape(-1, 1).float())
        for i, stage in enumerate(self.stages):
            out = stage(img=img, txt=txt, vec=vec)
            if isinstance(out, tuple):
                txt, img = out
            else:
                img = out
            img = img + 0.01 * i * vec[:, None]  # loop-body work that depends on the block index
        return self.proj(img)


def sample(model: nn.Module, steps: int = 8, seed: int = 0, batch: int = 2) -> torch.Tensor:
    """Euler sampling from sigma 1 to 0 with a fixed text context (8 text and 8 image tokens)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 8, 4, generator=generator)
    context = torch.randn(batch, 8, 6, generator=generator)
    sigmas = torch.linspace(1.0, 0.0, steps + 1)
    with torch.no_grad():
        for i in range(steps):
            x = x + (sigmas[i + 1] - sigmas[i]) * model(x, context, sigmas[i].expand(batch))
    return x


def example() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A small model and one call of it, for ``fastdit inspect --example``."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    inputs = {
        "latents": torch.randn(1, 8, 4, generator=generator),
        "context": torch.randn(1, 8, 6, generator=generator),
        "sigma": torch.full((1,), 0.5),
    }
    return ToyJointDiT().eval(), inputs


class ToyJointPipeline:
    """The sampler as a pipeline-like object ``fastdit.accelerate`` and ``fastdit verify`` take: its modules in
    ``components`` and a call returning 16 x 16 RGB images in [0, 1] (the first three latent channels)."""

    def __init__(self, model: ToyJointDiT) -> None:
        self.transformer = model
        self.components = {"transformer": model}

    def __call__(
        self,
        prompt: str | list[str] | None = None,
        num_inference_steps: int = 8,
        generator: torch.Generator | None = None,
        output_type: str = "np",
    ) -> Any:
        generator = generator or torch.Generator().manual_seed(0)
        x = torch.randn(1, 256, 4, generator=generator)
        context = torch.randn(1, 8, 6, generator=generator)
        sigmas = torch.linspace(1.0, 0.0, num_inference_steps + 1)
        with torch.no_grad():
            for i in range(num_inference_steps):
                x = x + (sigmas[i + 1] - sigmas[i]) * self.transformer(x, context, sigmas[i].expand(1))
        images = torch.sigmoid(x[..., :3]).reshape(1, 16, 16, 3)
        return SimpleNamespace(images=images.numpy())


def adapter() -> Any:
    """The adapter ``fastdit inspect`` proposes for :class:`ToyJointDiT`, with the context-parallel plan its report
    points to (split both streams at the root, gather after the output projection, route the inline SDPA)."""
    from fastdit.models.base import BlockGroup, ForwardPattern, ModelAdapter
    from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, SplitInput

    plan = ContextParallelPlan(
        # Joint attention without a mask or positions: any order of the gathered tokens gives the same result.
        inputs={"": {"latents": SplitInput(dim=1), "context": SplitInput(dim=1)}},
        gather={"proj": GatherOutput(dim=1)},
        attention=AttentionRouting(sdpa_calls=("stages.*",)),
    )
    group = BlockGroup(
        path="stages",
        pattern=ForwardPattern.P1,
        hidden_arg="img",
        encoder_arg="txt",
        pattern_overrides={-1: ForwardPattern.P2},
    )
    return ModelAdapter(
        family="toyjointdit",
        transformer_classes=(f"{ToyJointDiT.__module__}.ToyJointDiT",),
        block_groups=(group,),
        timestep_arg="sigma",
        cp_plan=plan,
    )


def pipeline() -> tuple[ToyJointPipeline, dict[str, Any], Any]:
    """For ``fastdit verify tests.cache.toy_joint_dit:pipeline``: the pipeline, its call arguments, its adapter."""
    torch.manual_seed(0)
    return ToyJointPipeline(ToyJointDiT().eval()), {"num_inference_steps": 8}, adapter()
