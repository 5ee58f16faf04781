"""SANA-WM (camera-controlled world model, stage 1): ``SanaWMTransformer3DModel``.

Blocks (diffusers 0.42.1): one list, ``blocks`` (``SanaVideoMSCamCtrlBlock``), called positionally as ``block(x, y,
t0, y_lens, (frames, height, width), rotary_emb, block_mask, camera_conditions, ucpe_ray_transforms, plucker_emb,
frame_valid_mask, chunk_size)``; each returns the hidden states alone (pattern 2, hidden ``x``, text ``y``). A block
is camera-conditioned self-attention (a bidirectional gated-delta-net linear attention over the frames, every
``softmax_every_n``-th block a softmax one, each with a UCPE camera branch), cross-attention to the Gemma 2 prompt and
a Mix-FFN with a temporal convolution. Between blocks the forward does nothing.

The pipeline (``SanaWMPipeline``) batches CFG in one call and pins the first latent frame (the input image) with a
per-frame timestep of 0, so the step is read from the largest timestep.
"""

from __future__ import annotations

from fastdit.models._lazy import LazyKwargs, tiny_image
from fastdit.models.base import BlockGroup, ForwardPattern, LatentLayout, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import (
    AttentionRouting,
    ContextParallelPlan,
    GatherInput,
    GatherOutput,
    Halo,
    LocalExtent,
    SplitInput,
    SplitOutput,
)
from fastdit.parallel.tp_plan import Colwise, Rowwise, TensorParallelPlan
from fastdit.parallel.tp_shapes import under

TRANSFORMER = "diffusers.models.transformers.transformer_sana_wm.SanaWMTransformer3DModel"

_LATENT = 4
_TEXT_DIM = 32
_SIZE = 32


def tiny_transformer(seed: int = 0):
    """A 3-block ``SanaWMTransformer3DModel`` (width 32, 2 heads of 16): blocks 0 and 2 GDN, block 1 softmax."""
    from diffusers import SanaWMTransformer3DModel

    from fastdit.testing.components.encoders import build

    return build(
        SanaWMTransformer3DModel,
        seed=seed,
        in_channels=_LATENT,
        num_layers=3,
        hidden_size=32,
        num_attention_heads=2,
        softmax_every_n=2,
        linear_head_dim=16,
        # 6 Plucker channels per latent frame times the tiny VAE's temporal stride (8).
        chunk_plucker_channels=48,
        chunk_plucker_post_attn_blocks=3,
        caption_channels=_TEXT_DIM,
        mlp_ratio=2.0,
    )


