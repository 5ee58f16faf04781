"""Z-Image (Turbo / base, text-to-image and image-to-image): ``ZImageTransformer2DModel``.

Blocks (diffusers 0.42.1): every block is a single-stream ``ZImageTransformerBlock`` whose hidden argument is ``x``,
called positionally as ``(x, attn_mask, freqs_cis, adaln_input, noise_mask, adaln_noisy, adaln_clean)`` and
returning one tensor (pattern 3). The forward runs three lists: ``noise_refiner`` on the image tokens, then
``context_refiner`` on the caption tokens, then concatenates both into one padded sequence for the 30 main
``layers``. Only ``layers`` is declared: the refiners transform two different streams before the unified sequence
exists, so their residuals do not chain with the main stack.
"""

from __future__ import annotations

from fastdit.models._lazy import LazyKwargs, tiny_image
from fastdit.models.base import BlockGroup, ForwardPattern, ModelAdapter, ModelPreset, StepInvariant, TinyPipeline
from fastdit.models.registry import register
from fastdit.parallel.plan import AttentionRouting, ContextParallelPlan, GatherOutput, SplitInput
from fastdit.parallel.tp_plan import Colwise, Rowwise, Style, TensorParallelPlan
from fastdit.parallel.tp_shapes import attention, under

TRANSFORMER = "diffusers.models.transformers.transformer_z_image.ZImageTransformer2DModel"

_LATENT_CHANNELS = 16


def tiny_transformer(seed: int = 0, *, num_layers: int = 3):
    """A ``ZImageTransformer2DModel`` with 1+1 refiner blocks and ``num_layers`` main blocks (2 heads x 16)."""
    from diffusers import ZImageTransformer2DModel

    from fastdit.testing.components.encoders import build

    return build(
        ZImageTransformer2DModel,
        seed=seed,
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=_LATENT_CHANNELS,
        dim=32,
        n_layers=num_layers,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        cap_feat_dim=32,
        axes_dims=[4, 6, 6],
        axes_lens=[256, 32, 32],
    )


def _components(seed: int) -> dict:
    from diffusers import FlowMatchEulerDiscreteScheduler

    from fastdit.testing.components.autoencoder_kl import autoencoder_kl
    from fastdit.testing.components.qwen3 import qwen3_model

    text_encoder, tokenizer = qwen3_model(seed=seed)
    return {
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=3.0),
        "vae": autoencoder_kl(latent_channels=_LATENT_CHANNELS, scaling_factor=0.3611, shift_factor=0.1159, seed=seed),
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "transformer": tiny_transformer(seed),
    }


def tiny_z_image(seed: int = 0):
    """A complete tiny ``ZImagePipeline`` (Qwen3 text encoder, 16-channel KL VAE with scale factor 2)."""
    from diffusers import ZImagePipeline

    return ZImagePipeline(**_components(seed))


def tiny_z_image_img2img(seed: int = 0):
    """A complete tiny ``ZImageImg2ImgPipeline``."""
    from diffusers import ZImageImg2ImgPipeline

    return ZImageImg2ImgPipeline(**_components(seed))


# Context parallelism: forward patchifies lists of per-sample tensors, pads them and builds RoPE tables inside
# forward, so the sequence is split at the blocks. Every block is called positionally with the stream `x`, a key
# padding mask, RoPE `freqs_cis` (B, S, D/2) and (omni mode) a per-token `noise_mask`, the last three being the same
# full-length tensors for every block of a list: `x` is split at the first main layer, RoPE and the noise mask at every
# layer; the padding mask stays whole (a global key mask is used as is by attention). The noise and context refiners
# run before the unified sequence exists and their output is sliced per sample with global lengths, so each refiner
# layer splits its input and gathers its output. The omni SigLIP refiner exists only in checkpoints with SigLIP, so
# the plan cannot name it: it runs whole on every rank, and its routed attention then sees each key once per rank,
# which leaves the softmax unchanged (exact, at the cost of redundant attention in that refiner). The final layer
# gathers the unified sequence before unpatchify.
_SEQ = SplitInput(dim=1, expected_dims=3)
_PER_TOKEN = SplitInput(dim=1, expected_dims=2)
CP_PLAN = ContextParallelPlan(
    inputs={
        "noise_refiner.*": {"x": _SEQ, "freqs_cis": _SEQ, "noise_mask": _PER_TOKEN},
        "context_refiner.*": {"x": _SEQ, "freqs_cis": _SEQ},
        "layers.0": {"x": _SEQ},
        "layers.*": {"freqs_cis": _SEQ, "noise_mask": _PER_TOKEN},
        "all_final_layer.*": {"noise_mask": _PER_TOKEN},
    },
    gather={
        "noise_refiner.*": GatherOutput(dim=1, expected_dims=3),
        "context_refiner.*": GatherOutput(dim=1, expected_dims=3),
        "all_final_layer.*": GatherOutput(dim=1, expected_dims=3),
    },
    attention=AttentionRouting(modules=("diffusers.models.transformers.transformer_z_image",)),
    notes="RoPE tables and noise mask split at every block; refiners split and gather per layer; padding mask whole.",
)


_BLOCK_GROUPS = ("noise_refiner", "context_refiner", "layers")


def _blocks(layers: dict[str, Style]) -> dict[str, Style]:
    """``layers`` (paths inside one ZImageTransformerBlock) for every block of the main stack and both refiners."""
    return {path: style for group in _BLOCK_GROUPS for path, style in under(f"{group}.*", layers).items()}


