"""Wan 2.1 / 2.2 (T2V, I2V, the two-expert A14B models): ``WanTransformer3DModel``.

Blocks (diffusers 0.42.1): one list ``blocks`` of ``WanTransformerBlock``; the model calls each positionally as
``block(hidden_states, encoder_hidden_states, timestep_proj, rotary_emb)`` and the block returns ``hidden_states``
alone (pattern 2). Wan 2.2 A14B pipelines hold two transformers of this class, ``transformer`` (high noise) and
``transformer_2`` (low noise), switched at ``boundary_ratio``; both are served by this adapter.
"""

from __future__ import annotations

from fastdit.models._lazy import LazyKwargs, tiny_image
from fastdit.models.base import BlockGroup, ForwardPattern, LatentLayout, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan_shapes import wan_blocks_plan
from fastdit.parallel.tp_shapes import wan_tp_plan

TRANSFORMER = "diffusers.models.transformers.transformer_wan.WanTransformer3DModel"

# Latent channels of the tiny VAE (the Wan 2.1 VAE's 16, so its default latent statistics apply).
_Z_DIM = 16
_TEXT_DIM = 32


def tiny_transformer(seed: int = 0, *, in_channels: int = _Z_DIM, image_dim: int | None = None):
    """A 3-block ``WanTransformer3DModel``; ``in_channels=36`` and ``image_dim`` give the Wan 2.1 I2V layout."""
    from diffusers import WanTransformer3DModel

    from fastdit.testing.components.encoders import build

    return build(
        WanTransformer3DModel,
        seed=seed,
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=in_channels,
        out_channels=_Z_DIM,
        text_dim=_TEXT_DIM,
        freq_dim=32,
        ffn_dim=32,
        num_layers=3,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
        image_dim=image_dim,
    )


def _common(seed: int) -> dict:
    from diffusers import FlowMatchEulerDiscreteScheduler

    from fastdit.testing.components.autoencoder_kl_wan import wan_components

    return wan_components(text_dim=_TEXT_DIM, scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0), seed=seed)


def tiny_wan_t2v(seed: int = 0):
    """A complete tiny Wan 2.1 ``WanPipeline`` (text to video)."""
    from diffusers import WanPipeline

    return WanPipeline(transformer=tiny_transformer(seed), **_common(seed))


def tiny_wan22_t2v(seed: int = 0):
    """A complete tiny Wan 2.2 A14B ``WanPipeline``: a high-noise and a low-noise expert switched at the boundary."""
    from diffusers import WanPipeline

    return WanPipeline(
        transformer=tiny_transformer(seed),
        transformer_2=tiny_transformer(seed + 1),
        # With shift 5 and 4 steps the timesteps are about 1000, 910, 717, 24: two steps per expert.
        boundary_ratio=0.875,
        **_common(seed),
    )


def tiny_wan_i2v(seed: int = 0):
    """A complete tiny Wan 2.1 ``WanImageToVideoPipeline`` (CLIP image features + first-frame latents)."""
    from diffusers import WanImageToVideoPipeline

    from fastdit.testing.components.clip_vision import clip_vision_model

    image_encoder, image_processor = clip_vision_model(hidden_size=8, seed=seed)
    return WanImageToVideoPipeline(
        # 16 noise + 4 mask + 16 first-frame latent channels.
        transformer=tiny_transformer(seed, in_channels=2 * _Z_DIM + 4, image_dim=8),
        image_encoder=image_encoder,
        image_processor=image_processor,
        **_common(seed),
    )


def tiny_wan22_i2v(seed: int = 0):
    """A complete tiny Wan 2.2 A14B ``WanImageToVideoPipeline``: two experts and no CLIP image encoder."""
    from diffusers import WanImageToVideoPipeline

    channels = 2 * _Z_DIM + 4
    return WanImageToVideoPipeline(
        transformer=tiny_transformer(seed, in_channels=channels),
        transformer_2=tiny_transformer(seed + 1, in_channels=channels),
        boundary_ratio=0.9,  # two of the 4 tiny steps per expert, as above
        **_common(seed),
    )


def tiny_wan22_ti2v(seed: int = 0):
    """A complete tiny Wan 2.2 TI2V-5B ``WanPipeline`` (text-to-video mode): per-token timesteps, 16x VAE."""
    from diffusers import WanPipeline

    from fastdit.testing.components.autoencoder_kl_wan import autoencoder_kl_wan

    components = _common(seed)
    components["vae"] = autoencoder_kl_wan(wan22=True, seed=seed)
    # expand_timesteps: the transformer receives one timestep per latent token, shape (batch, tokens).
    return WanPipeline(transformer=tiny_transformer(seed), expand_timesteps=True, **components)


