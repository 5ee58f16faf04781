"""CogVideoX 1.0 / 1.5 (T2V, I2V): ``CogVideoXTransformer3DModel``.

Blocks (diffusers 0.42.1): one list ``transformer_blocks`` of ``CogVideoXBlock``; the model calls each by keyword as
``block(hidden_states=..., encoder_hidden_states=..., temb=..., image_rotary_emb=..., attention_kwargs=...)`` and
the block returns ``(hidden_states, encoder_hidden_states)`` (pattern 0): text and video tokens attend jointly.
"""

from __future__ import annotations

from fastdit.models._lazy import LazyKwargs, tiny_image
from fastdit.models.base import BlockGroup, ForwardPattern, LatentLayout, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, SplitInput
from fastdit.parallel.plan_shapes import streams
from fastdit.parallel.tp_plan import TensorParallelPlan
from fastdit.parallel.tp_shapes import attention, feed_forward, modulation, under

TRANSFORMER = "diffusers.models.transformers.cogvideox_transformer_3d.CogVideoXTransformer3DModel"

_LATENT = 4
_TEXT_DIM = 32
_TEXT_LEN = 16  # max_text_seq_length: the pipeline must pad prompts to exactly this length
_SIZE = 32  # pixels: 4x4 latents, 2x2 tokens per latent frame


def tiny_transformer(
    seed: int = 0,
    *,
    in_channels: int = _LATENT,
    rope: bool = False,
    learned_pos: bool = False,
    patch_size_t: int | None = None,
    ofs: bool = False,
):
    """A 3-block ``CogVideoXTransformer3DModel``.

    Args:
        seed: RNG seed.
        in_channels: Latent channels in (twice ``_LATENT`` for I2V: noise + image latents).
        rope: 3-D rotary embeddings (CogVideoX-5b, 1.5) instead of sin-cos positions (CogVideoX-2b).
        learned_pos: Learned positional embeddings (CogVideoX-5b-I2V).
        patch_size_t: Temporal patch size (2 in CogVideoX 1.5).
        ofs: The 1.5 I2V "ofs" embedding.
    """
    from diffusers import CogVideoXTransformer3DModel

    from fastdit.testing.components.encoders import build

    return build(
        CogVideoXTransformer3DModel,
        seed=seed,
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=in_channels,
        out_channels=_LATENT,
        time_embed_dim=8,
        ofs_embed_dim=8 if ofs else None,
        text_embed_dim=_TEXT_DIM,
        num_layers=3,
        sample_width=_SIZE // 8,
        sample_height=_SIZE // 8,
        sample_frames=9,
        patch_size=2,
        patch_size_t=patch_size_t,
        max_text_seq_length=_TEXT_LEN,
        use_rotary_positional_embeddings=rope,
        use_learned_positional_embeddings=learned_pos,
    )


