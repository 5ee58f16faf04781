"""Exact registries of the non-denoiser components techniques know: text encoders and VAEs.

Keys are fully qualified class names (``module.QualName``), matched exactly — never by prefix or ``isinstance`` —
so a subclass is not silently treated like its parent. Each entry is what the text-encoder and VAE techniques read
for that class; today it names the kind and the family of the class (the classes the tiny pipelines of the model
families use), and the techniques add their plans to it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "TEXT_ENCODER",
    "VAE",
    "ComponentEntry",
    "component_kind",
    "entry_for",
    "register_component",
    "registered",
]

TEXT_ENCODER = "text_encoder"
VAE = "vae"
IMAGE_ENCODER = "image_encoder"
OTHER = "other"


@dataclass(frozen=True, kw_only=True)
class ComponentEntry:
    """One registered component class.

    Attributes:
        class_name: Fully qualified class name.
        kind: ``"text_encoder"``, ``"image_encoder"`` or ``"vae"``.
        architecture: The model architecture it belongs to (``"t5"``, ``"clip"``, ``"autoencoder_kl"`` ...).
    """

    class_name: str
    kind: str
    architecture: str


_REGISTRY: dict[str, ComponentEntry] = {}


def register_component(entry: ComponentEntry) -> ComponentEntry:
    """Add ``entry``; a class registered twice raises ``ValueError``."""
    if entry.kind not in (TEXT_ENCODER, IMAGE_ENCODER, VAE):
        raise ValueError(f"ComponentEntry.kind={entry.kind!r}: must be {TEXT_ENCODER!r}, {IMAGE_ENCODER!r} or {VAE!r}")
    if entry.class_name in _REGISTRY:
        raise ValueError(f"component class {entry.class_name!r} is already registered")
    _REGISTRY[entry.class_name] = entry
    return entry


def entry_for(cls: type) -> ComponentEntry | None:
    """The entry registered for exactly ``cls`` (``None`` if none)."""
    return _REGISTRY.get(f"{cls.__module__}.{cls.__qualname__}")


def registered(kind: str) -> list[ComponentEntry]:
    """Every registered entry of ``kind``, in registration order."""
    return [entry for entry in _REGISTRY.values() if entry.kind == kind]


def component_kind(cls: type) -> str:
    """The kind of ``cls``: its entry's kind, or ``"other"``."""
    entry = entry_for(cls)
    return OTHER if entry is None else entry.kind


