"""HunyuanVideo (T2V, I2V, SkyReels-V1 I2V, FramePack): ``HunyuanVideoTransformer3DModel`` and
``HunyuanVideoFramepackTransformer3DModel``.

Blocks (diffusers 0.42.1): dual-stream ``transformer_blocks`` then single-stream ``single_transformer_blocks``. The
model calls both positionally as ``block(hidden_states, encoder_hidden_states, temb, attention_mask,
image_rotary_emb, token_replace_emb, first_frame_num_tokens)``; every block returns ``(hidden_states,
encoder_hidden_states)`` (pattern 0) — the single-stream blocks concatenate the two streams inside and split them
again before returning. With ``image_condition_type="token_replace"`` (HunyuanVideo-I2V) the lists hold the
``HunyuanVideoTokenReplace*`` block classes, which take the same arguments and return the same pair. The FramePack
transformer reuses the plain block classes in the same two lists (called with ``attention_mask`` and
``image_rotary_emb`` only).
"""

from __future__ import annotations

from fastdit.models._lazy import Deferred, LazyKwargs, tiny_image
from fastdit.models.base import BlockGroup, ForwardPattern, LatentLayout, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, LeadingCount, SplitInput
from fastdit.parallel.plan_shapes import streams
from fastdit.parallel.tp_plan import Colwise, Rowwise, TensorParallelPlan
from fastdit.parallel.tp_shapes import feed_forward, joint_attention, modulation, under

TRANSFORMER = "diffusers.models.transformers.transformer_hunyuan_video.HunyuanVideoTransformer3DModel"
FRAMEPACK_TRANSFORMER = (
    "diffusers.models.transformers.transformer_hunyuan_video_framepack.HunyuanVideoFramepackTransformer3DModel"
)

_LATENT = 4  # latent channels of the tiny VAE
_TEXT_DIM = 32  # hidden size of the tiny Llama / LLaVA text model
_POOLED_DIM = 32  # hidden size of the tiny CLIP text model (its pooled output)

# Short Llama-3 chat templates: the real ones are ~100 tokens of system prompt. ``crop_start`` is the number of
# tokens before the user prompt under the tiny Llama tokenizer (measured), as the real templates state theirs.
_T2V_TEMPLATE = {
    "template": (
        "<|start_header_id|>system<|end_header_id|>\n\nDescribe the video.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|>"
    ),
    "crop_start": 26,
}


# I2V: the ``<image>`` token (position 4) is expanded into the image features before the text model runs.
def _i2v_template() -> dict:
    # The feature count is the tiny LLaVA's, so the template is built when a call reads it.
    from fastdit.testing.components.llava import NUM_IMAGE_TOKENS

    return {
        "template": (
            "<|start_header_id|>system<|end_header_id|>\n\n<image>\nDescribe the video.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n"
        ),
        "crop_start": 28,
        "image_emb_start": 4,
        "image_emb_end": 4 + NUM_IMAGE_TOKENS,
        "image_emb_len": NUM_IMAGE_TOKENS,
    }


# Block layout shared by the plain and the FramePack transformer: 1 dual + 2 single blocks of 2 heads x 16, patch 2x2,
# one frame per token.
_TRANSFORMER_LAYOUT = {
    "out_channels": _LATENT,
    "num_attention_heads": 2,
    "attention_head_dim": 16,
    "num_layers": 1,
    "num_single_layers": 2,
    "num_refiner_layers": 1,
    "patch_size": 2,
    "patch_size_t": 1,
    "text_embed_dim": _TEXT_DIM,
    "pooled_projection_dim": _POOLED_DIM,
    "rope_axes_dim": (4, 6, 6),
}


def tiny_transformer(
    seed: int = 0, *, in_channels: int = _LATENT, guidance: bool = True, image_condition_type: str | None = None
):
    """A ``HunyuanVideoTransformer3DModel`` in the tiny block layout (1 dual + 2 single blocks)."""
    from diffusers import HunyuanVideoTransformer3DModel

    from fastdit.testing.components.encoders import build

    return build(
        HunyuanVideoTransformer3DModel,
        seed=seed,
        in_channels=in_channels,
        guidance_embeds=guidance,
        image_condition_type=image_condition_type,
        **_TRANSFORMER_LAYOUT,
    )


