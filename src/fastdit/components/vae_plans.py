"""The VAE-parallel plans, keyed by exact VAE class (fully qualified name; no prefix or ``isinstance`` matching).

A plan says what a band decode of that class needs beyond plain ``Conv2d``/``Conv3d`` halos and ``GroupNorm``
reductions (which the engine finds itself): modules that pad inside their ``forward`` (with their halo), softmax
and linear attention modules, and how many image rows one latent row covers (encoder bands are whole multiples).
A VAE class without a plan here is refused by ``Parallel(vae=True)``, naming the class.
"""

from __future__ import annotations

import torch

from fastdit.components.vae_parallel import HaloSpec, VaePlan, frame_causal_mask
from fastdit.parallel.plan import TokenSum

__all__ = ["VAE_PLANS", "plan_for"]

_D = "diffusers.models"
_AE = f"{_D}.autoencoders"
_ATTENTION = f"{_D}.attention_processor.Attention"
# Pads (0, 1, 0, 1) before a 3 x 3 stride-2 convolution with no padding of its own: one row below, stride 2.
_DOWNSAMPLE_2D = {f"{_D}.downsampling.Downsample2D": HaloSpec(radius=1, stride=2)}


def _levels_factor(vae: torch.nn.Module) -> int:
    """Image rows per latent row of a VAE that halves the resolution between consecutive levels."""
    return 2 ** (len(vae.config.block_out_channels) - 1)


def _compression(vae: torch.nn.Module) -> int:
    """Image rows per latent row, as the VAE states it."""
    return int(vae.spatial_compression_ratio)


def _config_compression(vae: torch.nn.Module) -> int:
    return int(vae.config.spatial_compression_ratio)


def _causal_conv(module: torch.nn.Module) -> HaloSpec:
    """A causal 3-D convolution that zero-pads its rows itself (``_padding``: w, w, h, h, t, 0) before a
    ``padding=0`` convolution."""
    return HaloSpec(radius=module._padding[2], stride=module.stride[-2])


def _resample(module: torch.nn.Module) -> HaloSpec | None:
    """A Wan-style resampler: downsampling pads (0, 1, 0, 1) before a 3 x 3 stride-2 convolution (hooked as a
    whole, so the halo arrives before the pad); upsampling is nearest then a plain convolution (walked)."""
    return HaloSpec(radius=1, stride=2) if module.mode.startswith("downsample") else None


def _padded_conv(module: torch.nn.Module, pad_rows: int, conv: torch.nn.Module) -> HaloSpec:
    """A convolution whose wrapper pads ``pad_rows`` rows on either side before it (on top of its own padding)."""
    pad = pad_rows + conv.padding[-2]
    reach = conv.dilation[-2] * (conv.kernel_size[-2] - 1)
    return HaloSpec(radius=max(pad, reach - pad), stride=conv.stride[-2])


def _hunyuan_causal_conv(module: torch.nn.Module) -> HaloSpec:
    """HunyuanVideo's causal convolution pads ``time_causal_padding`` (w, w, h, h, t, 0), replicate, in forward."""
    return _padded_conv(module, module.time_causal_padding[2], module.conv)


def _cosmos_causal_conv(module: torch.nn.Module) -> HaloSpec:
    """Cosmos' causal convolution (a ``Conv3d`` subclass) pads ``spatial_pad`` rows itself in forward."""
    return _padded_conv(module, module.spatial_pad[2], module)


def _cosmos_downsample(module: torch.nn.Module) -> HaloSpec | None:
    """Cosmos' downsampler pads (0, 1, 0, 1) before a 3 x 3 stride-2 convolution and a 2 x 2 average pool: one row
    below, stride 2. A temporal-only one mixes no rows (its children are walked)."""
    return HaloSpec(radius=1, stride=2) if module.spatial_downsample else None


def _cosmos_temporal(module: torch.nn.Module) -> bool:
    """Cosmos' temporal attention attends along frames within each pixel (pixels folded into the batch)."""
    return type(module.processor).__name__ == "CosmosTemporalAttentionProcessor2_0"


def _linear_kernel(module: torch.nn.Module, rows: list[int], x: torch.Tensor) -> str | None:
    """The multiscale attention runs linear attention only above ``attention_head_dim`` tokens, counted on the
    band: every band must be above it, or a band would run the quadratic kernel the full image does not."""
    fewest = min(rows) * x.shape[-1]
    if fewest > module.attention_head_dim:
        return None
    return (
        f"a band holds {fewest} tokens, not more than attention_head_dim={module.attention_head_dim}: it would run "
        "quadratic instead of linear attention; use fewer ranks or a larger image"
    )


