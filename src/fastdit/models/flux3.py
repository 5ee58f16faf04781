"""FLUX.3 (text-to-image and reference-image editing): ``Flux3Transformer2DModel``.

Blocks (diffusers 0.42.1): three token modes — the noisy image (``hidden_states``), optional reference-image tokens
(``image_cond_hidden_states``) and the text (``encoder_hidden_states``) — first pass through their own per-mode
blocks (``txt_mode_blocks``, ``mode_blocks.image``, ``mode_blocks.image_cond``), each attending within its mode
only, called positionally with ``(hidden_states, temb_mod, image_rotary_emb)`` and returning the stream alone
(pattern 3). The joint ``single_transformer_blocks`` then take ``(hidden_states=[image, reference],
encoder_hidden_states=text, temb_mod, temb_mod_context, image_rotary_emb)`` by keyword and return
``(encoder_hidden_states, hidden_states)`` (pattern 1).

diffusers 0.42.1 ships the transformer without a pipeline (and the model without ``CacheMixin``, so no
``cache_context``): the tiny pipelines here are a small flow-matching sampler, :class:`Flux3TinySampler`, that calls
the transformer as a FLUX.3 pipeline would (4-axis position ids, true CFG as two calls per step), and there is no
preset to load trained weights with until diffusers has a pipeline class to name.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from fastdit.models._lazy import LazyKwargs, tiny_image
from fastdit.models.base import BlockGroup, ForwardPattern, ModelAdapter, StepInvariant, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, SplitInput
from fastdit.parallel.plan_shapes import TOKENS
from fastdit.parallel.tp_plan import Colwise, Rowwise, TensorParallelPlan
from fastdit.parallel.tp_shapes import attention, under

TRANSFORMER = "diffusers.models.transformers.transformer_flux3.Flux3Transformer2DModel"

_TEXT_DIM = 32
_LATENT_CHANNELS = 16  # 4 VAE channels packed 2x2, as FLUX.2's latents
_PATCH = 4  # the reference image enters as 4x4 RGB patches (a stand-in for its VAE latents)


def tiny_transformer(seed: int = 0, *, flow_map: bool = False):
    """A 4-block ``Flux3Transformer2DModel``: one block per mode list, one joint block."""
    from diffusers.models.transformers.transformer_flux3 import Flux3Transformer2DModel

    from fastdit.testing.components.encoders import build

    return build(
        Flux3Transformer2DModel,
        seed=seed,
        in_channels=_LATENT_CHANNELS,
        cond_in_channels=3 * _PATCH * _PATCH,
        num_layers=1,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=_TEXT_DIM,
        timestep_channels=32,
        mlp_ratio=2.0,
        axes_dims_rope=(4, 4, 4, 4),
        flow_map=flow_map,
    )


def _grid_ids(t: int, height: int, width: int) -> torch.Tensor:
    """``(t, h, w, l)`` position ids of a ``height x width`` token grid at time index ``t`` (FLUX.2's layout)."""
    h, w = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    ids = torch.zeros(height * width, 4)
    ids[:, 0], ids[:, 1], ids[:, 2] = t, h.flatten(), w.flatten()
    return ids


class Flux3TinySampler:
    """A flow-matching Euler sampler around a ``Flux3Transformer2DModel``, shaped like a diffusers pipeline.

    The prompt is embedded by a fixed random table over its bytes (no text encoder: the transformer is what is
    accelerated); the image tokens are one per 8 x 8 pixels, decoded for display as the sigmoid of their first three
    channels over those pixels. An ``image`` adds reference tokens (its 4 x 4 RGB patches, at time index 1). With
    ``guidance_scale > 1`` each step calls the transformer for the prompt, then for ``negative_prompt``, with the
    same timestep. The latents stay float32 between steps; ``to`` moves or casts the transformer.
    """

    def __init__(self, transformer: torch.nn.Module, seed: int = 0) -> None:
        self.transformer = transformer
        self.components = {"transformer": transformer}
        generator = torch.Generator().manual_seed(seed)
        self._byte_table = torch.randn(256, transformer.config.joint_attention_dim, generator=generator)

    def set_progress_bar_config(self, **kwargs: Any) -> None:
        """Accepted for pipeline compatibility (the sampler draws no progress bar)."""

    def to(self, *args: Any, **kwargs: Any) -> Flux3TinySampler:
        """Move (or cast) the transformer, as ``DiffusionPipeline.to`` does; the sampler follows its device."""
        self.transformer.to(*args, **kwargs)
        return self

    @property
    def _where(self) -> dict[str, Any]:
        return {"device": self.transformer.device, "dtype": self.transformer.dtype}

    def _encode(self, prompt: str, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        codes = list(prompt.encode()[:length]) + [0] * max(0, length - len(prompt.encode()))
        ids = torch.zeros(length, 4)
        ids[:, 3] = torch.arange(length)  # text tokens are told apart by the last axis
        return self._byte_table[torch.tensor(codes)][None].to(**self._where), ids.to(self.transformer.device)

    def _reference(self, image: Any) -> tuple[torch.Tensor, torch.Tensor]:
        import numpy as np

        pixels = torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.float32) / 127.5 - 1.0)
        h, w = pixels.shape[0] // _PATCH, pixels.shape[1] // _PATCH
        patches = pixels[: h * _PATCH, : w * _PATCH].reshape(h, _PATCH, w, _PATCH, 3).permute(0, 2, 1, 3, 4)
        return patches.reshape(1, h * w, -1).to(**self._where), _grid_ids(1, h, w).to(self.transformer.device)

    def _velocity(self, latents: torch.Tensor, sigma: torch.Tensor, target: torch.Tensor, call: dict) -> torch.Tensor:
        # The latents stay float32 between steps (as diffusers' pipelines keep them); each call gets the model's dtype.
        where = self._where
        sigma, target = sigma.to(**where), target.to(**where)
        flow_map = {"target_timestep": target} if self.transformer.config.flow_map else {}
        out = self.transformer(hidden_states=latents.to(**where), timestep=sigma, **flow_map, **call, return_dict=False)
        return out[0].float()

    @torch.no_grad()
    def __call__(
        self,
        prompt: str = "",
        negative_prompt: str = "",
        height: int = 32,
        width: int = 32,
        num_inference_steps: int = 2,
        guidance_scale: float = 4.0,
        image: Any = None,
        max_sequence_length: int = 8,
        generator: torch.Generator | None = None,
        output_type: str = "np",
    ) -> SimpleNamespace:
        h, w = height // 8, width // 8
        latents = torch.randn(1, h * w, _LATENT_CHANNELS, generator=generator).to(self.transformer.device)
        shared: dict[str, Any] = {"img_ids": _grid_ids(0, h, w).to(self.transformer.device)}
        if image is not None:
            shared["image_cond_hidden_states"], shared["image_cond_ids"] = self._reference(image)
        branches = [prompt] + ([negative_prompt] if guidance_scale > 1 else [])
        calls = []
        for text in branches:
            embeds, txt_ids = self._encode(text, max_sequence_length)
            calls.append({**shared, "encoder_hidden_states": embeds, "txt_ids": txt_ids})
        sigmas = torch.linspace(1.0, 0.0, num_inference_steps + 1, device=self.transformer.device)
        for i in range(num_inference_steps):
            sigma, target = sigmas[i].expand(1), sigmas[i + 1].expand(1)
            velocities = [self._velocity(latents, sigma, target, call) for call in calls]
            if len(velocities) == 2:  # true CFG: neither branch's output is used before the other call
                velocities[0] = velocities[1] + guidance_scale * (velocities[0] - velocities[1])
            latents = latents + (sigmas[i + 1] - sigmas[i]) * velocities[0]
        grid = latents.reshape(1, h, w, _LATENT_CHANNELS)
        # Decoded as an image of the requested size: each token's 8 x 8 pixels (SSIM needs more than a few pixels).
        pixels = torch.sigmoid(grid[..., :3]).repeat_interleave(8, dim=1).repeat_interleave(8, dim=2)
        images = grid if output_type == "latent" else pixels
        return SimpleNamespace(images=images.float().cpu().numpy())


