"""Train the built-in reference pipeline: a small ``FluxPipeline`` that draws scikit-learn's handwritten digits.

Two stages, both seeded:
1. an ``AutoencoderKL`` (scale factor 2, 4 latent channels) learns to reconstruct the 32x32 digits (MSE + a small KL);
   its ``shift_factor``/``scaling_factor`` are then set so the latents the transformer sees have zero mean and unit
   variance, exactly as FluxPipeline undoes them before decoding;
2. a ``FluxTransformer2DModel`` learns rectified flow in that latent space: ``x_t = (1 - s) x0 + s noise``, target
   ``noise - x0``, called with ``timestep=s`` (the pipeline passes ``t / 1000`` = sigma), ``s`` drawn like the sampler's
   schedule (uniform, then the scheduler's shift). 10% of the prompts are empty so the true-CFG branch works.

The text encoders are tiny random frozen CLIP/T5 models: they only need to map the ten prompts (and the empty one)
to distinct embeddings. The whole pipeline is written with ``save_pretrained`` and the training curve as JSON.

    python tools/train_reference.py                   # CPU (slow)
    python tools/train_reference.py --device cuda     # the documented run

fastdit must be importable (the editable install, or ``PYTHONPATH=src``); scikit-learn provides the data.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fastdit.reference import REFERENCE_DEFAULTS, digit_prompt
from fastdit.testing.components.encoders import build, clip_text_model, t5_encoder

ROOT = Path(__file__).resolve().parents[1]
NUM_CLASSES = 10
EMPTY = NUM_CLASSES  # index of the empty prompt among the precomputed text conditions
COMPONENTS = ("transformer", "vae", "text_encoder", "text_encoder_2")
MAX_WEIGHTS_BYTES = 20 * 10**6  # the wheel carries the weights: keep them small


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; every default is the value the shipped weights were trained with."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--device", default="cpu", help="torch device for training (cpu or cuda)")
    a("--seed", type=int, default=0, help="seed for torch, numpy and python RNGs")
    a("--out", type=Path, default=ROOT / "src/fastdit/reference/weights", help="pipeline directory to write")
    a("--log", type=Path, default=ROOT / "docs/reference_training.json", help="training-curve JSON to write")
    a("--size", type=int, default=32, help="image side in pixels (8x8 digits upscaled bicubically)")
    a("--max-shift", type=int, default=1, help="augmentation: random translation in pixels (0 disables)")
    # VAE stage.
    a("--vae-steps", type=int, default=3000, help="VAE optimizer steps")
    a("--vae-batch", type=int, default=128, help="VAE batch size")
    a("--vae-lr", type=float, default=1e-3, help="VAE peak learning rate (AdamW, warm-up then cosine)")
    a("--kl-weight", type=float, default=1e-3, help="weight of the per-element KL term against per-pixel MSE")
    # Transformer stage.
    a("--steps", type=int, default=12000, help="transformer optimizer steps")
    a("--batch", type=int, default=256, help="transformer batch size")
    a("--lr", type=float, default=5e-4, help="transformer peak learning rate (AdamW, warm-up then cosine)")
    a("--warmup", type=int, default=300, help="linear warm-up steps (both stages)")
    a("--weight-decay", type=float, default=0.01, help="AdamW weight decay (both stages)")
    a("--ema", type=float, default=0.999, help="EMA decay of the transformer weights that are saved")
    a("--cfg-dropout", type=float, default=0.1, help="probability of training on the empty prompt")
    a("--shift", type=float, default=3.0, help="FlowMatchEulerDiscreteScheduler shift (training and sampling)")
    a("--hidden", type=int, default=128, help="transformer width (attention heads of 32 channels)")
    a("--double-blocks", type=int, default=2, help="double-stream (MMDiT) blocks")
    a("--single-blocks", type=int, default=6, help="single-stream blocks")
    a("--log-every", type=int, default=100, help="record the mean loss every N steps")
    a("--stop-after", type=int, default=9300, help="end the transformer stage after N steps (LR schedule of --steps)")
    a("--time-limit", type=float, default=None, help="also end it once N seconds have passed (a safety cap)")
    return p.parse_args(argv)


def seed_everything(seed: int) -> None:
    """Seed every RNG the run touches."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# --------------------------------------------------------------------------------------------------------- data ---


