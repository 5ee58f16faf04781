"""Cosmos 1.0 / Predict2 / Predict2.5 world models: ``CosmosTransformer3DModel``.

Blocks (diffusers 0.42.1): one list ``transformer_blocks`` of ``CosmosTransformerBlock``; the model calls each
positionally as ``block(hidden_states, encoder_hidden_states, embedded_timestep, temb, image_rotary_emb,
extra_pos_emb, attention_mask, controlnet_residual)`` and the block returns ``hidden_states`` alone (pattern 2): text
enters through cross-attention only. (Blocks built with ``after_proj``, which only the Transfer2.5 ControlNet uses,
return a pair instead.)

The Cosmos pipelines refuse to run without a safety checker (the model licence requires one); the real checker,
``cosmos_guardrail``, downloads guard models, so the tiny pipelines here get a pass-through stand-in.

Context parallelism: the Cosmos processors (``CosmosAttnProcessor2_0``, ``CosmosAttnProcessor2_5``) call their
module's ``dispatch_attention_fn`` without a ``parallel_config``, so the plan routes that module through
``AttentionRouting.dispatch_modules`` (calls made while a marked attention module runs).
"""

from __future__ import annotations

import copy

import torch

from fastdit.models._lazy import LazyKwargs, tiny_image
from fastdit.models.base import BlockGroup, ForwardPattern, LatentLayout, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, SplitInput
from fastdit.parallel.tp_plan import TensorParallelPlan
from fastdit.parallel.tp_shapes import attention, feed_forward, under

TRANSFORMER = "diffusers.models.transformers.transformer_cosmos.CosmosTransformer3DModel"
_MODULE = "diffusers.models.transformers.transformer_cosmos"

# The Wan VAE of Predict2/2.5 (the released Wan 2.1 VAE's channel count, WAN_LATENT_CHANNELS of the tiny one);
# the tiny Cosmos 1.0 VAE uses the same.
_LATENT = 16
_TEXT_DIM = 32
_SIZE = 32

# A Qwen2.5-style chat template accepting string or typed-list message content (the tiny tokenizer ships none).
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}{{ part['text'] }}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class PassThroughSafetyChecker(torch.nn.Module):
    """Accepts every prompt and returns every video unchanged: a stand-in for the guardrail in offline tests."""

    def __init__(self) -> None:
        super().__init__()
        # Pipelines read every component's device and dtype; an empty buffer follows ``.to()`` like real weights.
        self.register_buffer("_anchor", torch.zeros(0), persistent=False)

    @property
    def device(self) -> torch.device:
        """Where the stand-in lives (follows ``.to()``)."""
        return self._anchor.device

    @property
    def dtype(self) -> torch.dtype:
        """The stand-in's dtype (follows ``.to()``)."""
        return self._anchor.dtype

    def check_text_safety(self, prompt: str) -> bool:
        """Every prompt passes."""
        return True

    def check_video_safety(self, frames):
        """Frames pass unchanged."""
        return frames


def tiny_transformer(seed: int = 0, *, in_channels: int = _LATENT, text_dim: int = _TEXT_DIM):
    """A 3-block ``CosmosTransformer3DModel`` (patch 1x2x2, learnable extra positions).

    The released models concatenate a padding-mask channel (``concat_padding_mask=True``), which diffusers resizes
    with torchvision; the tiny model leaves it out so the tests need no torchvision.
    """
    from diffusers import CosmosTransformer3DModel

    from fastdit.testing.components.encoders import build

    return build(
        CosmosTransformer3DModel,
        seed=seed,
        in_channels=in_channels,
        out_channels=_LATENT,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=3,
        mlp_ratio=2,
        text_embed_dim=text_dim,
        adaln_lora_dim=4,
        max_size=(4, 32, 32),
        patch_size=(1, 2, 2),
        rope_scale=(2.0, 1.0, 1.0),
        concat_padding_mask=False,
        extra_pos_embed_type="learnable",
    )