def tiny_flux3(seed: int = 0) -> Flux3TinySampler:
    """The tiny FLUX.3 sampler (base model: true CFG)."""
    return Flux3TinySampler(tiny_transformer(seed), seed=seed + 1)


def tiny_flux3_flow_map(seed: int = 0) -> Flux3TinySampler:
    """The tiny FLUX.3 sampler around a flow-map (step-distilled) transformer: it also embeds the target timestep."""
    return Flux3TinySampler(tiny_transformer(seed, flow_map=True), seed=seed + 1)


# Context parallelism: the forward is "embed each mode, per-mode blocks, concatenate [text, image, reference], joint
# blocks, keep the image tokens, project out", token-wise outside attention (the per-token modulation is expanded
# to each stream's local length), so the root inputs are split: every stream on its token dim and its position ids
# (S, 4) on theirs, so the RoPE forward computes is that of each rank's tokens. Per-mode attention then runs over
# one stream's shards, the joint attention over [text_r, image_r, reference_r] (no mask: the order of the gathered
# tokens does not matter); forward keeps the first image_seq_len tokens of the content stream, read from the local
# image stream, so each rank keeps its own image shard for proj_out.
CP_PLAN = ContextParallelPlan(
    inputs={
        "": {
            "hidden_states": TOKENS,
            "encoder_hidden_states": TOKENS,
            "image_cond_hidden_states": TOKENS,
            "img_ids": SplitInput(dim=-2),
            "txt_ids": SplitInput(dim=-2),
            "image_cond_ids": SplitInput(dim=-2),
        }
    },
    gather={"proj_out": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(modules=("diffusers.models.transformers.transformer_flux3",)),
    notes="Every mode's stream and position ids split at the root: RoPE of each rank's own tokens, no mask.",
)

# Tensor parallelism: every block (per-mode and joint) is one attention and one SwiGLU FFN on the same modulated
# input: q/k/v column-wise, to_out row-wise, the fused [gate | up] input of the FFN split per half. The processor
# unflattens q/k/v by attn.heads, so heads are divided; QK-norms are per head (replicated). The modulation heads
# are model-level linears shared by every block (per token, but the same for all blocks): kept whole.
_BLOCK = {**attention("attn"), "ff.linear_in": Colwise(segments=(1, 1)), "ff.linear_out": Rowwise()}
_BLOCK_LISTS = ("txt_mode_blocks.*", "mode_blocks.image.*", "mode_blocks.image_cond.*", "single_transformer_blocks.*")
TP_PLAN = TensorParallelPlan(
    layers={path: style for blocks in _BLOCK_LISTS for path, style in under(blocks, _BLOCK).items()},
    divide=tuple(f"{blocks}.attn.heads" for blocks in _BLOCK_LISTS),
    notes="Attention by heads and the SwiGLU FFN per half in every block list; shared modulation heads whole.",
)

# A pipeline passes the same position ids and prompt embeddings at every step (one set per CFG branch, made before
# the loop). forward calls `pos_embed` directly on each of txt_ids, img_ids and image_cond_ids, so it is keyed on its
# own argument (the three calls on three tensors; under context parallelism the split shards are new every call and
# it computes). The text projection reads encoder_hidden_states directly: keyed on the transformer's argument.
# Not the reference-image projection (x_embedders.image_cond): pure too, but not called without a reference image.
STEP_INVARIANT = (
    StepInvariant("pos_embed"),
    StepInvariant("context_embedder", inputs=("encoder_hidden_states",)),
)

_CALL = {
    "prompt": "a cat holding a sign",
    "negative_prompt": "blurry",
    "height": 32,
    "width": 32,
    "num_inference_steps": 2,
    "guidance_scale": 4.0,
}

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "mode_blocks.image": (("attn.to_q", "attn.to_k", "attn.to_v", "ff.linear_in"),),
    "single_transformer_blocks": (("attn.to_q", "attn.to_k", "attn.to_v", "ff.linear_in"),),
}

