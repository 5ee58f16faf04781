"""ConsisID (identity-preserving image-to-video): ``ConsisIDTransformer3DModel``.

Blocks (diffusers 0.42.1): one list ``transformer_blocks`` of ``ConsisIDBlock`` (CogVideoX's block); the model calls
each by keyword as ``block(hidden_states=..., encoder_hidden_states=..., temb=..., image_rotary_emb=...)`` and the
block returns ``(hidden_states, encoder_hidden_states)`` (pattern 0): text and video tokens attend jointly. With
``is_train_face`` the loop adds, after every ``cross_attn_interval``-th block, a perceiver cross-attention from the
video tokens to the face tokens that ``local_facial_extractor`` builds from ``id_cond`` / ``id_vit_hidden``.
"""

from __future__ import annotations

from fastdit.models._lazy import Deferred, LazyKwargs, tiny_image
from fastdit.models.base import BlockGroup, ForwardPattern, LatentLayout, ModelAdapter, ModelPreset, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, SplitInput
from fastdit.parallel.plan_shapes import streams
from fastdit.parallel.tp_plan import TensorParallelPlan
from fastdit.parallel.tp_shapes import attention, feed_forward, modulation, under

TRANSFORMER = "diffusers.models.transformers.consisid_transformer_3d.ConsisIDTransformer3DModel"

_LATENT = 4
_TEXT_DIM = 32
_TEXT_LEN = 16  # max_text_seq_length: the pipeline pads prompts to exactly this length
_SIZE = 32  # pixels: 4x4 latents, 2x2 tokens per latent frame
_HEADS = 2
_HEAD_DIM = 32  # 3-D RoPE splits head_dim 1/4 : 3/8 : 3/8 into even parts (8, 12, 12)
# The face tokens have inner_dim * 2 / 3 features (the perceiver cross-attention's key/value width).
_FACE_DIM = int(_HEADS * _HEAD_DIM / 3 * 2)
_ID_DIM = 16  # the insightface embedding (id_cond)
_VIT_DIM = 16  # the EVA-CLIP hidden states (id_vit_hidden)
_VIT_TOKENS = 5
_NUM_SCALE = 2  # id_vit_hidden holds one tensor per scale


def tiny_transformer(seed: int = 0, *, face: bool = True, rope: bool = True):
    """A 4-block ``ConsisIDTransformer3DModel`` (with both options: ConsisID-preview's layout).

    Args:
        seed: RNG seed.
        face: Build the local facial extractor and the perceiver cross-attentions (``is_train_face``); four blocks
            with interval 2 give two of them (blocks 0 and 2).
        rope: 3-D rotary embeddings from the pipeline; otherwise sin-cos positions added in the patch embedding.
    """
    from diffusers import ConsisIDTransformer3DModel

    from fastdit.testing.components.encoders import build

    return build(
        ConsisIDTransformer3DModel,
        seed=seed,
        num_attention_heads=_HEADS,
        attention_head_dim=_HEAD_DIM,
        in_channels=2 * _LATENT,  # noise + image latents
        out_channels=_LATENT,
        time_embed_dim=8,
        text_embed_dim=_TEXT_DIM,
        num_layers=4,
        sample_width=_SIZE // 8,
        sample_height=_SIZE // 8,
        sample_frames=9,
        patch_size=2,
        max_text_seq_length=_TEXT_LEN,
        use_rotary_positional_embeddings=rope,
        use_learned_positional_embeddings=False,
        is_train_face=face,
        is_kps=False,
        cross_attn_interval=2,
        cross_attn_dim_head=8,
        cross_attn_num_heads=2,
        LFE_id_dim=_ID_DIM,
        LFE_vit_dim=_VIT_DIM,
        LFE_depth=_NUM_SCALE,
        LFE_dim_head=8,
        LFE_num_heads=2,
        LFE_num_id_token=2,
        LFE_num_querie=4,
        LFE_output_dim=_FACE_DIM,
        LFE_ff_mult=1,
        LFE_num_scale=_NUM_SCALE,
    )


# diffusers exports ConsisIDPipeline at top level only when OpenCV is installed (a placeholder that raises otherwise);
# its module imports without it, and only the facial-keypoint path (is_kps, draw_kps) calls OpenCV.
PIPELINE = "diffusers.pipelines.consisid.pipeline_consisid.ConsisIDPipeline"


def _pipeline_class() -> type:
    import importlib

    module, _, name = PIPELINE.rpartition(".")
    return getattr(importlib.import_module(module), name)


def tiny_consisid(seed: int = 0):
    """A complete tiny ``ConsisIDPipeline`` (T5 text encoder, CogVideoX VAE, DPM scheduler)."""
    from diffusers import CogVideoXDPMScheduler

    from fastdit.testing.components.autoencoder_kl_cogvideox import autoencoder_kl_cogvideox
    from fastdit.testing.components.encoders import t5_encoder

    pipeline_class = _pipeline_class()

    text_encoder, tokenizer = t5_encoder(d_model=_TEXT_DIM, seed=seed)
    scheduler = CogVideoXDPMScheduler(
        prediction_type="v_prediction",
        rescale_betas_zero_snr=True,
        timestep_spacing="trailing",
        beta_schedule="scaled_linear",
    )
    return pipeline_class(
        transformer=tiny_transformer(seed),
        vae=autoencoder_kl_cogvideox(latent_channels=_LATENT, levels=4, seed=seed),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        scheduler=scheduler,
    )