_T = "transformers.models"
_D = "diffusers.models.autoencoders"
_KNOWN: tuple[tuple[str, str, str], ...] = (
    (TEXT_ENCODER, "t5", f"{_T}.t5.modeling_t5.T5EncoderModel"),
    (TEXT_ENCODER, "umt5", f"{_T}.umt5.modeling_umt5.UMT5EncoderModel"),
    (TEXT_ENCODER, "clip", f"{_T}.clip.modeling_clip.CLIPTextModel"),
    (TEXT_ENCODER, "clip", f"{_T}.clip.modeling_clip.CLIPTextModelWithProjection"),
    (TEXT_ENCODER, "bert", f"{_T}.bert.modeling_bert.BertModel"),
    (TEXT_ENCODER, "llama", f"{_T}.llama.modeling_llama.LlamaModel"),
    (TEXT_ENCODER, "llama", f"{_T}.llama.modeling_llama.LlamaForCausalLM"),
    (TEXT_ENCODER, "llava", f"{_T}.llava.modeling_llava.LlavaForConditionalGeneration"),
    (TEXT_ENCODER, "gemma2", f"{_T}.gemma2.modeling_gemma2.Gemma2Model"),
    (TEXT_ENCODER, "gemma3", f"{_T}.gemma3.modeling_gemma3.Gemma3ForConditionalGeneration"),
    (TEXT_ENCODER, "glm", f"{_T}.glm.modeling_glm.GlmModel"),
    (TEXT_ENCODER, "mistral3", f"{_T}.mistral3.modeling_mistral3.Mistral3ForConditionalGeneration"),
    (TEXT_ENCODER, "mistral3", f"{_T}.mistral3.modeling_mistral3.Mistral3Model"),
    (TEXT_ENCODER, "qwen2_vl", f"{_T}.qwen2_vl.modeling_qwen2_vl.Qwen2VLForConditionalGeneration"),
    (TEXT_ENCODER, "qwen2_5_vl", f"{_T}.qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VLForConditionalGeneration"),
    (TEXT_ENCODER, "qwen2_5_vl", f"{_T}.qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VLTextModel"),
    (TEXT_ENCODER, "qwen3", f"{_T}.qwen3.modeling_qwen3.Qwen3Model"),
    (TEXT_ENCODER, "qwen3", f"{_T}.qwen3.modeling_qwen3.Qwen3ForCausalLM"),
    (TEXT_ENCODER, "qwen3_vl", f"{_T}.qwen3_vl.modeling_qwen3_vl.Qwen3VLModel"),
    (TEXT_ENCODER, "qwen3_vl", f"{_T}.qwen3_vl.modeling_qwen3_vl.Qwen3VLForConditionalGeneration"),
    (TEXT_ENCODER, "smollm3", f"{_T}.smollm3.modeling_smollm3.SmolLM3ForCausalLM"),
    (IMAGE_ENCODER, "clip", f"{_T}.clip.modeling_clip.CLIPVisionModel"),
    (IMAGE_ENCODER, "clip", f"{_T}.clip.modeling_clip.CLIPVisionModelWithProjection"),
    (IMAGE_ENCODER, "siglip", f"{_T}.siglip.modeling_siglip.SiglipVisionModel"),
    (VAE, "autoencoder_kl", f"{_D}.autoencoder_kl.AutoencoderKL"),
    (VAE, "autoencoder_dc", f"{_D}.autoencoder_dc.AutoencoderDC"),
    (VAE, "allegro", f"{_D}.autoencoder_kl_allegro.AutoencoderKLAllegro"),
    (VAE, "cogvideox", f"{_D}.autoencoder_kl_cogvideox.AutoencoderKLCogVideoX"),
    (VAE, "cosmos", f"{_D}.autoencoder_kl_cosmos.AutoencoderKLCosmos"),
    (VAE, "flux2", f"{_D}.autoencoder_kl_flux2.AutoencoderKLFlux2"),
    (VAE, "hunyuan_video", f"{_D}.autoencoder_kl_hunyuan_video.AutoencoderKLHunyuanVideo"),
    (VAE, "hunyuan_image", f"{_D}.autoencoder_kl_hunyuanimage.AutoencoderKLHunyuanImage"),
    (VAE, "hunyuan_video15", f"{_D}.autoencoder_kl_hunyuanvideo15.AutoencoderKLHunyuanVideo15"),
    (VAE, "ltx", f"{_D}.autoencoder_kl_ltx.AutoencoderKLLTXVideo"),
    (VAE, "ltx2", f"{_D}.autoencoder_kl_ltx2.AutoencoderKLLTX2Video"),
    (VAE, "magvit", f"{_D}.autoencoder_kl_magvit.AutoencoderKLMagvit"),
    (VAE, "mochi", f"{_D}.autoencoder_kl_mochi.AutoencoderKLMochi"),
    (VAE, "qwenimage", f"{_D}.autoencoder_kl_qwenimage.AutoencoderKLQwenImage"),
    (VAE, "qwenimage21", f"{_D}.autoencoder_kl_qwenimage21.AutoencoderKLQwenImage21"),
    (VAE, "wan", f"{_D}.autoencoder_kl_wan.AutoencoderKLWan"),
)

for _kind, _arch, _name in _KNOWN:
    register_component(ComponentEntry(class_name=_name, kind=_kind, architecture=_arch))