ADAPTER = register(
    ModelAdapter(
        family="flux3",
        fused_projections=FUSED_PROJECTIONS,
        transformer_classes=(TRANSFORMER,),
        # The text and reference-image mode blocks are left out of the cache's block lists: they see timestep 0
        # on every step (their output is the same each step), so a front block among them would measure no change
        # and cache every step. They run every step as loop-body work; the cache measures the image mode blocks.
        block_groups=(
            BlockGroup(path="mode_blocks.image", pattern=ForwardPattern.P3),
            BlockGroup(path="single_transformer_blocks", pattern=ForwardPattern.P1),
        ),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        step_invariant=STEP_INVARIANT,
        cfg_pairs_by_timestep=True,
        tiny_pipelines=(
            TinyPipeline(name="t2i", build=tiny_flux3, call_kwargs=_CALL),
            TinyPipeline(name="edit", build=tiny_flux3, call_kwargs=LazyKwargs({**_CALL, "image": tiny_image()})),
            TinyPipeline(name="flow-map", build=tiny_flux3_flow_map, call_kwargs=_CALL),
        ),
        notes=(
            "diffusers 0.42.1 has the transformer but no FLUX.3 pipeline (and no CacheMixin on the model): the tiny "
            "pipelines are a flow-matching sampler calling it as a pipeline would, CFG as two calls per step paired "
            "by timestep, and there is no preset until diffusers names a pipeline class. Per-token modulation "
            "computed once per call (timestep for the image, 0 for the text and reference tokens; a flow-map model "
            "adds the target timestep to all). The text and reference mode blocks are not cached block lists: "
            "their inputs do not change between steps. 4-axis RoPE from `img_ids`/`txt_ids`/`image_cond_ids`; "
            "reference tokens join the joint blocks after the image tokens and produce no output. No attention mask."
            " No spectral signal: the latent arrives packed into a token sequence (batch, tokens, channels): no grid "
            "to filter."
        ),
    )
)