def _decoder_tile(vae: torch.nn.Module, shape: torch.Size) -> tuple[int, ...]:
    factor = _levels_factor(vae)
    return (shape[0], vae.decoder.conv_out.out_channels, shape[2] * factor, shape[3] * factor)


def _encoder_tile(vae: torch.nn.Module, shape: torch.Size) -> tuple[int, ...]:
    factor = _levels_factor(vae)  # each stride-2 level floors: rows // 2 ** levels
    return (shape[0], vae.encoder.conv_out.out_channels, shape[2] // factor, shape[3] // factor)


def _allegro_decoder_tile(vae: torch.nn.Module, shape: torch.Size) -> tuple[int, ...]:
    rt, rs = vae.config.temporal_compression_ratio, vae.spatial_compression_ratio
    channels = vae.decoder.conv_out.out_channels
    return (shape[0], channels, shape[2] * rt, shape[3] * rs, shape[4] * rs)


def _allegro_encoder_tile(vae: torch.nn.Module, shape: torch.Size) -> tuple[int, ...]:
    rt, rs = vae.config.temporal_compression_ratio, vae.spatial_compression_ratio
    channels = vae.encoder.conv_out.out_channels
    return (shape[0], channels, shape[2] // rt, shape[3] // rs, shape[4] // rs)


_KL_LIKE = {
    "encode_unit": _levels_factor,
    "halo_modules": _DOWNSAMPLE_2D,
    "attention": (_ATTENTION,),
    "notes": "3 x 3 convolutions (halo 1), Downsample2D (halo 2, stride 2), GroupNorm, mid-block softmax attention.",
}


def _wan_like(prefix: str) -> VaePlan:
    return VaePlan(
        encode_unit=_compression,
        halo_modules={f"{prefix}CausalConv3d": _causal_conv, f"{prefix}Resample": _resample},
        attention=(f"{prefix}AttentionBlock",),
        norms=(),
        notes=(
            "Causal 3-D convolutions pad inside forward and take the cache of earlier frames: both tensors get the "
            "halo; per-frame attention gathers keys; RMS norms over channels are local; no GroupNorm."
        ),
    )


# --- LTX, LTX-2, CogVideoX, Mochi ---

_COG = f"{_AE}.autoencoder_kl_cogvideox"
_MOCHI = f"{_AE}.autoencoder_kl_mochi"


def _ltx_like(prefix: str) -> VaePlan:
    """LTX-Video and LTX-2: the causal convolutions pad frames by repeating the first (or last) frame and leave the
    rows to their inner ``Conv3d`` (walked: any ``padding_mode``, since interior padding lands only in cropped rows)."""
    return VaePlan(
        encode_unit=_compression,
        band_noise=(f"{prefix}ResnetBlock3d",),
        norms=(),
        notes=(
            "Causal 3-D convolutions pad frames only (their inner Conv3d pads rows: halo 1, stride 2 in the "
            "downsamplers; zeros or reflect padding); pixel-(un)shuffle resamplers and patchify whole multiples of "
            "the band unit; per-pixel RMS and LayerNorm over channels; timestep conditioning per sample; the "
            "decoder's injected noise is drawn for the whole image and cut to the band; no GroupNorm, no attention."
        ),
    )


def _mochi_conv(module: torch.nn.Module) -> HaloSpec:
    """Mochi's causal convolutions replicate-pad rows inside ``forward`` before a ``padding=0`` convolution: the
    halo arrives before the pad (hooked as a whole; its cache is ``None`` in this mode)."""
    return HaloSpec(radius=module.height_pad, stride=module.conv.stride[-2])


def _mochi_pad_mode(module: torch.nn.Module) -> str | None:
    if module.pad_mode == "replicate":
        return None
    return (
        f"pad_mode={module.pad_mode!r} (framewise decoding switches the causal convolutions to it, whose inner "
        "convolutions then pad no rows at all); decode without framewise decoding"
    )


def _mochi_attention(module: torch.nn.Module) -> str | None:
    """Mochi's VAE attention runs over the frames of each pixel (tokens are frames): row-local with its processor."""
    from diffusers.models.attention_processor import MochiVaeAttnProcessor2_0

    if isinstance(getattr(module, "processor", None), MochiVaeAttnProcessor2_0):
        return None
    return f"attention processor {type(module.processor).__name__}, not MochiVaeAttnProcessor2_0 (per pixel)"


def _mochi_call_checks(module: torch.nn.Module, rows: list[int], x: torch.Tensor) -> str | None:
    """The walk-time checks again at call time: framewise decoding or a processor set after ``accelerate``."""
    return _mochi_pad_mode(module) if hasattr(module, "pad_mode") else _mochi_attention(module)


def _per_pixel(module: torch.nn.Module) -> bool:
    """Mochi's VAE attention runs over the frames of each pixel (checked at every call by its band check)."""
    return True


_MOCHI_PLAN = VaePlan(
    encode_unit=_compression,
    halo_modules={f"{_COG}.CogVideoXCausalConv3d": _mochi_conv},
    row_local={_ATTENTION: _per_pixel},
    band_checks={f"{_COG}.CogVideoXCausalConv3d": _mochi_call_checks, _ATTENTION: _mochi_call_checks},
    refuse={f"{_COG}.CogVideoXCausalConv3d": _mochi_pad_mode, _ATTENTION: _mochi_attention},
    notes=(
        "Replicate-padding causal 3-D convolutions (hooked whole: halo 1; the stride-2 patch convolutions of the "
        "encoder need none, only aligned bands); GroupNorm per frame (MochiChunkedGroupNorm3D) reduced over ranks; "
        "attention over the frames of each pixel is row-local; linear unpatchify up-blocks."
    ),
)


VAE_PLANS: dict[str, VaePlan] = {
    f"{_AE}.autoencoder_kl.AutoencoderKL": VaePlan(
        **_KL_LIKE, tiled={"decode": ("decoder", _decoder_tile), "encode": ("encoder", _encoder_tile)}
    ),
    f"{_AE}.autoencoder_kl_flux2.AutoencoderKLFlux2": VaePlan(**_KL_LIKE),
    f"{_AE}.autoencoder_dc.AutoencoderDC": VaePlan(
        encode_unit=_compression,
        linear_attention={f"{_D}.attention_processor.SanaMultiscaleLinearAttention": (TokenSum(torch.matmul, 0),)},
        band_checks={f"{_D}.attention_processor.SanaMultiscaleLinearAttention": _linear_kernel},
        norms=(),
        notes="Linear attention sums its value-key products over the ranks; pixel (un)shuffles and RMS norms local.",
    ),
    f"{_AE}.autoencoder_kl_hunyuanimage.AutoencoderKLHunyuanImage": VaePlan(
        encode_unit=_config_compression,
        attention=(f"{_AE}.autoencoder_kl_hunyuanimage.HunyuanImageAttentionBlock",),
        notes="Pixel-(un)shuffle resamplers after stride-1 convolutions; GroupNorm; single-head softmax attention.",
    ),
    f"{_AE}.autoencoder_kl_wan.AutoencoderKLWan": _wan_like(f"{_AE}.autoencoder_kl_wan.Wan"),
    f"{_AE}.autoencoder_kl_qwenimage.AutoencoderKLQwenImage": _wan_like(f"{_AE}.autoencoder_kl_qwenimage.QwenImage"),
    # --- LTX, LTX-2, CogVideoX, Mochi ---
    f"{_AE}.autoencoder_kl_ltx.AutoencoderKLLTXVideo": _ltx_like(f"{_AE}.autoencoder_kl_ltx.LTXVideo"),
    f"{_AE}.autoencoder_kl_ltx2.AutoencoderKLLTX2Video": _ltx_like(f"{_AE}.autoencoder_kl_ltx2.LTX2Video"),
    f"{_COG}.AutoencoderKLCogVideoX": VaePlan(
        encode_unit=_levels_factor,
        # Plain Conv3d but for splitting very large inputs along frames: rows are untouched.
        local_convs=(f"{_COG}.CogVideoXSafeConv3d",),
        # Pads (0, 1, 0, 1) before a 3 x 3 stride-2 convolution with no padding of its own.
        halo_modules={f"{_D}.downsampling.CogVideoXDownsample3D": HaloSpec(radius=1, stride=2)},
        notes=(
            "Causal 3-D convolutions (walked: they pad frames from their cache of earlier frames, their inner "
            "CogVideoXSafeConv3d pads rows, so the halo covers cache and frames together); the downsampler's "
            "(0, 1, 0, 1) pad; GroupNorm, in the decoder's spatial norms too; the spatial norm's nearest "
            "interpolation of the latent is by powers of two (2x upsamplers), so row-local; frame batches with "
            "conv caches run the same loop on every rank."
        ),
    ),
    f"{_MOCHI}.AutoencoderKLMochi": _MOCHI_PLAN,
    # --- HunyuanVideo, HunyuanVideo 1.5, Allegro, Cosmos, Magvit, Qwen-Image 2.1 ---
    f"{_AE}.autoencoder_kl_hunyuan_video.AutoencoderKLHunyuanVideo": VaePlan(
        encode_unit=_compression,
        halo_modules={f"{_AE}.autoencoder_kl_hunyuan_video.HunyuanVideoCausalConv3d": _hunyuan_causal_conv},
        attention=(_ATTENTION,),
        attention_masks={_ATTENTION: frame_causal_mask},
        notes=(
            "Causal 3-D convolutions replicate-pad inside forward (halo before the pad); GroupNorm; the mid-block "
            "attention's frame-causal mask is rebuilt for the gathered keys; framewise decoding runs the same "
            "frame loop on every rank."
        ),
    ),
    f"{_AE}.autoencoder_kl_hunyuanvideo15.AutoencoderKLHunyuanVideo15": VaePlan(
        encode_unit=_compression,
        halo_modules={f"{_AE}.autoencoder_kl_hunyuanvideo15.HunyuanVideo15CausalConv3d": _hunyuan_causal_conv},
        attention=(f"{_AE}.autoencoder_kl_hunyuanvideo15.HunyuanVideo15AttnBlock",),
        attention_masks={f"{_AE}.autoencoder_kl_hunyuanvideo15.HunyuanVideo15AttnBlock": frame_causal_mask},
        norms=(),
        notes=(
            "Causal 3-D convolutions as HunyuanVideo; pixel-(un)shuffle resamplers and RMS norms over channels are "
            "local; the mid-block attention's frame-causal mask is rebuilt for the gathered keys; no GroupNorm."
        ),
    ),
    f"{_AE}.autoencoder_kl_cosmos.AutoencoderKLCosmos": VaePlan(
        encode_unit=_config_compression,
        halo_modules={
            f"{_AE}.autoencoder_kl_cosmos.CosmosCausalConv3d": _cosmos_causal_conv,
            f"{_AE}.autoencoder_kl_cosmos.CosmosDownsample3d": _cosmos_downsample,
        },
        attention=(f"{_AE}.autoencoder_kl_cosmos.CosmosCausalAttention",),
        row_local={f"{_AE}.autoencoder_kl_cosmos.CosmosCausalAttention": _cosmos_temporal},
        notes=(
            "Causal 3-D convolutions pad inside forward; the downsampler pads (0, 1, 0, 1) before a stride-2 "
            "convolution and pool (halo 2, stride 2); per-frame GroupNorm reduced per frame; spatial attention "
            "gathers keys, temporal attention (along frames, per pixel) is local; the Haar patcher's stride-2 "
            "filters stay inside bands that are whole patches (encoder bands are multiples of the compression)."
        ),
    ),
    f"{_AE}.autoencoder_kl_magvit.AutoencoderKLMagvit": VaePlan(
        encode_unit=_compression,
        halo_modules={f"{_AE}.autoencoder_kl_magvit.EasyAnimateDownsampler3D": HaloSpec(radius=1, stride=2)},
        local_convs=(f"{_AE}.autoencoder_kl_magvit.EasyAnimateCausalConv3d",),
        notes=(
            "Causal convolutions pad rows as plain convolutions (their frame cache keeps the haloed rows, the same "
            "on every call); the downsampler pads (0, 1, 0, 1) before a stride-2 convolution; per-frame GroupNorm; "
            "frame-batched encode and decode run the same loop on every rank."
        ),
    ),
    f"{_AE}.autoencoder_kl_allegro.AutoencoderKLAllegro": VaePlan(
        encode_unit=_levels_factor,
        halo_modules=_DOWNSAMPLE_2D,
        attention=(_ATTENTION,),
        tiled={"decode": ("decoder", _allegro_decoder_tile), "encode": ("encoder", _allegro_encoder_tile)},
        notes=(
            "diffusers implements only tiled decode and encode (untiled they raise NotImplementedError): with "
            "use_tiling=True its 3-D tiles are spread over the ranks, equal to the one-device tiled call. The band "
            "plan (2-D resnets, Downsample2D, per-frame attention, temporal convolutions one row tall) is walked "
            "but not reached."
        ),
    ),
    f"{_AE}.autoencoder_kl_qwenimage21.AutoencoderKLQwenImage21": VaePlan(
        encode_unit=_compression,
        halo_modules={
            f"{_AE}.autoencoder_kl_qwenimage21.QwenImage21CausalConv3d": _causal_conv,
            f"{_AE}.autoencoder_kl_qwenimage21.QwenImage21Resample": _resample,
        },
        attention=(f"{_AE}.autoencoder_kl_qwenimage21.QwenImage21AttentionBlock",),
        norms=(),
        notes=(
            "As Qwen-Image, but its causal convolution is 2-D (one frame, no cache; zero padding inside forward); "
            "residual blocks' average-pool and duplicate shortcuts and the patchify are local in whole-unit bands."
        ),
    ),
}
"""Plans by fully qualified VAE class name."""


def plan_for(vae: torch.nn.Module) -> VaePlan | None:
    """The plan of exactly ``type(vae)`` (``None`` if there is none)."""
    cls = type(vae)
    return VAE_PLANS.get(f"{cls.__module__}.{cls.__qualname__}")