def digit_images(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's 1,797 digits as ``(N, 3, size, size)`` RGB in [-1, 1] (white on black) and ``(N,)`` labels."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    small = torch.from_numpy(digits.images.astype(np.float32) / 16.0)[:, None]
    # Bicubic keeps strokes smooth; clamping removes its overshoot so the range stays [0, 1].
    big = F.interpolate(small, size=(size, size), mode="bicubic", align_corners=False).clamp(0.0, 1.0)
    return (big * 2.0 - 1.0).repeat(1, 3, 1, 1), torch.from_numpy(digits.target.astype(np.int64))


def random_shift(images: torch.Tensor, max_shift: int, generator: torch.Generator) -> torch.Tensor:
    """Translate each image by up to ``max_shift`` pixels, filling with the background value (-1)."""
    if max_shift == 0:
        return images
    n, _, h, w = images.shape
    padded = F.pad(images, (max_shift,) * 4, value=-1.0)
    offsets = torch.randint(0, 2 * max_shift + 1, (n, 2), generator=generator, device=images.device)
    rows = (offsets[:, 0, None] + torch.arange(h, device=images.device))[:, None, :, None]
    cols = (offsets[:, 1, None] + torch.arange(w, device=images.device))[:, None, None, :]
    batch = torch.arange(n, device=images.device)[:, None, None, None]
    chans = torch.arange(images.shape[1], device=images.device)[None, :, None, None]
    return padded[batch, chans, rows, cols]


def batches(
    images: torch.Tensor, labels: torch.Tensor, batch: int, max_shift: int, generator: torch.Generator
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless shuffled, augmented mini-batches (epochs reshuffle; a last partial batch is dropped)."""
    n = images.shape[0]
    while True:
        order = torch.randperm(n, generator=generator, device=images.device)
        for start in range(0, n - batch + 1, batch):
            idx = order[start : start + batch]
            yield random_shift(images[idx], max_shift, generator), labels[idx]


# ---------------------------------------------------------------------------------------------------- components ---


def build_vae(size: int):
    """The untrained ``AutoencoderKL``: two levels (factor 2), 4 latent channels, no quant convs."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(32, 64),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=16,
        sample_size=size,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def build_transformer(args: argparse.Namespace, text_dim: int, pooled_dim: int):
    """The untrained ``FluxTransformer2DModel`` over 2x2-packed 4-channel latents (16 input channels)."""
    from diffusers import FluxTransformer2DModel

    head_dim = 32
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=args.double_blocks,
        num_single_layers=args.single_blocks,
        attention_head_dim=head_dim,
        num_attention_heads=args.hidden // head_dim,
        joint_attention_dim=text_dim,
        pooled_projection_dim=pooled_dim,
        # No distilled-guidance embedding: CFG is FluxPipeline's true CFG with the empty prompt.
        guidance_embeds=False,
        axes_dims_rope=(8, 12, 12),
    )


def build_pipeline(args: argparse.Namespace):
    """Assemble the untrained pipeline (seeded: the frozen text encoders are fixed by ``args.seed``)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    text_encoder, tokenizer = clip_text_model(hidden_size=32, seed=args.seed)
    text_encoder_2, tokenizer_2 = t5_encoder(d_model=32, num_layers=2, seed=args.seed + 1)
    transformer = build(
        build_transformer, args, text_encoder_2.config.d_model, text_encoder.config.hidden_size, seed=args.seed + 3
    )
    return FluxPipeline(
        transformer=transformer,
        vae=build(build_vae, args.size, seed=args.seed + 2),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=args.shift, use_dynamic_shifting=False),
    )


def num_params(module: torch.nn.Module) -> int:
    """Parameter count of ``module``."""
    return sum(p.numel() for p in module.parameters())


# ------------------------------------------------------------------------------------------------------ training ---


def make_optimizer(
    params: Any, lr: float, weight_decay: float, warmup: int, total: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW with linear warm-up then cosine decay to 5% of the peak."""
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.05 + 0.95 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def run_loop(
    steps: int, loss_fn: Callable[[int], torch.Tensor], params: list[torch.nn.Parameter], args: argparse.Namespace,
    lr: float, after_step: Callable[[], None] | None = None, stop_after: int | None = None,
    time_limit: float | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Optimise ``loss_fn(step)``; return the curve (mean loss per ``log_every`` steps).

    The learning-rate schedule spans ``steps``; ``stop_after`` ends the loop earlier on the same trajectory (how a
    run cut short by ``time_limit`` is reproduced exactly, independent of the machine's speed).
    """
    opt, sched = make_optimizer(params, lr, args.weight_decay, args.warmup, steps)
    curve: list[dict[str, float]] = []
    window: list[torch.Tensor] = []
    start = time.perf_counter()
    done = 0
    last = steps if stop_after is None else min(steps, stop_after)
    for step in range(last):
        loss = loss_fn(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if after_step is not None:
            after_step()
        window.append(loss.detach())
        done = step + 1
        if done % args.log_every == 0 or done == last:
            elapsed = time.perf_counter() - start
            mean = torch.stack(window).mean().item()  # one host sync per window, not per step
            curve.append({"step": done, "loss": round(mean, 6), "elapsed_s": round(elapsed, 2)})
            print(f"  {time.strftime('%H:%M:%S')}  step {done:6d}  loss {mean:.5f}  {elapsed:7.1f}s", flush=True)
            window.clear()
            if time_limit is not None and elapsed > time_limit:
                print(f"  time limit {time_limit}s reached after {done} steps", flush=True)
                break
    return {"steps": done, "time_s": round(time.perf_counter() - start, 2), "curve": curve}


def train_vae(vae: Any, images: torch.Tensor, args: argparse.Namespace, generator: torch.Generator) -> dict[str, Any]:
    """Reconstruction (per-pixel MSE) plus ``kl_weight`` times the per-element KL to the unit Gaussian."""
    vae.train()
    data = batches(images, torch.zeros(len(images), device=images.device), args.vae_batch, args.max_shift, generator)

    def loss_fn(step: int) -> torch.Tensor:
        x, _ = next(data)
        posterior = vae.encode(x).latent_dist
        recon = vae.decode(posterior.sample(generator=generator)).sample
        kl = posterior.kl().mean() / posterior.mean[0].numel()
        return F.mse_loss(recon, x) + args.kl_weight * kl

    params = [p for p in vae.parameters() if p.requires_grad]
    result = run_loop(args.vae_steps, loss_fn, params, args, args.vae_lr)
    vae.eval().requires_grad_(False)
    return result


@torch.no_grad()
def calibrate_vae(vae: Any, images: torch.Tensor, generator: torch.Generator) -> dict[str, float]:
    """Set ``shift_factor``/``scaling_factor`` so scaled latents have zero mean, unit std; report reconstruction."""
    posterior = vae.encode(images).latent_dist
    latents = posterior.sample(generator=generator)
    shift, scale = latents.mean().item(), 1.0 / latents.std().item()
    vae.register_to_config(shift_factor=round(shift, 6), scaling_factor=round(scale, 6))
    recon = vae.decode(posterior.mean).sample
    return {
        "shift_factor": round(shift, 6),
        "scaling_factor": round(scale, 6),
        "recon_mse": F.mse_loss(recon, images).item(),
    }


@torch.no_grad()
def text_conditions(pipe: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Embeddings of the ten digit prompts and the empty one (row :data:`EMPTY`), made by the pipeline itself."""
    prompts = [digit_prompt(d) for d in range(NUM_CLASSES)] + [""]
    embeds, pooled, text_ids = pipe.encode_prompt(
        prompts, prompt_2=None, device=device, max_sequence_length=REFERENCE_DEFAULTS["max_sequence_length"]
    )
    return embeds, pooled, text_ids


def sample_sigmas(n: int, shift: float, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """Sigmas distributed like the sampler's: uniform in (0, 1], then the scheduler's static shift."""
    u = 1.0 - torch.rand(n, generator=generator, device=device)
    return shift * u / (1.0 + (shift - 1.0) * u)


def ema_updater(model: torch.nn.Module, decay: float) -> tuple[dict[str, torch.Tensor], Callable[[], None]]:
    """An exponential moving average of ``model``'s parameters and the function that advances it by one step."""
    shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())

    @torch.no_grad()
    def update() -> None:
        for name, param in params.items():
            shadow[name].lerp_(param.detach(), 1.0 - decay)

    return shadow, update


def train_transformer(
    pipe: Any, images: torch.Tensor, labels: torch.Tensor, args: argparse.Namespace, generator: torch.Generator
) -> dict[str, Any]:
    """Rectified flow on packed, scaled VAE latents, conditioned on the precomputed prompt embeddings."""
    device = images.device
    transformer, vae = pipe.transformer.train(), pipe.vae
    embeds, pooled, text_ids = text_conditions(pipe, device)
    side = args.size // pipe.vae_scale_factor  # latent side; FluxPipeline packs 2x2 latent patches into tokens
    img_ids = pipe._prepare_latent_image_ids(1, side // 2, side // 2, device, torch.float32)
    data = batches(images, labels, args.batch, args.max_shift, generator)
    shadow, update_ema = ema_updater(transformer, args.ema)

    def loss_fn(step: int) -> torch.Tensor:
        x, y = next(data)
        with torch.no_grad():
            z = vae.encode(x).latent_dist.sample(generator=generator)
            z = (z - vae.config.shift_factor) * vae.config.scaling_factor
            x0 = pipe._pack_latents(z, z.shape[0], z.shape[1], side, side)
        drop = torch.rand(y.shape, generator=generator, device=device) < args.cfg_dropout
        y = torch.where(drop, torch.full_like(y, EMPTY), y)
        sigma = sample_sigmas(x0.shape[0], args.shift, generator, device)
        noise = torch.randn(x0.shape, generator=generator, device=device)
        s = sigma[:, None, None]
        pred = transformer(
            hidden_states=(1.0 - s) * x0 + s * noise,
            timestep=sigma,
            pooled_projections=pooled[y],
            encoder_hidden_states=embeds[y],
            txt_ids=text_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]
        return F.mse_loss(pred, noise - x0)

    params = [p for p in transformer.parameters() if p.requires_grad]
    result = run_loop(
        args.steps, loss_fn, params, args, args.lr, update_ema, stop_after=args.stop_after, time_limit=args.time_limit
    )
    transformer.load_state_dict(shadow)
    transformer.eval().requires_grad_(False)
    return result


# ---------------------------------------------------------------------------------------------------------- main ---


def device_name(device: torch.device) -> str:
    """Human-readable name of the training device."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def directory_bytes(path: Path) -> int:
    """Total size of the files under ``path``."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> None:
    """Train both stages, save the pipeline and the training log."""
    import diffusers

    args = parse_args(argv)
    seed_everything(args.seed)
    device = torch.device(args.device)
    generator = torch.Generator(device).manual_seed(args.seed)
    images, labels = digit_images(args.size)
    images, labels = images.to(device), labels.to(device)
    pipe = build_pipeline(args).to(device)
    pipe.text_encoder.requires_grad_(False)
    pipe.text_encoder_2.requires_grad_(False)
    start = time.perf_counter()

    print(f"VAE: {num_params(pipe.vae):,} parameters, {args.vae_steps} steps on {device_name(device)}", flush=True)
    vae_log = train_vae(pipe.vae, images, args, generator)
    vae_log["calibration"] = calibrate_vae(pipe.vae, images, generator)
    print(f"  calibration {vae_log['calibration']}", flush=True)

    print(f"transformer: {num_params(pipe.transformer):,} parameters, {args.steps} steps", flush=True)
    tr_log = train_transformer(pipe, images, labels, args, generator)

    args.out.mkdir(parents=True, exist_ok=True)
    pipe.to("cpu").save_pretrained(args.out, safe_serialization=True)
    log = {
        "device": device_name(device),
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "total_time_s": round(time.perf_counter() - start, 2),
        "weights_bytes": directory_bytes(args.out),
        "params": {name: num_params(getattr(pipe, name)) for name in COMPONENTS},
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in ("out", "log")},
        "vae": vae_log,
        "transformer": tr_log,
    }
    args.log.parent.mkdir(parents=True, exist_ok=True)
    args.log.write_text(json.dumps(log, indent=1) + "\n")
    print(f"saved {args.out} ({log['weights_bytes'] / 1e6:.2f} MB) and {args.log} in {log['total_time_s']}s")
    if log["weights_bytes"] > MAX_WEIGHTS_BYTES:
        print(f"warning: the weights exceed the {MAX_WEIGHTS_BYTES / 1e6:.0f} MB the package ships")


if __name__ == "__main__":
    main()
