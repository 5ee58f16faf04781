"""VAE parallelism: every covered VAE class decodes (and encodes) over 2 and 3 ranks exactly as on one process.

Each case runs once per pool: one worker call decodes, encodes, undoes and decodes again, so the added time stays
small. The references are the VAE's own untiled single-process calls, computed here.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch

import fastdit
from fastdit.components.vae_parallel import VaeParallelError, band_sizes, check_vae
from fastdit.components.vae_plans import VAE_PLANS, plan_for
from fastdit.errors import ArgumentError
from fastdit.testing.distributed import get_pool

TOLERANCE = 1e-4
_VIDEO_VAES = "fastdit.testing.components.video_vaes"

# name -> (builder module, builder, kwargs, latent shape, image shape or None)
CASES: dict[str, tuple[str, str, dict, tuple[int, ...], tuple[int, ...] | None]] = {
    "AutoencoderKL": (
        "fastdit.testing.components.autoencoder_kl",
        "autoencoder_kl",
        {"num_levels": 3},
        (1, 4, 11, 7),
        (1, 3, 48, 20),
    ),
    "AutoencoderKLFlux2": ("fastdit.models.flux2", "tiny_vae", {}, (1, 4, 10, 6), (1, 3, 24, 12)),
    "AutoencoderDC": ("fastdit.models.sana", "tiny_vae", {}, (1, 4, 10, 6), (1, 3, 24, 12)),
    "AutoencoderKLHunyuanImage": ("fastdit.models.hunyuan_image", "tiny_vae", {}, (1, 16, 10, 6), (1, 3, 24, 12)),
    "AutoencoderKLWan": (
        "fastdit.testing.components.autoencoder_kl_wan",
        "autoencoder_kl_wan",
        {},
        (1, 16, 2, 7, 5),
        (1, 3, 5, 48, 24),
    ),
    "AutoencoderKLQwenImage": (
        "fastdit.testing.components.autoencoder_kl_qwenimage",
        "autoencoder_kl_qwenimage",
        {},
        (1, 4, 1, 7, 5),
        (1, 3, 1, 48, 24),
    ),
    # --- LTX, LTX-2, CogVideoX, Mochi ---
    "AutoencoderKLLTXVideo": (
        "fastdit.testing.components.autoencoder_kl_ltx",
        "autoencoder_kl_ltx_video",
        {"timestep_conditioning": True, "inject_noise": True},
        (1, 8, 2, 4, 2),
        (1, 3, 9, 24, 16),
    ),
    "AutoencoderKLLTX2Video": (
        "fastdit.testing.components.autoencoder_kl_ltx",
        "autoencoder_kl_ltx2_video",
        {"inject_noise": True},
        (1, 4, 2, 5, 2),
        (1, 3, 9, 24, 16),
    ),
    "AutoencoderKLCogVideoX": (
        "fastdit.testing.components.autoencoder_kl_cogvideox",
        "autoencoder_kl_cogvideox",
        {"frame_batches": (1, 4)},  # two batches each way: the conv caches carry band rows between them
        (1, 4, 2, 5, 3),
        (1, 3, 9, 12, 8),
    ),
    "AutoencoderKLMochi": (
        "fastdit.testing.components.autoencoder_kl_mochi",
        "autoencoder_kl_mochi",
        {},
        (1, 4, 2, 7, 4),
        (1, 3, 12, 48, 16),
    ),
    # --- HunyuanVideo, HunyuanVideo 1.5, Allegro, Cosmos, Magvit, Qwen-Image 2.1 ---
    "AutoencoderKLHunyuanVideo": (
        "fastdit.testing.components.autoencoder_kl_hunyuan_video",
        "autoencoder_kl_hunyuan_video",
        {},
        (1, 4, 5, 3, 2),  # more than 4 latent (16 image) frames: the framewise decode and encode loops run
        (1, 3, 17, 24, 16),
    ),
    "AutoencoderKLHunyuanVideo15": (
        _VIDEO_VAES,
        "autoencoder_kl_hunyuanvideo15",
        {},
        (1, 4, 2, 6, 4),
        (1, 3, 3, 24, 16),
    ),
    "AutoencoderKLCosmos": (_VIDEO_VAES, "autoencoder_kl_cosmos", {}, (1, 4, 2, 3, 2), (1, 3, 5, 24, 16)),
    "AutoencoderKLMagvit": (_VIDEO_VAES, "autoencoder_kl_magvit", {}, (1, 4, 3, 6, 4), (1, 3, 5, 24, 16)),
    "AutoencoderKLQwenImage21": (_VIDEO_VAES, "autoencoder_kl_qwenimage21", {}, (1, 4, 1, 3, 2), (1, 3, 1, 24, 16)),
    "AutoencoderKLAllegro": (_VIDEO_VAES, "autoencoder_kl_allegro", {}, (1, 4, 2, 6, 6), (1, 3, 4, 12, 12)),
}
# Classes whose diffusers decode and encode run by tiles only (untiled they raise NotImplementedError): tested
# tiled, against the one-process tiled call.
TILED_ONLY = {"AutoencoderKLAllegro"}


def _build(name: str) -> torch.nn.Module:
    module, builder, kwargs, _, _ = CASES[name]
    return getattr(importlib.import_module(module), builder)(**kwargs)


def _inputs(name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    _, _, _, latent, image = CASES[name]
    generator = torch.Generator().manual_seed(0)
    z = torch.randn(latent, generator=generator)
    x = None if image is None else torch.rand(image, generator=generator) * 2 - 1
    return z, x


def _calls(vae: torch.nn.Module, z: torch.Tensor, x: torch.Tensor | None) -> dict[str, torch.Tensor]:
    # A timestep-conditioned decoder (LTX) takes the decode timestep; decoders injecting noise draw from the global
    # RNG, seeded alike before each call here and in the reference.
    extra = (torch.full((z.shape[0],), 0.05),) if getattr(vae.config, "timestep_conditioning", False) else ()
    with torch.no_grad():
        torch.manual_seed(0)
        out = {"decode": vae.decode(z, *extra).sample}
        torch.manual_seed(0)
        out["decode_tuple"] = vae.decode(z, *extra, return_dict=False)[0]
        if x is not None:
            encoded = vae.encode(x)
            if hasattr(getattr(encoded, "latent_dist", None), "mean"):
                out["mean"], out["logvar"] = encoded.latent_dist.mean, encoded.latent_dist.logvar
            elif hasattr(encoded, "latent_dist"):  # an identity posterior (Cosmos)
                out["latent"] = encoded.latent_dist.mode()
            else:  # a deterministic encoder (DC-AE)
                out["latent"] = encoded.latent
    return out


def _leftovers(vae: torch.nn.Module) -> list[str]:
    """Hooks or instance attributes still on the VAE (none after the undo)."""
    found = [f"vae.{name}" for name in ("decode", "encode") if name in vae.__dict__]
    for path, module in vae.named_modules():
        if module._forward_pre_hooks or module._forward_hooks or "forward" in module.__dict__:
            found.append(path)
    return found


def _banded(rank: int, world_size: int, name: str) -> dict[str, Any]:
    from fastdit.components.vae_parallel import apply_vae_parallel

    vae = _build(name)
    z, x = _inputs(name)
    extra = (torch.full((z.shape[0],), 0.05),) if getattr(vae.config, "timestep_conditioning", False) else ()
    with torch.no_grad():
        torch.manual_seed(0)
        before = vae.decode(z, *extra).sample
    applied = apply_vae_parallel(vae, plan_for(vae), None)
    try:
        out = _calls(vae, z, x)
    finally:
        applied.undo()
    with torch.no_grad():
        torch.manual_seed(0)
        after = vae.decode(z, *extra).sample
    return {"out": out, "undone": torch.equal(before, after), "left": _leftovers(vae), "stats": applied.state.stats()}


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", [name for name in CASES if name not in TILED_ONLY])
def test_band_decode_and_encode_equal_one_process(world: int, name: str) -> None:
    vae = _build(name)
    expected = _calls(vae, *_inputs(name))
    for result in get_pool(world).run(_banded, name, timeout=240):
        assert result["undone"], "the VAE decodes differently after the undo"
        assert not result["left"], f"left behind: {result['left']}"
        assert result["stats"]["halo_exchanges"] > 0 and result["stats"]["calls"]["decode"] == 2
        if CASES[name][2].get("inject_noise"):  # the decoder's noise was drawn for the whole image
            assert result["stats"]["noise_draws"] > 0
        for key, value in expected.items():
            err = (result["out"][key] - value).abs().max().item()
            assert err <= TOLERANCE, f"{name} {key} on {world} ranks: max abs error {err:.2e}"


def _tiled(rank: int, world_size: int, name: str) -> dict[str, Any]:
    from fastdit.components.vae_parallel import apply_vae_parallel

    vae = _build(name)
    vae.enable_tiling()
    applied = apply_vae_parallel(vae, plan_for(vae), None)
    try:
        out = _calls(vae, *_inputs(name))
    finally:
        applied.undo()
    return {"out": out, "left": _leftovers(vae), "stats": applied.state.stats()}


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", ["AutoencoderKL"])
def test_tiles_spread_over_ranks_equal_the_tiled_call(world: int, name: str) -> None:
    vae = _build(name)
    untiled = _calls(vae, *_inputs(name))
    vae.enable_tiling()
    expected = _calls(vae, *_inputs(name))
    # Tiles see only their part of the image: the tiled call is not the exact one, which is why bands exist.
    assert (expected["decode"] - untiled["decode"]).abs().max().item() > 1e-2
    for result in get_pool(world).run(_tiled, name, timeout=240):
        assert not result["left"], f"left behind: {result['left']}"
        assert result["stats"]["tiles_spread"] > 2 * world
        for key, value in expected.items():
            err = (result["out"][key] - value).abs().max().item()
            assert err <= TOLERANCE, f"{name} tiled {key} on {world} ranks: max abs error {err:.2e}"


def _framewise_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """Three latent frames (17 video frames): more than LTX's default frame tile of 2 latent (16 video) frames."""
    generator = torch.Generator().manual_seed(0)
    return torch.randn(1, 8, 3, 4, 2, generator=generator), torch.rand(1, 3, 17, 24, 16, generator=generator) * 2 - 1