def _preset(
    name: str, pipeline: str, hub_id: str, steps: int, guidance: float, size: tuple[int, int], frames: int, **extra
) -> ModelPreset:
    height, width = size
    defaults = {"num_inference_steps": steps, "guidance_scale": guidance, "height": height, "width": width}
    return ModelPreset(
        name=name,
        pipeline_class=f"diffusers.{pipeline}",
        hub_id=hub_id,
        defaults={**defaults, "num_frames": frames, **extra},
    )


# Context parallelism: the sequence only exists after patch_embedding + flatten inside forward, so the image tokens are
# split at the first block (called positionally). RoPE comes from the module `rope`, which returns (cos, sin) tables
# (1, S, 1, D) for the full latent grid: both are split on dim 1 like the tokens. TI2V-5B's per-token timestep (B, S)
# is split at the root, so the per-token modulation it becomes matches the split tokens (a per-sample timestep is 1-D
# and passes whole). The text is not split: self-attention is context-parallel; cross-attention (the processor passes
# parallel_config=None on purpose) attends from local image tokens to the whole text on every rank.
CP_PLAN = wan_blocks_plan(
    "diffusers.models.transformers.transformer_wan",
    notes="RoPE tables from `rope` split on dim 1; tokens split at blocks.0; text replicated (cross-attention local).",
)

_CALL = {
    "prompt": "a cat holding a sign",
    "negative_prompt": "blue",
    "height": 32,
    "width": 32,
    "num_frames": 5,
    "num_inference_steps": 2,
    "guidance_scale": 5.0,
    "max_sequence_length": 16,
}

TP_PLAN = wan_tp_plan(
    "blocks",
    notes=(
        "self/cross-attention by heads, QK-norms over the inner dim as ShardedNorm (mean square summed "
        "over ranks); FFN split; scale_shift_table modulation whole."
    ),
)

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "blocks": (
        ("attn1.to_q", "attn1.to_k", "attn1.to_v"),
        ("attn2.to_k", "attn2.to_v"),
    ),
}

ADAPTER = register(
    ModelAdapter(
        family="wan",
        fused_projections=FUSED_PROJECTIONS,
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="blocks", pattern=ForwardPattern.P2),),
        # hidden_states is (batch, channels, frames, height, width); the image-to-video models append their
        # conditioning channels, which stay put from step to step (they only dilute the spectral signal).
        latent=LatentLayout(),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        tiny_pipelines=(
            TinyPipeline(name="t2v", build=tiny_wan_t2v, call_kwargs=_CALL),
            TinyPipeline(name="i2v", build=tiny_wan_i2v, call_kwargs=LazyKwargs({**_CALL, "image": tiny_image()})),
            # Two experts: 4 steps so that each runs two of them (cache tests need a step to reuse).
            TinyPipeline(name="wan2.2-t2v", build=tiny_wan22_t2v, call_kwargs={**_CALL, "num_inference_steps": 4}),
            TinyPipeline(
                name="wan2.2-i2v",
                build=tiny_wan22_i2v,
                call_kwargs=LazyKwargs({**_CALL, "num_inference_steps": 4, "image": tiny_image()}),
            ),
            TinyPipeline(name="wan2.2-ti2v", build=tiny_wan22_ti2v, call_kwargs=_CALL),
        ),
        presets=(
            _preset("wan2.1-t2v", "WanPipeline", "Wan-AI/Wan2.1-T2V-14B-Diffusers", 50, 5.0, (480, 832), 81),
            _preset(
                "wan2.1-i2v", "WanImageToVideoPipeline", "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers", 50, 5.0, (480, 832), 81
            ),
            _preset(
                "wan2.2-t2v",
                "WanPipeline",
                "Wan-AI/Wan2.2-T2V-A14B-Diffusers",
                40,
                4.0,
                (720, 1280),
                81,
                guidance_scale_2=3.0,
            ),
            _preset(
                "wan2.2-i2v", "WanImageToVideoPipeline", "Wan-AI/Wan2.2-I2V-A14B-Diffusers", 40, 3.5, (720, 1280), 81
            ),
            _preset("wan2.2-ti2v", "WanPipeline", "Wan-AI/Wan2.2-TI2V-5B-Diffusers", 50, 5.0, (704, 1280), 121),
        ),
        notes=(
            "RoPE is computed from the latent shape inside forward (module `rope`); I2V 2.1 prepends 257 CLIP image "
            "tokens to the text, so the encoder length is odd. Wan 2.2 A14B runs two transformers (one per noise "
            "range): cache state must be kept per transformer. TI2V-5B passes a per-token timestep (B, S) "
            "(temb (B, S, 6, D): split it with the hidden states under context parallelism); in its I2V mode the "
            "first-frame tokens carry timestep 0, so read the step from the largest timestep, not the first."
        ),
    )
)