def tiny_vae(seed: int = 0):
    """An ``AutoencoderKLCogVideoX`` with 8 channels per level (spatial factor 8, temporal factor 4)."""
    from diffusers import AutoencoderKLCogVideoX

    from fastdit.testing.components.encoders import build

    return build(
        AutoencoderKLCogVideoX,
        seed=seed,
        down_block_types=("CogVideoXDownBlock3D",) * 4,
        up_block_types=("CogVideoXUpBlock3D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        latent_channels=_LATENT,
        layers_per_block=1,
        norm_num_groups=2,
        temporal_compression_ratio=4,
    )


def _components(seed: int, transformer, dpm: bool) -> dict:
    from diffusers import CogVideoXDDIMScheduler, CogVideoXDPMScheduler

    from fastdit.testing.components.encoders import t5_encoder

    text_encoder, tokenizer = t5_encoder(d_model=_TEXT_DIM, seed=seed)
    # CogVideoX-2b samples with DDIM, the 5b and 1.5 models with the DPM scheduler (v-prediction, zero terminal SNR).
    scheduler_cls = CogVideoXDPMScheduler if dpm else CogVideoXDDIMScheduler
    scheduler = scheduler_cls(
        prediction_type="v_prediction",
        rescale_betas_zero_snr=True,
        timestep_spacing="trailing",
        beta_schedule="scaled_linear",
    )
    return {
        "transformer": transformer,
        "vae": tiny_vae(seed),
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "scheduler": scheduler,
    }


def tiny_cogvideox_2b(seed: int = 0):
    """A complete tiny CogVideoX-2b-style ``CogVideoXPipeline`` (sin-cos positions, DDIM)."""
    from diffusers import CogVideoXPipeline

    return CogVideoXPipeline(**_components(seed, tiny_transformer(seed), dpm=False))


def tiny_cogvideox_5b(seed: int = 0):
    """A complete tiny CogVideoX-5b-style ``CogVideoXPipeline`` (3-D RoPE, DPM)."""
    from diffusers import CogVideoXPipeline

    return CogVideoXPipeline(**_components(seed, tiny_transformer(seed, rope=True), dpm=True))


def tiny_cogvideox_i2v(seed: int = 0):
    """A complete tiny CogVideoX-5b-I2V-style ``CogVideoXImageToVideoPipeline`` (RoPE + learned positions)."""
    from diffusers import CogVideoXImageToVideoPipeline

    transformer = tiny_transformer(seed, in_channels=2 * _LATENT, rope=True, learned_pos=True)
    return CogVideoXImageToVideoPipeline(**_components(seed, transformer, dpm=True))


def tiny_cogvideox15_i2v(seed: int = 0):
    """A complete tiny CogVideoX-1.5-I2V-style pipeline (temporal patch 2, ofs embedding)."""
    from diffusers import CogVideoXImageToVideoPipeline

    transformer = tiny_transformer(seed, in_channels=2 * _LATENT, rope=True, patch_size_t=2, ofs=True)
    return CogVideoXImageToVideoPipeline(**_components(seed, transformer, dpm=True))


_CALL = {
    "prompt": "a cat holding a sign",
    "negative_prompt": "blue",
    "height": _SIZE,
    "width": _SIZE,
    "num_frames": 5,
    "num_inference_steps": 2,
    "guidance_scale": 6.0,
    "max_sequence_length": _TEXT_LEN,
}

# The patch embedding builds [text, video] and forward splits it into the two streams, so both are split at the
# first block's inputs. The (cos, sin) RoPE tables the pipeline passes in cover video tokens only and are split alike
# at the root. The joint attention concatenates [text, video] per rank, rotates the video part by the local text
# length and has no mask, so any split of either stream is exact. CogVideoXAttnProcessor2_0 calls
# F.scaled_dot_product_attention itself: its module's F is routed.
CP_PLAN = ContextParallelPlan(
    inputs={
        "": {"image_rotary_emb": SplitInput(dim=0, expected_dims=2)},
        "transformer_blocks.0": streams(),
    },
    gather={"proj_out": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(sdpa_modules=("diffusers.models.attention_processor",)),
    notes="Positions added in the patch embedding; the video RoPE (cos, sin) tables split at the root with the tokens.",
)

# Tensor parallelism: one attention over the concatenated [text, video] tokens (attn1 q/k/v column-wise, to_out
# row-wise) and one FFN over both streams. The processor takes head_dim = local inner dim // attn.heads and reshapes
# with attn.heads, so `heads` is divided. The QK-norms are LayerNorm over head_dim (per head): replicated. The AdaLN
# modulation of norm1 / norm2 (time_embed_dim -> 6 dim, per block, ~14 % of the 5B's weights) is split with a
# gathered output. Replicated: patch and time embeddings, norm_final, norm_out, proj_out.
TP_PLAN = TensorParallelPlan(
    layers=under(
        "transformer_blocks.*",
        {**attention("attn1"), **feed_forward("ff"), **modulation("norm1.linear", "norm2.linear")},
    ),
    divide=("transformer_blocks.*.attn1.heads",),
    notes="Joint attention and FFN split; per-block AdaLN modulation (6 dim) split with a gathered output; "
    "QK-norms per head replicated.",
)

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "transformer_blocks": (("attn1.to_q", "attn1.to_k", "attn1.to_v"),),
}

ADAPTER = register(
    ModelAdapter(
        family="cogvideox",
        fused_projections=FUSED_PROJECTIONS,
        # hidden_states is (batch, frames, channels, height, width). Its image-to-video models append their conditioning
        # channels (the first frame's latents, with a mask for some), which stay put from step to step: the filter over
        # all channels still follows the noisy ones, diluted.
        latent=LatentLayout(channel_dim=2),
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="transformer_blocks", pattern=ForwardPattern.P0),),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        tiny_pipelines=(
            TinyPipeline(name="t2v-2b", build=tiny_cogvideox_2b, call_kwargs=_CALL),
            TinyPipeline(name="t2v-5b", build=tiny_cogvideox_5b, call_kwargs=_CALL),
            TinyPipeline(
                name="i2v", build=tiny_cogvideox_i2v, call_kwargs=LazyKwargs({**_CALL, "image": tiny_image(_SIZE)})
            ),
            TinyPipeline(
                name="1.5-i2v",
                build=tiny_cogvideox15_i2v,
                call_kwargs=LazyKwargs({**_CALL, "image": tiny_image(_SIZE)}),
            ),
        ),
        presets=(
            ModelPreset(
                name="cogvideox-2b",
                pipeline_class="diffusers.CogVideoXPipeline",
                hub_id="THUDM/CogVideoX-2b",
                defaults={
                    "num_inference_steps": 50,
                    "guidance_scale": 6.0,
                    "height": 480,
                    "width": 720,
                    "num_frames": 49,
                },
            ),
            ModelPreset(
                name="cogvideox-5b",
                pipeline_class="diffusers.CogVideoXPipeline",
                hub_id="THUDM/CogVideoX-5b",
                defaults={
                    "num_inference_steps": 50,
                    "guidance_scale": 6.0,
                    "height": 480,
                    "width": 720,
                    "num_frames": 49,
                },
            ),
            ModelPreset(
                name="cogvideox-5b-i2v",
                pipeline_class="diffusers.CogVideoXImageToVideoPipeline",
                hub_id="THUDM/CogVideoX-5b-I2V",
                defaults={
                    "num_inference_steps": 50,
                    "guidance_scale": 6.0,
                    "height": 480,
                    "width": 720,
                    "num_frames": 49,
                },
            ),
            ModelPreset(
                name="cogvideox1.5-5b",
                pipeline_class="diffusers.CogVideoXPipeline",
                hub_id="THUDM/CogVideoX1.5-5B",
                defaults={
                    "num_inference_steps": 50,
                    "guidance_scale": 6.0,
                    "height": 768,
                    "width": 1360,
                    "num_frames": 81,
                },
            ),
            ModelPreset(
                name="cogvideox1.5-5b-i2v",
                pipeline_class="diffusers.CogVideoXImageToVideoPipeline",
                hub_id="THUDM/CogVideoX1.5-5B-I2V",
                defaults={
                    "num_inference_steps": 50,
                    "guidance_scale": 6.0,
                    "height": 768,
                    "width": 1360,
                    "num_frames": 81,
                },
            ),
        ),
        notes=(
            "Text and video tokens are concatenated by the patch embedding and split again before the blocks; "
            "sin-cos or learned positions are added there and 3-D RoPE is computed by the pipeline and passed in "
            "(image_rotary_emb covers video tokens only). CFG is batched (one call per step, batch 2)."
        ),
    )
)