def _framewise_banded(rank: int, world_size: int, name: str) -> dict[str, Any]:
    from fastdit.components.vae_parallel import apply_vae_parallel

    vae = _build(name)
    vae.use_framewise_decoding = True
    applied = apply_vae_parallel(vae, plan_for(vae), None)
    try:
        return _calls(vae, *_framewise_inputs())
    finally:
        applied.undo()


@pytest.mark.distributed
def test_framewise_decoding_runs_the_same_frame_tiles_on_every_rank() -> None:
    # LTX decodes (and encodes) overlapping frame tiles blended in time: every rank runs the VAE's own frame loop
    # on its band, so each tile's halos and noise draws pair up and the result is the one-process framewise call.
    name = "AutoencoderKLLTXVideo"
    vae = _build(name)
    whole = _calls(vae, *_framewise_inputs())
    vae.use_framewise_decoding = True
    expected = _calls(vae, *_framewise_inputs())
    assert (expected["decode"] - whole["decode"]).abs().max().item() > 1e-2  # the frame tiles did run
    for out in get_pool(2).run(_framewise_banded, name, timeout=240):
        for key, value in expected.items():
            err = (out[key] - value).abs().max().item()
            assert err <= TOLERANCE, f"{name} framewise {key}: max abs error {err:.2e}"