def tiny_cosmos_vae(seed: int = 0):
    """An ``AutoencoderKLCosmos`` (Haar-wavelet patching; space x8, time x4) for Cosmos 1.0."""
    from diffusers import AutoencoderKLCosmos

    from fastdit.testing.components.encoders import build

    return build(
        AutoencoderKLCosmos,
        seed=seed,
        latent_channels=_LATENT,
        encoder_block_out_channels=(8, 8, 8, 8),
        decode_block_out_channels=(8, 8, 8, 8),
        attention_resolutions=(8,),
        resolution=64,
        num_layers=1,
        patch_size=4,
        patch_type="haar",
        scaling_factor=1.0,
        spatial_compression_ratio=8,
        temporal_compression_ratio=4,
    )


def _edm_scheduler():
    from diffusers import EDMEulerScheduler

    return EDMEulerScheduler(
        sigma_min=0.002,
        sigma_max=80,
        sigma_data=0.5,
        sigma_schedule="karras",
        num_train_timesteps=1000,
        prediction_type="epsilon",
        rho=7.0,
        final_sigmas_type="sigma_min",
    )


def _t5_components(seed: int, transformer, vae, scheduler) -> dict:
    from fastdit.testing.components.encoders import t5_encoder

    text_encoder, tokenizer = t5_encoder(d_model=_TEXT_DIM, seed=seed)
    return {
        "transformer": transformer,
        "vae": vae,
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "scheduler": scheduler,
        "safety_checker": PassThroughSafetyChecker(),
    }


def tiny_cosmos_text2world(seed: int = 0):
    """A complete tiny Cosmos 1.0 ``CosmosTextToWorldPipeline`` (EDM sampling, Cosmos VAE)."""
    from diffusers import CosmosTextToWorldPipeline

    return CosmosTextToWorldPipeline(
        **_t5_components(seed, tiny_transformer(seed), tiny_cosmos_vae(seed), _edm_scheduler())
    )


def tiny_cosmos_video2world(seed: int = 0):
    """A complete tiny Cosmos 1.0 ``CosmosVideoToWorldPipeline`` (conditioning frames + a mask channel)."""
    from diffusers import CosmosVideoToWorldPipeline

    transformer = tiny_transformer(seed, in_channels=_LATENT + 1)
    return CosmosVideoToWorldPipeline(**_t5_components(seed, transformer, tiny_cosmos_vae(seed), _edm_scheduler()))


def tiny_cosmos2_text2image(seed: int = 0):
    """A complete tiny Predict2 ``Cosmos2TextToImagePipeline`` (flow matching, Wan VAE, one frame)."""
    from diffusers import Cosmos2TextToImagePipeline, FlowMatchEulerDiscreteScheduler

    from fastdit.testing.components.autoencoder_kl_wan import autoencoder_kl_wan

    scheduler = FlowMatchEulerDiscreteScheduler(use_karras_sigmas=True)
    return Cosmos2TextToImagePipeline(
        **_t5_components(seed, tiny_transformer(seed), autoencoder_kl_wan(seed=seed), scheduler)
    )


def tiny_cosmos2_video2world(seed: int = 0):
    """A complete tiny Predict2 ``Cosmos2VideoToWorldPipeline`` (per-frame timesteps, conditioning frames)."""
    from diffusers import Cosmos2VideoToWorldPipeline, FlowMatchEulerDiscreteScheduler

    from fastdit.testing.components.autoencoder_kl_wan import autoencoder_kl_wan

    scheduler = FlowMatchEulerDiscreteScheduler(use_karras_sigmas=True)
    transformer = tiny_transformer(seed, in_channels=_LATENT + 1)
    return Cosmos2VideoToWorldPipeline(**_t5_components(seed, transformer, autoencoder_kl_wan(seed=seed), scheduler))


