"""SANA-Video: ``SanaVideoTransformer3DModel``.

Blocks (diffusers 0.42.1): one list, ``transformer_blocks`` (``SanaVideoTransformerBlock``: linear self-attention with
3-D RoPE, softmax cross-attention to the Gemma 2 prompt, a Mix-FFN with a temporal convolution). Each is called
positionally with ``(hidden_states, attention_mask, encoder_hidden_states, encoder_attention_mask, timestep, frames,
height, width, rotary_emb)`` and returns the hidden states alone (pattern 2). Between blocks the forward only adds
ControlNet residuals (when given).
"""

from __future__ import annotations

from fastdit.models.base import BlockGroup, ForwardPattern, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.testing.components.autoencoder_kl_wan import autoencoder_kl_wan
from fastdit.testing.components.encoders import build
from fastdit.testing.components.gemma2 import gemma2_model

TRANSFORMER = "diffusers.models.transformers.transformer_sana_video.SanaVideoTransformer3DModel"

_LATENT_CHANNELS = 4
_TEXT_DIM = 32


def tiny_transformer(seed: int = 0, *, num_layers: int = 3):
    """A 3-block ``SanaVideoTransformer3DModel`` (2 heads x 16, Gemma 2 width 32, patch 1x2x2)."""
    from diffusers import SanaVideoTransformer3DModel

    return build(
        SanaVideoTransformer3DModel,
        seed=seed,
        in_channels=_LATENT_CHANNELS,
        out_channels=_LATENT_CHANNELS,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=num_layers,
        num_cross_attention_heads=2,
        cross_attention_head_dim=16,
        cross_attention_dim=32,
        caption_channels=_TEXT_DIM,
        sample_size=8,
        patch_size=(1, 2, 2),
        rope_max_seq_len=64,
    )


def tiny_sana_video(seed: int = 0):
    """A complete tiny ``SanaVideoPipeline`` (Gemma 2 text encoder, Wan VAE, flow DPM-Solver++)."""
    from diffusers import DPMSolverMultistepScheduler, SanaVideoPipeline

    text_encoder, tokenizer = gemma2_model(hidden_size=_TEXT_DIM, seed=seed + 1)
    scheduler = DPMSolverMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=8.0)
    return SanaVideoPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=autoencoder_kl_wan(latent_channels=_LATENT_CHANNELS, seed=seed),
        transformer=tiny_transformer(seed),
        scheduler=scheduler,
    )


ADAPTER = register(
    ModelAdapter(
        family="sana_video",
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="transformer_blocks", pattern=ForwardPattern.P2),),
        tiny_pipelines=(
            TinyPipeline(
                name="t2v",
                build=tiny_sana_video,
                # guidance_scale > 1 batches cond and uncond in one transformer call per step.
                call_kwargs={
                    "prompt": "a cat holding a sign",
                    "negative_prompt": "blue",
                    "guidance_scale": 6.0,
                    "height": 32,
                    "width": 32,
                    "frames": 5,
                    "num_inference_steps": 2,
                    "max_sequence_length": 16,
                    # Binning snaps the size to the aspect-ratio table of the real model (480p).
                    "use_resolution_binning": False,
                },
            ),
        ),
        presets=(
            ModelPreset(
                name="sana-video",
                pipeline_class="diffusers.SanaVideoPipeline",
                hub_id="Efficient-Large-Model/SANA-Video_2B_480p_diffusers",
                defaults={"num_inference_steps": 50, "guidance_scale": 6.0, "frames": 81, "height": 480, "width": 832},
            ),
        ),
        notes=(
            "Blocks need the latent grid (frames, height, width: the Mix-FFN's convolutions reshape tokens to it); "
            "3-D RoPE is computed from hidden_states.shape inside forward. Cross-attention takes a text padding mask. "
            "CFG is batched in one call and the pipeline opens no cache contexts. No context-parallel plan: "
            "self-attention is ReLU linear attention computed inside SanaLinearAttnProcessor3_0 (no "
            "dispatch_attention_fn call to route), and the Mix-FFN's depthwise 3x3 and temporal convolutions mix "
            "neighbouring tokens across any split of the sequence."
        ),
    )
)