def _components(seed: int, transformer, *, llava: bool = False) -> dict:
    from diffusers import FlowMatchEulerDiscreteScheduler

    from fastdit.testing.components.autoencoder_kl_hunyuan_video import autoencoder_kl_hunyuan_video
    from fastdit.testing.components.encoders import clip_text_model
    from fastdit.testing.components.llama import llama_model
    from fastdit.testing.components.llava import llava_model

    text_encoder, tokenizer = (llava_model if llava else llama_model)(hidden_size=_TEXT_DIM, seed=seed)
    text_encoder_2, tokenizer_2 = clip_text_model(hidden_size=_POOLED_DIM, seed=seed + 1)
    return {
        "transformer": transformer,
        "vae": autoencoder_kl_hunyuan_video(latent_channels=_LATENT, seed=seed),
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "text_encoder_2": text_encoder_2,
        "tokenizer_2": tokenizer_2,
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=7.0),
    }


def tiny_hunyuan_video(seed: int = 0):
    """A complete tiny ``HunyuanVideoPipeline`` (Llama + CLIP text encoders, guidance-distilled transformer)."""
    from diffusers import HunyuanVideoPipeline

    return HunyuanVideoPipeline(**_components(seed, tiny_transformer(seed)))


def tiny_hunyuan_video_i2v(seed: int = 0, *, image_condition_type: str = "latent_concat"):
    """A complete tiny ``HunyuanVideoImageToVideoPipeline`` (LLaVA text encoder sees the image too)."""
    from diffusers import HunyuanVideoImageToVideoPipeline

    from fastdit.testing.components.llava import llava_image_processor

    # latent_concat: noise + image latents + a mask channel; token_replace: the first frame is replaced by the image.
    in_channels = 2 * _LATENT + 1 if image_condition_type == "latent_concat" else _LATENT
    transformer = tiny_transformer(
        seed,
        in_channels=in_channels,
        guidance=image_condition_type == "token_replace",
        image_condition_type=image_condition_type,
    )
    return HunyuanVideoImageToVideoPipeline(
        image_processor=llava_image_processor(), **_components(seed, transformer, llava=True)
    )


def tiny_hunyuan_video_i2v_token_replace(seed: int = 0):
    """The I2V pipeline with a ``token_replace`` transformer (HunyuanVideo-I2V's second release)."""
    return tiny_hunyuan_video_i2v(seed, image_condition_type="token_replace")


def tiny_skyreels_v1_i2v(seed: int = 0):
    """A complete tiny ``HunyuanSkyreelsImageToVideoPipeline`` (image latents concatenated on channels, true CFG)."""
    from diffusers import HunyuanSkyreelsImageToVideoPipeline

    return HunyuanSkyreelsImageToVideoPipeline(**_components(seed, tiny_transformer(seed, in_channels=2 * _LATENT)))


def tiny_framepack_transformer(seed: int = 0):
    """A ``HunyuanVideoFramepackTransformer3DModel`` in the tiny block layout (SigLIP image tokens, history)."""
    from diffusers import HunyuanVideoFramepackTransformer3DModel

    from fastdit.testing.components.encoders import build

    return build(
        HunyuanVideoFramepackTransformer3DModel,
        seed=seed,
        in_channels=_LATENT,
        guidance_embeds=True,
        **_TRANSFORMER_LAYOUT,
        has_image_proj=True,
        image_proj_dim=16,  # the tiny SigLIP's hidden size
        has_clean_x_embedder=True,
    )


def tiny_framepack(seed: int = 0):
    """A complete tiny ``HunyuanVideoFramepackPipeline`` (next-frame-section prediction from an image)."""
    from diffusers import HunyuanVideoFramepackPipeline

    from fastdit.testing.components.siglip import siglip_vision_model

    image_encoder, feature_extractor = siglip_vision_model(hidden_size=16, seed=seed)
    return HunyuanVideoFramepackPipeline(
        image_encoder=image_encoder,
        feature_extractor=feature_extractor,
        **_components(seed, tiny_framepack_transformer(seed)),
    )


_CALL = {
    "prompt": "a cat holding a sign",
    "height": 32,
    "width": 32,
    "num_frames": 5,
    "num_inference_steps": 2,
    "guidance_scale": 6.0,
    "max_sequence_length": 16,
    "prompt_template": _T2V_TEMPLATE,
}
# The latent_concat I2V pipeline drops the first 4 decoded frames: 9 frames in, 5 out.
_I2V_CALL = {**_CALL, "image": tiny_image(), "num_frames": 9, "prompt_template": Deferred(_i2v_template)}