def tiny_cosmos25_predict(seed: int = 0):
    """A complete tiny ``Cosmos2_5_PredictBasePipeline`` (Qwen2.5-VL text encoder, all layers concatenated)."""
    from diffusers import Cosmos2_5_PredictBasePipeline, UniPCMultistepScheduler

    from fastdit.testing.components.autoencoder_kl_wan import autoencoder_kl_wan
    from fastdit.testing.components.encoders import qwen2_5_vl_model

    text_encoder, tokenizer = qwen2_5_vl_model(hidden_size=_TEXT_DIM, seed=seed)
    tokenizer = copy.deepcopy(tokenizer)  # the shared tokenizer has no chat template
    tokenizer.chat_template = _CHAT_TEMPLATE
    num_layers = text_encoder.config.text_config.num_hidden_layers
    return Cosmos2_5_PredictBasePipeline(
        # The pipeline feeds every normalised hidden layer but the embeddings, concatenated on channels.
        transformer=tiny_transformer(seed, in_channels=_LATENT + 1, text_dim=_TEXT_DIM * num_layers),
        vae=autoencoder_kl_wan(seed=seed),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0),
        safety_checker=PassThroughSafetyChecker(),
    )


_CALL = {
    "prompt": "a cat holding a sign",
    "negative_prompt": "blue",
    "height": _SIZE,
    "width": _SIZE,
    "num_frames": 9,
    "num_inference_steps": 2,
    "guidance_scale": 3.0,
    "max_sequence_length": 16,
    # The pipelines round decoded frames to uint8 for the safety checker: a 1e-7 difference can flip a pixel by
    # 1/255, so outputs that must agree to 1e-4 (context parallel against one process) are compared as latents.
    "output_type": "latent",
}
_IMAGE_CALL = {k: v for k, v in _CALL.items() if k != "num_frames"}


def _preset(name: str, pipeline: str, hub_id: str, steps: int, size: tuple[int, int], frames: int | None):
    height, width = size
    defaults = {"num_inference_steps": steps, "guidance_scale": 7.0, "height": height, "width": width}
    if frames:
        defaults["num_frames"] = frames
    return ModelPreset(name=name, pipeline_class=f"diffusers.{pipeline}", hub_id=hub_id, defaults=defaults)


# The video tokens are split at the first block; RoPE, the learnable extra positions, per-token modulation
# (Predict2 Video2World's per-frame timesteps) and ControlNet residuals are full-length tensors forward passes to every
# block, so each block splits them alike. The text enters through cross-attention only and stays whole on every rank.
CP_PLAN = ContextParallelPlan(
    inputs={
        "transformer_blocks.0": {"hidden_states": SplitInput(dim=1, expected_dims=3)},
        "transformer_blocks.*": {
            "image_rotary_emb": SplitInput(dim=0, expected_dims=2),  # (cos, sin), each (T·H·W, head_dim)
            "extra_pos_emb": SplitInput(dim=1, expected_dims=3),
            "embedded_timestep": SplitInput(dim=1, expected_dims=3),  # (B, T·H·W, D) only for per-frame timesteps
            "temb": SplitInput(dim=1, expected_dims=3),
            "controlnet_residual": SplitInput(dim=1, expected_dims=3),
        },
    },
    # Before norm_out: its modulation is per token when the timestep is per frame, and forward builds it full-length.
    gather={"transformer_blocks.-1": GatherOutput(dim=1, expected_dims=3)},
    attention=AttentionRouting(dispatch_modules=(_MODULE,), local=("transformer_blocks.*.attn2",)),
    notes=(
        "Video tokens split at transformer_blocks.0; RoPE, extra positions and per-token modulation split at every "
        "block; gathered after the last block; text cross-attention local. The processors pass no parallel_config: "
        "their module is routed through dispatch_modules."
    ),
)