def test_every_plan_has_a_case() -> None:
    names = {key.rsplit(".", 1)[1] for key in VAE_PLANS}
    assert names == set(CASES)


def test_unsynchronised_bands_differ() -> None:
    # What a split without halos and shared statistics gives: each band decoded on its own. It must be far off, or
    # the equality tests above would prove nothing.
    vae = _build("AutoencoderKL")
    z, _ = _inputs("AutoencoderKL")
    with torch.no_grad():
        whole = vae.decode(z).sample
        bands = torch.cat([vae.decode(part).sample for part in z.split(list(band_sizes(z.shape[-2], 2)), -2)], -2)
    assert (bands - whole).abs().max().item() > 1e-2


def test_band_sizes() -> None:
    assert band_sizes(11, 3) == (4, 4, 3)
    assert band_sizes(48, 3, 8) == (16, 16, 16)
    assert band_sizes(40, 3, 8) == (16, 16, 8)
    with pytest.raises(VaeParallelError, match="not a multiple of the band unit 8"):
        band_sizes(44, 2, 8)
    with pytest.raises(VaeParallelError, match=r"2 rows .* cannot give each of 3 ranks a band"):
        band_sizes(2, 3)


def test_refusals_before_anything_is_touched() -> None:
    from fastdit.components import walk
    from fastdit.components.vae_technique import VaeParallel
    from fastdit.context import Request
    from fastdit.testing.pipelines import build_tiny

    pipe, _ = build_tiny("flux")
    with pytest.raises(ArgumentError, match=r"vae=True splits the VAE's decode over the ranks .* has one"):
        fastdit.accelerate(pipe, parallel=fastdit.Parallel(vae=True))
    technique, request = VaeParallel(), Request(parallel=fastdit.Parallel(ulysses=2, vae=True))
    pipe.vae.enable_tiling()  # spread over the ranks tile by tile
    technique.check(request, walk(pipe))
    wan = _build("AutoencoderKLWan")
    wan.enable_tiling()
    with pytest.raises(ValueError, match=r"AutoencoderKLWan.use_tiling=True: tiled decoding is not split"):
        check_vae(wan, plan_for(wan))
    with pytest.raises(ArgumentError, match="has no VAE"):
        technique.check(request, walk(pipe.transformer))
    assert not _leftovers(pipe.vae)