def _face_embedding(seed: int):
    """``id_cond``: one face's identity embedding, as ``process_face_embeddings_infer`` returns it (batch 1)."""
    import torch

    return torch.randn(1, _ID_DIM, generator=torch.Generator().manual_seed(seed))


def _face_vit_hidden(seed: int):
    """``id_vit_hidden``: the face crop's vision hidden states, one tensor per scale (batch 1)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, _VIT_TOKENS, _VIT_DIM, generator=generator) for _ in range(_NUM_SCALE)]


_CALL = {
    "prompt": "a person walking in a park",
    "negative_prompt": "blurry",
    "height": _SIZE,
    "width": _SIZE,
    "num_frames": 5,
    "num_inference_steps": 2,
    "guidance_scale": 6.0,
    "max_sequence_length": _TEXT_LEN,
}

# Context parallelism: CogVideoX's plan. The patch embedding builds [text, video] and forward splits it into the two
# streams, so both are split at the first block's inputs; the video RoPE (cos, sin) tables the pipeline passes cover
# video tokens only and are split alike at the root. The joint attention concatenates [text, video] per rank and has
# no mask, so any split is exact. The perceiver cross-attention between blocks is computed inline (matmul, no SDPA)
# from the local video tokens (queries) to the face tokens (keys and values), which every rank computes whole from
# the replicated id_cond / id_vit_hidden: token-wise in the queries, so exact on a shard without routing.
CP_PLAN = ContextParallelPlan(
    inputs={
        "": {"image_rotary_emb": SplitInput(dim=0, expected_dims=2)},
        "transformer_blocks.0": streams(),
    },
    # After the loop forward concatenates [text, video], normalises and drops the first text_seq_length tokens, a
    # global length: both streams are gathered where the last block returns them.
    gather={"transformer_blocks.-1": GatherOutput(dim=1, expected_dims=3, index=(0, 1))},
    attention=AttentionRouting(sdpa_modules=("diffusers.models.attention_processor",)),
    notes="CogVideoX's split: both streams at the first block, the video RoPE tables at the root, both gathered "
    "after the last block (forward drops the text by its global length); the face cross-attention between blocks "
    "attends from the local video tokens to the whole face tokens.",
)

# Tensor parallelism: CogVideoX's (joint attention and FFN split, heads divided, per-head QK-norms replicated,
# the per-block AdaLN modulation split with a gathered output). The face modules (local facial extractor, perceiver
# cross-attentions: about 5 % of the weights, outside the blocks) stay replicated and see the whole hidden states
# the blocks return.
TP_PLAN = TensorParallelPlan(
    layers=under(
        "transformer_blocks.*",
        {**attention("attn1"), **feed_forward("ff"), **modulation("norm1.linear", "norm2.linear")},
    ),
    divide=("transformer_blocks.*.attn1.heads",),
    notes="Joint attention and FFN split; per-block AdaLN modulation (6 dim) split with a gathered output; "
    "QK-norms per head and the face modules replicated.",
)

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "transformer_blocks": (("attn1.to_q", "attn1.to_k", "attn1.to_v"),),
}

ADAPTER = register(
    ModelAdapter(
        family="consisid",
        fused_projections=FUSED_PROJECTIONS,
        # hidden_states is (batch, frames, channels, height, width); the reference face's latents are appended as
        # channels and stay put: they dilute the signal.
        latent=LatentLayout(channel_dim=2),
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="transformer_blocks", pattern=ForwardPattern.P0),),
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        tiny_pipelines=(
            TinyPipeline(
                name="i2v",
                build=tiny_consisid,
                call_kwargs=LazyKwargs(
                    {
                        **_CALL,
                        "image": tiny_image(_SIZE),
                        "id_cond": Deferred(_face_embedding, (0,)),
                        "id_vit_hidden": Deferred(_face_vit_hidden, (1,)),
                    }
                ),
            ),
        ),
        presets=(
            ModelPreset(
                name="consisid",
                pipeline_class=PIPELINE,
                hub_id="BestWishYsh/ConsisID-preview",
                defaults={
                    "num_inference_steps": 50,
                    "guidance_scale": 6.0,
                    "height": 480,
                    "width": 720,
                    "num_frames": 49,
                },
            ),
        ),
        notes=(
            "CogVideoX's layout: text and video tokens concatenated by the patch embedding and split again before "
            "the blocks, 3-D RoPE from the pipeline (video tokens only). Loop-body work: with is_train_face, a "
            "perceiver cross-attention to the face tokens after every cross_attn_interval-th block, added to the "
            "video stream (on a cached step the segment's residual covers those inside the segment; one after its "
            "last block runs again on the replayed stream). The face inputs (id_cond, "
            "id_vit_hidden) come from the face models of diffusers' consisid_utils (insightface, EVA-CLIP), which "
            "the CLI does not load: pass them as call arguments; the keypoint condition (kps_cond, is_kps models) "
            "needs OpenCV. They have batch 1 and broadcast over the CFG "
            "batch. CFG is batched (one call per step, batch 2)."
        ),
    )
)