# Tensor parallelism: self-attention (attn1) and text cross-attention (attn2) q/k/v column-wise, to_out row-wise; the
# processors reshape with unflatten(2, (attn.heads, -1)), so `heads` is divided. The QK-norms are RMSNorm over head_dim
# and the RoPE table (S, head_dim) broadcasts over heads: per head, replicated. FFN split. The AdaLN modulation
# stays replicated: it is a LoRA bottleneck (dim -> adaln_lora_dim -> 3 dim, a few % of the weights) whose output is
# per token under per-frame timesteps, where a gathered output would cost an activation-sized all-gather per norm.
# Not covered: the image-context attention of checkpoints with img_context_dim_in (attn2.q_img/k_img/v_img, which
# the tiny models lack, and its dim_head = attn.out_dim // attn.heads).
TP_PLAN = TensorParallelPlan(
    layers=under("transformer_blocks.*", {**attention("attn1"), **attention("attn2"), **feed_forward("ff")}),
    divide=("transformer_blocks.*.attn1.heads", "transformer_blocks.*.attn2.heads"),
    notes="Self- and cross-attention and FFN split; AdaLN-LoRA modulation (small, per token for per-frame timesteps) "
    "and QK-norms per head replicated; image-context attention (img_context_dim_in) not covered.",
)

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "transformer_blocks": (
        ("attn1.to_q", "attn1.to_k", "attn1.to_v"),
        ("attn2.to_k", "attn2.to_v"),
    ),
}

ADAPTER = register(
    ModelAdapter(
        family="cosmos",
        fused_projections=FUSED_PROJECTIONS,
        # hidden_states is (batch, channels, frames, height, width). The conditioning frames' mask arrives apart
        # (condition_mask).
        latent=LatentLayout(),
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="transformer_blocks", pattern=ForwardPattern.P2),),
        tiny_pipelines=(
            TinyPipeline(name="text2world", build=tiny_cosmos_text2world, call_kwargs=_CALL),
            TinyPipeline(
                name="video2world",
                build=tiny_cosmos_video2world,
                call_kwargs=LazyKwargs({**_CALL, "image": tiny_image(_SIZE)}),
            ),
            TinyPipeline(name="predict2-text2image", build=tiny_cosmos2_text2image, call_kwargs=_IMAGE_CALL),
            TinyPipeline(name="predict2.5", build=tiny_cosmos25_predict, call_kwargs=_CALL),
            # Per-frame timesteps with conditioning frames at ~0: the cache follows the largest entry.
            TinyPipeline(
                name="predict2-video2world",
                build=tiny_cosmos2_video2world,
                call_kwargs=LazyKwargs({**_CALL, "image": tiny_image(_SIZE)}),
            ),
        ),
        presets=(
            _preset(
                "cosmos-7b-text2world",
                "CosmosTextToWorldPipeline",
                "nvidia/Cosmos-1.0-Diffusion-7B-Text2World",
                36,
                (704, 1280),
                121,
            ),
            _preset(
                "cosmos-7b-video2world",
                "CosmosVideoToWorldPipeline",
                "nvidia/Cosmos-1.0-Diffusion-7B-Video2World",
                36,
                (704, 1280),
                121,
            ),
            _preset(
                "cosmos-predict2-2b-text2image",
                "Cosmos2TextToImagePipeline",
                "nvidia/Cosmos-Predict2-2B-Text2Image",
                35,
                (768, 1360),
                None,
            ),
            _preset(
                "cosmos-predict2-2b-video2world",
                "Cosmos2VideoToWorldPipeline",
                "nvidia/Cosmos-Predict2-2B-Video2World",
                35,
                (704, 1280),
                93,
            ),
            _preset(
                "cosmos-predict2.5-2b",
                "Cosmos2_5_PredictBasePipeline",
                "nvidia/Cosmos-Predict2.5-2B",
                36,
                (704, 1280),
                93,
            ),
        ),
        notes=(
            "RoPE and the learnable extra positions are computed from the latent shape in forward and the extra "
            "positions are added inside every block (both full-length: slice per rank under a sequence split). CFG "
            "runs as two calls per step without cache_context. Predict2 Video2World passes per-frame timesteps "
            "(B, 1, T, 1, 1) with the conditioning frames at a small fixed value: read the step from the largest. "
            "The pipelines need a safety checker; real checkpoints also need torchvision (padding-mask resize). "
            "Context parallel: the processors call dispatch_attention_fn without a parallel_config, so the plan "
            "routes their module through dispatch_modules. Transfer2.5 ControlNet residuals are split per block but "
            "untested."
        ),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
    )
)