# Context parallelism (checked on diffusers 0.42.1), one plan for both transformer classes and every variant:
# * forward patchifies the latents (FramePack also packs the 4x/2x/1x history tokens before them) and runs the text
#   token refiner before the blocks, so the video and text tokens are split at the first dual-stream block; every
#   block returns both streams, so the shards flow through all dual- and single-stream blocks (the single-stream
#   blocks concatenate the local [video, text] shards and split them again by the local text length).
# * RoPE: the blocks' (cos, sin) argument (transformer_blocks: freqs_cis, single_transformer_blocks:
#   image_rotary_emb; passed positionally) is split on dim 0 at every block like the video tokens. Not `rope`'s
#   output: FramePack calls `rope` once per history scale and reshapes and concatenates the tables afterwards.
# * The key-padding mask (B, 1, 1, S_video + S_text) is built over the global [video | text] sequence (FramePack
#   builds none for one sample): mask_segments reorders it into shard order.
# * token_replace I2V: forward passes first_frame_num_tokens, the global count of leading first-frame video tokens,
#   as the blocks' 7th positional argument (named num_tokens in the token-replace blocks, taken by *args in the
#   plain ones, which ignore it); LeadingCount gives each rank its share of those tokens.
# * Gathered at the last single-stream block's video output (element 0 of its (video, text) tuple), because
#   FramePack keeps hidden_states[:, -original_context_length:] between that block and norm_out; norm_out and
#   proj_out then run on the whole sequence (the text shard is dropped by forward anyway).
# * The token refiner in context_embedder runs on the whole, replicated text with diffusers' AttnProcessor2_0
#   (direct SDPA), so it stays local.
_FIRST_FRAME_TOKENS = LeadingCount(of="hidden_states", position=6)
CP_PLAN = ContextParallelPlan(
    inputs={
        "transformer_blocks.0": streams(),
        "transformer_blocks.*": {
            "freqs_cis": SplitInput(dim=0, expected_dims=2),
            "num_tokens": _FIRST_FRAME_TOKENS,
        },
        "single_transformer_blocks.*": {
            "image_rotary_emb": SplitInput(dim=0, expected_dims=2),
            "num_tokens": _FIRST_FRAME_TOKENS,
        },
    },
    gather={"single_transformer_blocks.-1": GatherOutput(dim=1, expected_dims=3, index=0)},
    attention=AttentionRouting(
        modules=("diffusers.models.transformers.transformer_hunyuan_video",),
        mask_segments=("hidden_states", "encoder_hidden_states"),
        local=("context_embedder",),
    ),
    notes=(
        "Video and text tokens split at transformer_blocks.0 (joint mask reordered by segments); the blocks' RoPE "
        "tables split on dim 0 at every block (FramePack builds them per history scale); token_replace I2V's "
        "first-frame token count narrowed per rank (LeadingCount); video gathered at the last single-stream block "
        "(before FramePack drops the history tokens); the text token refiner in context_embedder runs locally."
    ),
)

# Tensor parallelism, one plan for both transformer classes and the token-replace block classes (same module names):
# * dual-stream blocks: joint attention (video and text q/k/v column-wise, both outputs row-wise) and both FFNs;
#   the processor reshapes with unflatten(2, (attn.heads, -1)), so `heads` is divided. QK-norms are RMSNorm over
#   head_dim (per head): replicated.
# * single-stream blocks: q/k/v and proj_mlp column-wise; the attention has no to_out (pre_only), proj_out reads
#   cat([attn_out, gelu(proj_mlp)]) on the feature dim, so it is row-wise with one segment per stream.
# * AdaLN modulation (norm1 / norm1_context: dim -> 6 dim, single norm: dim -> 3 dim) is per block and large: split
#   with a gathered output. The token-replace norms call the same linear twice (t and t=0), each call gathered.
# * Replicated: the text token refiner in context_embedder (2 small blocks on the text only, run locally under CP
#   too), embedders, FramePack's image projection and history embedders, norm_out, proj_out.
_DUAL_BLOCK = {
    **joint_attention("attn"),
    **feed_forward("ff"),
    **feed_forward("ff_context"),
    **modulation("norm1.linear", "norm1_context.linear"),
}
_SINGLE_BLOCK = {
    "attn.to_q": Colwise(),
    "attn.to_k": Colwise(),
    "attn.to_v": Colwise(),
    "proj_mlp": Colwise(),
    "proj_out": Rowwise(segments=("attn.inner_dim", "proj_mlp.out_features")),
    **modulation("norm.linear"),
}
TP_PLAN = TensorParallelPlan(
    layers={**under("transformer_blocks.*", _DUAL_BLOCK), **under("single_transformer_blocks.*", _SINGLE_BLOCK)},
    divide=("transformer_blocks.*.attn.heads", "single_transformer_blocks.*.attn.heads"),
    notes="Joint attention, FFNs and the single blocks' [attn | mlp] proj_out split; per-block AdaLN modulation "
    "split with a gathered output; QK-norms per head and the text token refiner replicated.",
)

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "transformer_blocks": (
        ("attn.to_q", "attn.to_k", "attn.to_v"),
        ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    ),
    "single_transformer_blocks": (("attn.to_q", "attn.to_k", "attn.to_v"),),
}