# Tensor parallelism over every ZImageTransformerBlock: the 30 main layers and the noise and context refiners (full
# size blocks that run once per call). ZSingleStreamAttnProcessor reshapes q/k/v with ``attn.heads`` (divided; no GQA
# in the diffusers module: K/V have as many heads as Q); the QK-norms are per head (replicated). The SwiGLU FFN is
# w1/w3 column-wise, w2 row-wise. The per-block AdaLN linear reads a 256-wide embedding (256 -> 4·dim, ~2 % of a
# block) and stays replicated, as do the embedders, the final layers and the omni SigLIP refiner (present only in
# checkpoints with SigLIP, so the plan cannot name it). Z-Image's 30 heads and FFN width (int(dim / 3 * 8), 10240)
# divide different degrees, so two fallbacks: the FFN alone (tp=4, 8: heads do not divide) and attention alone (tp=3,
# 6; the tiny model's FFN width, 85, is odd).
_ATTENTION = attention("attention")
_FFN: dict[str, Style] = {"feed_forward.w1": Colwise(), "feed_forward.w3": Colwise(), "feed_forward.w2": Rowwise()}
_HEADS = tuple(f"{group}.*.attention.heads" for group in _BLOCK_GROUPS)
TP_PLAN = TensorParallelPlan(
    layers=_blocks({**_ATTENTION, **_FFN}),
    divide=_HEADS,
    notes="Main layers and both refiners split (attention by heads, SwiGLU FFN); per-block AdaLN (256-wide input), "
    "embedders and final layers replicated; FFN-only / attention-only fallbacks when tp divides one of heads and FFN.",
    fallback=TensorParallelPlan(
        layers=_blocks(_FFN),
        notes="FFN only: tp does not divide the heads, attention replicated.",
        name="ffn-only",
        fallback=TensorParallelPlan(
            layers=_blocks(_ATTENTION),
            divide=_HEADS,
            notes="Attention only: tp does not divide the FFN width, the FFN replicated.",
            name="attention-only",
        ),
    ),
)

# The pipelines pass the same caption tensors at every step (a new list, `prompt_embeds + negative_prompt_embeds`
# under CFG, of the tensors encoded once before the loop). The caption stream is computed from them alone until it
# joins the image in the unified sequence: forward pads each caption (positions and padding mask from its length),
# embeds the concatenation (`cap_embedder`, a new tensor every call) and runs the context refiner, whose blocks have
# no modulation (no timestep). All are keyed on `cap_feats`, and on `joint_attention_kwargs` (forward applies its
# LoRA `scale` to every layer; a caller's own prompt embeddings reach forward as the same tensors call after call);
# under context parallelism each refiner layer's split of its inputs and gather of its output run around the lookup
# (under tensor parallelism the refiner, whose weights are split, is left out).
# Not `t_embedder` (the timestep), the image embedders and noise refiner (the latent), nor the RoPE tables
# (`rope_embedder` is no module).
_CAPTION = ("cap_feats", "joint_attention_kwargs")
STEP_INVARIANT = (
    StepInvariant("cap_embedder", inputs=_CAPTION),
    StepInvariant("context_refiner.*", inputs=_CAPTION),
)

# CFG here is batched: cond and uncond go through one transformer call per step.
_CALL = {
    "prompt": "a cat holding a sign",
    "negative_prompt": "blue",
    "guidance_scale": 4.0,
    "height": 32,
    "width": 32,
    "num_inference_steps": 2,
    "max_sequence_length": 48,
}

# Projections each block applies to one tensor (Fuse), traced on the tiny pipelines (the family test checks them).
FUSED_PROJECTIONS = {
    "layers": (
        ("attention.to_q", "attention.to_k", "attention.to_v"),
        ("feed_forward.w1", "feed_forward.w3"),
    ),
}

ADAPTER = register(
    ModelAdapter(
        family="z_image",
        fused_projections=FUSED_PROJECTIONS,
        transformer_classes=(TRANSFORMER,),
        block_groups=(BlockGroup(path="layers", pattern=ForwardPattern.P3, hidden_arg="x"),),
        # Z-Image pipelines pass (1000 - t) / 1000: the timestep rises during a run.
        timestep_arg="t",
        cp_plan=CP_PLAN,
        tp_plan=TP_PLAN,
        step_invariant=STEP_INVARIANT,
        tiny_pipelines=(
            TinyPipeline(name="z-image", build=tiny_z_image, call_kwargs=_CALL),
            TinyPipeline(
                name="img2img",
                build=tiny_z_image_img2img,
                # strength 0.5 of 4 steps: two denoising steps start from the noised input image.
                call_kwargs=LazyKwargs({**_CALL, "image": tiny_image(), "strength": 0.5, "num_inference_steps": 4}),
            ),
        ),
        presets=(
            ModelPreset(
                name="z-image-turbo",
                pipeline_class="diffusers.ZImagePipeline",
                hub_id="Tongyi-MAI/Z-Image-Turbo",
                defaults={"num_inference_steps": 9, "guidance_scale": 0.0, "height": 1024, "width": 1024},
            ),
            ModelPreset(
                name="z-image",
                pipeline_class="diffusers.ZImagePipeline",
                hub_id="Tongyi-MAI/Z-Image",
                defaults={"num_inference_steps": 50, "guidance_scale": 4.0, "height": 1024, "width": 1024},
            ),
        ),
        notes=(
            "The transformer takes lists of per-sample tensors (x, cap_feats) and a timestep t that rises from 0 to 1 "
            "over a run; the pipeline opens no cache contexts, does not reset hooks, and batches cond and uncond in "
            "one call. The "
            "main layers see [image | caption] tokens, each part padded to a multiple of 32, with a padding mask "
            "and RoPE positions built inside forward; the noise/context refiners run on each stream first."
            " No spectral signal: the latent arrives as a list of per-sample tensors, not one tensor on a grid."
        ),
    )
)