def tiny_sana_wm(seed: int = 0):
    """A complete tiny ``SanaWMPipeline`` (Gemma 2 text encoder, LTX-2 video VAE, flow-matching Euler)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SanaWMPipeline

    from fastdit.testing.components.autoencoder_kl_ltx import autoencoder_kl_ltx2_video
    from fastdit.testing.components.gemma2 import gemma2_model

    text_encoder, tokenizer = gemma2_model(hidden_size=_TEXT_DIM, seed=seed + 1)
    return SanaWMPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=autoencoder_kl_ltx2_video(latent_channels=_LATENT, seed=seed),
        transformer=tiny_transformer(seed),
        scheduler=FlowMatchEulerDiscreteScheduler(),
    )


# Tensor parallelism: the Mix-FFN only. GLUMBConvTemp's 1x1 `inverted_conv` and depthwise 3x3 `depth_conv` output
# [value | gate] before `chunk(2, dim=1)` (two segments; the depthwise groups follow the channels) and the 1x1
# `point_conv` back to the width is row-wise (one all-reduce); the temporal `t_conv` runs on the reduced width (the
# forward views its input with the full channel count) and stays whole. Both attentions stay replicated: the
# self-attention reshapes its Q/K to the input's full channel count for the across-head RMSNorms
# (`query.reshape(batch, seq, channels)` with `channels = x.shape[-1]`) and shares its per-head GDN gates with the
# camera branch, and the cross-attention views its fused K/V as `(batch, -1, 2, channels)` with the full width, so
# neither can take a shard of the heads. The modulation (t_block, scale_shift_tables) and embedders stay replicated.
_FFN = {
    "mlp.inverted_conv.conv": Colwise(segments=(1, 1)),
    "mlp.depth_conv.conv": Colwise(segments=(1, 1)),
    "mlp.point_conv.conv": Rowwise(),
}
TP_PLAN = TensorParallelPlan(
    layers=under("blocks.*", _FFN),
    notes="Mix-FFN convolutions split by channel ([value | gate] segments); its temporal t_conv, both attentions "
    "(their reshapes read the full width from the input) and the AdaLN tables replicated.",
)


# Context parallelism. The tokens are frame-major (frames, height, width): split at blocks.0 in whole latent frames
# (units of THW[1]·THW[2] tokens), so the block's per-frame modulation (t, (B, 1, T, 6·C), split along its frames
# alike: both cut T frames the same way) and its reshape to (B, frames, -1, C) stay exact on a shard; the per-token
# Plucker embedding splits with the tokens. The self-attention of every block cannot run on a shard, nor on the
# rank's heads: the GDN blocks run a bidirectional recurrence over the frames (each frame's state feeds the next),
# after a 4-frame convolution over K, with per-frame gates pooled from the input over each frame and QK-norms over
# the whole width (across heads) between the fused qkv projection and the recurrence, so no exchange point lies
# between whole-sequence and whole-head work; the softmax blocks share that camera branch and those gates. So each
# block's self-attention module gathers its input (GatherInput) and runs on the whole sequence on every rank (its
# THW, RoPE table, camera conditions and UCPE transforms are global, passed whole), and its output is split back
# (SplitOutput): exact, the attention computed redundantly. The Mix-FFN runs on the rank's frames (its THW narrowed
# to the rank's frames by LocalExtent): the 3x3 spatial convolution is per frame, the temporal (3, 1) convolution
# gets a one-frame halo. Cross-attention to the prompt is local. Gathered after the last block (the final layer's
# modulation is per frame).
_FRAMES = ("THW[1]", "THW[2]")
CP_PLAN = ContextParallelPlan(
    inputs={
        "blocks.0": {"x": SplitInput(dim=1, expected_dims=3, unit=_FRAMES)},
        "blocks.*": {
            "t": SplitInput(dim=2, expected_dims=4),
            "plucker_emb": SplitInput(dim=1, expected_dims=3, unit=_FRAMES),
        },
        "blocks.*.attn": {"x": GatherInput(dim=1, expected_dims=3)},
        "blocks.*.mlp": {"HW": LocalExtent(of="x", index=0)},
    },
    outputs={"blocks.*.attn": SplitOutput(dim=1, expected_dims=3, like="x")},
    gather={"blocks.-1": GatherOutput(dim=1, expected_dims=3)},
    halo={"blocks.*.mlp.t_conv": Halo(dim=2, size=1)},
    attention=AttentionRouting(local=("blocks.*.cross_attn",)),
    notes="Split at blocks.0 in whole latent frames, the per-frame modulation and the Plucker embedding alike; each "
    "self-attention (GDN recurrence over the frames, or softmax) gathered and computed whole on every rank, its "
    "output split back; the Mix-FFN on the rank's frames with a one-frame temporal halo; cross-attention local; "
    "gathered after the last block.",
)


def _call() -> dict:
    return {
        "image": tiny_image(_SIZE),
        "prompt": "a cat holding a sign",
        "negative_prompt": "blue",
        # A forward walk: one camera pose per pixel frame (the pipeline trims the trajectory to num_frames).
        "action": "w-16",
        "intrinsics": [16.0, 16.0, 16.0, 16.0],
        "height": _SIZE,
        "width": _SIZE,
        # 3 latent frames (the tiny VAE compresses time by 8): the first is the pinned image.
        "num_frames": 17,
        "num_inference_steps": 2,
        "guidance_scale": 3.0,
        "max_sequence_length": 16,
        # The pipeline returns decoded frames without a batch dim ((frames, H, W, 3)); latents keep it.
        "output_type": "latent",
    }


ADAPTER = register(
    ModelAdapter(
        family="sana_wm",
        # hidden_states is (batch, channels, frames, height, width). The camera conditions arrive apart.
        latent=LatentLayout(),
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="blocks", pattern=ForwardPattern.P2, hidden_arg="x", encoder_arg="y"),),
        tiny_pipelines=(
            TinyPipeline(
                name="i2v-camera",
                build=tiny_sana_wm,
                call_kwargs=LazyKwargs(_call()),
            ),
        ),
        presets=(
            ModelPreset(
                name="sana-wm",
                pipeline_class="diffusers.SanaWMPipeline",
                hub_id="Efficient-Large-Model/SANA-WM_bidirectional",
                defaults={
                    "num_inference_steps": 60,
                    "guidance_scale": 5.0,
                    "num_frames": 161,
                    "height": 704,
                    "width": 1280,
                },
            ),
        ),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        notes=(
            "Image-and-camera-to-video: the pipeline needs an image, a prompt, a camera trajectory (`c2w` or an "
            "`action` string) and intrinsics. CFG is batched in one call without cache contexts; the first latent "
            "frame is pinned with a per-frame timestep of 0 (the step is read from the largest). "
            "Context parallelism splits the tokens in whole latent frames. The self-attention of most blocks is a "
            "bidirectional gated delta rule, a recurrence over the frames whose state after each frame feeds the "
            "next (after a 4-frame short convolution over K, with gates pooled per frame and QK-norms across the "
            "heads), which neither a token shard nor a head shard can run: every block's self-attention module "
            "gathers its input and runs on the whole sequence on every rank, its output split back (exact; the "
            "attention is not sped up, the cross-attention, Mix-FFN and modulation are). The optional "
            "`frame_valid_mask` (padded frames; never passed by the pipeline) is not split by the plan: under "
            "context parallelism each block refuses it (`frame_valid_mask shape mismatch`: the global frames "
            "against the rank's)."
        ),
    )
)