ADAPTER = register(
    ModelAdapter(
        family="hunyuan_video",
        fused_projections=FUSED_PROJECTIONS,
        # hidden_states is (batch, channels, frames, height, width). Its image-to-video models append their conditioning
        # channels (the first frame's latents, with a mask for some), which stay put from step to step: the filter over
        # all channels still follows the noisy ones, diluted.
        latent=LatentLayout(),
        # CFG as two unannounced calls per step, each output used only after both: paired by timestep.
        cfg_pairs_by_timestep=True,
        transformer_classes=(TRANSFORMER, FRAMEPACK_TRANSFORMER),
        block_groups=(
            BlockGroup(path="transformer_blocks", pattern=ForwardPattern.P0),
            BlockGroup(path="single_transformer_blocks", pattern=ForwardPattern.P0),
        ),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        tiny_pipelines=(
            TinyPipeline(name="t2v", build=tiny_hunyuan_video, call_kwargs=_CALL),
            TinyPipeline(
                name="i2v", build=tiny_hunyuan_video_i2v, call_kwargs=LazyKwargs({**_I2V_CALL, "guidance_scale": 1.0})
            ),
            TinyPipeline(
                name="i2v-token-replace",
                build=tiny_hunyuan_video_i2v_token_replace,
                call_kwargs=LazyKwargs({**_I2V_CALL, "num_frames": 5}),
            ),
            TinyPipeline(
                name="skyreels-v1-i2v",
                build=tiny_skyreels_v1_i2v,
                call_kwargs=LazyKwargs(
                    {**_CALL, "image": tiny_image(), "negative_prompt": "blue", "true_cfg_scale": 6.0}
                ),
            ),
            # 5 frames fill one section of the 2-latent-frame window.
            TinyPipeline(
                name="framepack",
                build=tiny_framepack,
                call_kwargs=LazyKwargs({**_CALL, "image": tiny_image(), "latent_window_size": 2}),
            ),
        ),
        presets=(
            ModelPreset(
                name="hunyuan-video",
                pipeline_class="diffusers.HunyuanVideoPipeline",
                hub_id="hunyuanvideo-community/HunyuanVideo",
                defaults={
                    "num_inference_steps": 50,
                    "guidance_scale": 6.0,
                    "height": 720,
                    "width": 1280,
                    "num_frames": 129,
                },
            ),
            ModelPreset(
                name="hunyuan-video-i2v",
                pipeline_class="diffusers.HunyuanVideoImageToVideoPipeline",
                hub_id="hunyuanvideo-community/HunyuanVideo-I2V",
                defaults={
                    "num_inference_steps": 50,
                    "guidance_scale": 1.0,
                    "true_cfg_scale": 1.0,
                    "height": 720,
                    "width": 1280,
                    "num_frames": 129,
                },
            ),
            ModelPreset(
                name="hunyuan-video-framepack",
                pipeline_class="diffusers.HunyuanVideoFramepackPipeline",
                # The transformer checkpoint; the rest of the pipeline comes from hunyuanvideo-community/HunyuanVideo.
                hub_id="lllyasviel/FramePackI2V_HY",
                defaults={
                    "num_inference_steps": 30,
                    "guidance_scale": 9.0,
                    "height": 832,
                    "width": 480,
                    "num_frames": 91,
                },
            ),
            ModelPreset(
                name="skyreels-v1-i2v",
                pipeline_class="diffusers.HunyuanSkyreelsImageToVideoPipeline",
                hub_id="Skywork/SkyReels-V1-Hunyuan-I2V",
                defaults={
                    "num_inference_steps": 30,
                    "guidance_scale": 1.0,
                    "true_cfg_scale": 6.0,
                    "height": 544,
                    "width": 960,
                    "num_frames": 97,
                },
            ),
        ),
        notes=(
            "Text is padded to max_sequence_length and a key-padding mask over [video, text] tokens is built in "
            "forward (under Ulysses it must be reordered with the tokens); RoPE comes from the latent shape. "
            "token_replace I2V modulates the first frame's tokens differently (first_frame_num_tokens is a "
            "position count, narrowed per rank under a sequence split). The I2V and SkyReels pipelines run true CFG "
            "as two calls without cache_context. FramePack prepends clean history tokens (compressed 1x/2x/4x) to the "
            "noisy window and keeps only the window's tokens at the end; each section changes the sequence length. "
            "Context parallel: one plan for every variant (RoPE split per block, the first-frame count per rank, "
            "video gathered at the last single-stream block)."
        ),
    )
)