def test_a_vae_without_a_plan_is_refused_naming_its_class(monkeypatch: pytest.MonkeyPatch) -> None:
    from fastdit.components import walk
    from fastdit.components.vae_technique import VaeParallel
    from fastdit.context import Request
    from fastdit.errors import UnavailableError
    from fastdit.testing.pipelines import build_tiny

    pipe, _ = build_tiny("ltx")
    cls = type(pipe.vae)
    monkeypatch.delitem(VAE_PLANS, f"{cls.__module__}.{cls.__qualname__}")  # as a class without a plan
    request = Request(parallel=fastdit.Parallel(ulysses=2, vae=True))
    with pytest.raises(UnavailableError, match=r"vae \(diffusers\.models\..*AutoencoderKLLTXVideo\) has no VAE-par"):
        VaeParallel().check(request, walk(pipe))


def test_an_uncovered_module_is_refused() -> None:
    vae = _build("AutoencoderKL")
    vae.decoder.conv_out = torch.nn.ConvTranspose2d(8, 3, 3, padding=1)
    with pytest.raises(ValueError, match=r"decoder.conv_out .*ConvTranspose2d.*: a convolution the VAE's plan"):
        check_vae(vae, plan_for(vae))


def _too_small(rank: int, world_size: int) -> str:
    from fastdit.components.vae_parallel import apply_vae_parallel

    vae = _build("AutoencoderDC")
    applied = apply_vae_parallel(vae, plan_for(vae), None)
    try:
        with torch.no_grad():
            vae.decode(torch.randn(1, 4, 3, 2))  # one row of 2 tokens per band: fewer than attention_head_dim
    except VaeParallelError as error:
        return str(error)
    finally:
        applied.undo()
    return "no error"


@pytest.mark.distributed
def test_a_band_too_small_for_its_attention_raises_on_every_rank() -> None:
    # Every rank computes every band's size, so all of them raise at the same module and none waits for the others.
    messages = get_pool(3).run(_too_small, timeout=120)
    assert all("quadratic instead of linear attention" in m for m in messages), messages


def _pipeline(
    rank: int, world_size: int, layout: dict | None, family: str = "flux", combined: bool = False
) -> dict[str, Any]:
    from fastdit.testing.pipelines import build_tiny, run_tiny

    pipe, tiny = build_tiny(family)
    # combined: a step cache serving steps 1-2 from the cache and compiled blocks beside the parallel layout.
    mask = fastdit.StepMask(compute_steps=(0,), policy="static")
    cache = fastdit.DBCache(fn=1, bn=0, warmup_steps=0, step_mask=mask) if combined else None
    compile_ = fastdit.Compile(backend="eager") if combined else None
    fastdit.accelerate(
        pipe, parallel=None if layout is None else fastdit.Parallel(**layout), cache=cache, compile=compile_
    )
    try:
        out = run_tiny(pipe, tiny, num_inference_steps=3) if combined else run_tiny(pipe, tiny)
        stats = fastdit.summary(pipe).vaes
    finally:
        fastdit.disable(pipe)
    return {"out": out, "stats": stats, "left": _leftovers(pipe.vae)}


@pytest.mark.distributed
def test_pipeline_with_context_and_vae_parallelism_equals_one_process() -> None:
    expected = _pipeline(0, 1, None)["out"]
    for result in get_pool(2).run(_pipeline, {"ulysses": 2, "vae": True}, timeout=240):
        assert abs(result["out"] - expected).max() <= TOLERANCE
        assert result["stats"]["vae"]["calls"] == {"decode": 1}
        assert result["stats"]["vae"]["ranks"] == 2
        assert not result["left"]


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("family", "layout"),
    [
        ("flux", {"tp": 2, "text_encoder": True, "vae": True}),
        ("sd3", {"cfg": 2, "vae": True}),  # batched CFG: the VAE still decodes over both CFG ranks
    ],
    ids=["flux-tp2-tep-vae", "sd3-cfg2-vae"],
)
def test_vae_parallelism_with_the_other_techniques_equals_one_process(family: str, layout: dict) -> None:
    expected = _pipeline(0, 1, None, family, combined=True)["out"]
    for result in get_pool(2).run(_pipeline, layout, family, True, timeout=240):
        assert abs(result["out"] - expected).max() <= TOLERANCE
        assert result["stats"]["vae"]["calls"] == {"decode": 1} and result["stats"]["vae"]["ranks"] == 2
        assert not result["left"]


def test_mochi_framewise_decoding_and_other_attention_processors_are_refused() -> None:
    from diffusers.models.attention_processor import AttnProcessor2_0

    mochi = _build("AutoencoderKLMochi")
    check_vae(mochi, plan_for(mochi))
    mochi._enable_framewise_decoding()  # its convolutions then pad no rows: not the decode the plan covers
    with pytest.raises(ValueError, match=r"CogVideoXCausalConv3d\): pad_mode='constant' \(framewise decoding"):
        check_vae(mochi, plan_for(mochi))
    mochi = _build("AutoencoderKLMochi")
    mochi.encoder.block_out.attentions[0].set_processor(AttnProcessor2_0())  # not known to be per pixel
    with pytest.raises(ValueError, match=r"attention processor AttnProcessor2_0, not MochiVaeAttnProcessor2_0"):
        check_vae(mochi, plan_for(mochi))


def test_frame_causal_mask_of_the_gathered_keys() -> None:
    # HunyuanVideo's mask over the whole latent, with the key columns reordered as the gather leaves them (rank
    # after rank, each band frame by frame): the rebuilt mask of every band's queries must be that one's rows.
    from diffusers.models.autoencoders.autoencoder_kl_hunyuan_video import prepare_causal_attention_mask

    from fastdit.components.vae_parallel import frame_causal_mask

    frames, width, rows = 3, 2, (2, 1, 2)
    index = torch.arange(frames * sum(rows) * width).reshape(frames, sum(rows), width)
    bands = index.split(list(rows), dim=1)  # token indices of each band, in (frame, row, column) order
    gathered = torch.cat([b.flatten() for b in bands])
    whole = prepare_causal_attention_mask(frames, sum(rows) * width, torch.float32, "cpu", batch_size=2)
    counts = [frames * r * width for r in rows]
    for rank, band in enumerate(bands):
        local = prepare_causal_attention_mask(frames, rows[rank] * width, torch.float32, "cpu", batch_size=2)
        rebuilt = frame_causal_mask(local.unsqueeze(1), counts, rank)
        assert torch.equal(rebuilt[:, 0], whole[:, band.flatten()][:, :, gathered])
        assert torch.equal(frame_causal_mask(local == 0, counts, rank), rebuilt[:, 0] == 0)
    with pytest.raises(VaeParallelError, match="not the frame-causal mask"):
        frame_causal_mask(torch.ones(4, 4).triu().bool(), [4, 4], 0)  # anti-causal: not rebuilt as causal


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", sorted(TILED_ONLY))
def test_tiled_only_vaes_spread_their_tiles_equal_to_one_process(world: int, name: str) -> None:
    vae = _build(name)
    vae.enable_tiling()
    expected = _calls(vae, *_inputs(name))
    for result in get_pool(world).run(_tiled, name, timeout=240):
        assert not result["left"], f"left behind: {result['left']}"
        assert result["stats"]["tiles_spread"] > 2 * world
        for key, value in expected.items():
            err = (result["out"][key] - value).abs().max().item()
            assert err <= TOLERANCE, f"{name} tiled {key} on {world} ranks: max abs error {err:.2e}"
