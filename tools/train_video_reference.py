"""Train the video reference pipeline: a small ``WanPipeline`` that draws a handwritten digit moving across the frame.

The clips are generated on the fly (``fastdit.reference.video``): a scikit-learn digit upscaled to 16x16 moves 1 or
2 pixels a frame left, right, up or down across a black 32x32 frame for 9 frames; the prompt is
``"a handwritten digit 7 moving left"`` (10% empty, so classifier-free guidance works). Two stages, both seeded:

1. an ``AutoencoderKLWan`` (space x4, time x4: 9x32x32 pixels -> 3x8x8x16 latents) learns to reconstruct the clips
   (MSE + a small KL); its per-channel ``latents_mean``/``latents_std`` are then set from a bank of encoded clips, so
   the latents the transformer sees are standardised exactly as WanPipeline undoes them before decoding. The whole
   pipeline folder is written here already (transformer untrained), atomically;
2. a ``WanTransformer3DModel`` learns rectified flow on a bank of encoded clips (a fresh posterior sample each step):
   ``x_t = (1 - s) x0 + s noise``, target ``noise - x0``, called with ``timestep = 1000 s`` (WanPipeline passes the
   scheduler's timesteps, which are sigmas x 1000), ``s`` drawn like the sampler's schedule (uniform, then the
   scheduler's shift). The EMA weights are written into the folder every ``--save-every`` steps and at the end.

Then a short evaluation (``video_accuracy`` on 40 clips, one forward per step and CFG) goes into a JSON beside the
training curve. The text encoder is a tiny random frozen UMT5 with the local tokenizer (plus the motion words).

    PYTHONPATH=src python tools/train_video_reference.py --device cuda   # the documented run (one H200: ~5 min)
    PYTHONPATH=src python tools/train_video_reference.py --quick         # end to end on a CPU in ~2 minutes

The documented run writes ``src/fastdit/reference/video_weights/`` (the pipeline),
``docs/video_reference_training.json`` (arguments, timings, loss curves) and ``docs/video_reference_eval.json``
(accuracy). Both stages also stop at a time cap (``--vae-time-limit``, ``--time-limit``), so a slower machine still
ends in time with a usable, if less trained, pipeline; the JSON records the steps actually made.

fastdit must be importable (the editable install, or ``PYTHONPATH=src``); it needs torch, diffusers, transformers,
numpy and scikit-learn, nothing else. Pieces shared with the image reference come from ``tools/train_reference.py``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the image script's pieces, also when imported as a module

from train_reference import (
    device_name,
    directory_bytes,
    ema_updater,
    num_params,
    run_loop,
    sample_sigmas,
    seed_everything,
)

from fastdit.io import write_json
from fastdit.reference.video import (
    DIRECTIONS,
    FRAME_SIDE,
    MOTION_WORDS,
    NUM_FRAMES,
    VIDEO_REFERENCE_CFG,
    VIDEO_REFERENCE_DEFAULTS,
    digit_sprites,
    generate_videos,
    render_moving_digits,
    sample_motions,
    video_accuracy,
    video_prompt,
)

ROOT = Path(__file__).resolve().parents[1]
NUM_CLASSES = 10
NUM_PROMPTS = NUM_CLASSES * len(DIRECTIONS)
EMPTY = NUM_PROMPTS  # index of the empty prompt among the precomputed text conditions
COMPONENTS = ("transformer", "vae", "text_encoder")
MAX_WEIGHTS_BYTES = 15 * 10**6  # the wheel carries the weights: keep them small
TEXT_DIM = 32

# --quick: every stage runs, with step counts and sizes that finish on a 2-core CPU in about two minutes.
QUICK = {
    "vae_steps": 12, "vae_batch": 4, "bank": 64, "steps": 24, "batch": 16, "warmup": 5, "log_every": 4,
    "save_every": 10, "eval_steps": 4, "eval_per_digit": 1, "out": ROOT / "out/video_quick/pipeline",
    "log": ROOT / "out/video_quick/training.json", "eval_log": ROOT / "out/video_quick/eval.json",
}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; every default is the documented run (``--quick`` overrides the sizes)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--device", default="cpu", help="torch device for training (cpu or cuda)")
    a("--quick", action="store_true", help="tiny step counts: the whole script end to end on a CPU (a smoke test)")
    a("--seed", type=int, default=0, help="seed for torch, numpy and python RNGs")
    a("--out", type=Path, default=ROOT / "src/fastdit/reference/video_weights", help="pipeline directory to write")
    a("--log", type=Path, default=ROOT / "docs/video_reference_training.json", help="training-curve JSON to write")
    a("--eval-log", type=Path, default=ROOT / "docs/video_reference_eval.json", help="evaluation JSON to write")
    # VAE stage.
    a("--vae-steps", type=int, default=700, help="VAE optimizer steps")
    a("--vae-batch", type=int, default=128, help="VAE batch size (clips)")
    a("--vae-lr", type=float, default=1e-3, help="VAE peak learning rate (AdamW, warm-up then cosine)")
    a("--kl-weight", type=float, default=1e-3, help="weight of the per-element KL term against per-pixel MSE")
    a("--vae-base", type=int, default=16, help="AutoencoderKLWan base channels (levels x1, x2, x2)")
    a("--vae-time-limit", type=float, default=100.0, help="end the VAE stage once N seconds have passed")
    # Latent bank and transformer stage.
    a("--bank", type=int, default=65536, help="clips encoded once after the VAE stage (the transformer data)")
    a("--steps", type=int, default=3800, help="transformer optimizer steps")
    a("--batch", type=int, default=1024, help="transformer batch size")
    a("--lr", type=float, default=1e-3, help="transformer peak learning rate (AdamW, warm-up then cosine)")
    a("--warmup", type=int, default=200, help="linear warm-up steps (both stages)")
    a("--weight-decay", type=float, default=0.01, help="AdamW weight decay (both stages)")
    a("--ema", type=float, default=0.999, help="EMA decay of the transformer weights that are saved")
    a("--cfg-dropout", type=float, default=0.1, help="probability of training on the empty prompt")
    a("--shift", type=float, default=3.0, help="FlowMatchEulerDiscreteScheduler shift (training and sampling)")
    a("--hidden", type=int, default=128, help="transformer width (attention heads of 32 channels)")
    a("--layers", type=int, default=8, help="transformer blocks")
    a("--ffn", type=int, default=512, help="transformer feed-forward width")
    a("--time-limit", type=float, default=230.0, help="end the transformer stage once N seconds have passed")
    a("--save-every", type=int, default=1000, help="write the EMA transformer into --out every N steps")
    a("--log-every", type=int, default=100, help="record the mean loss every N steps")
    # Evaluation.
    a("--eval-steps", type=int, default=VIDEO_REFERENCE_DEFAULTS["num_inference_steps"], help="sampling steps")
    a("--eval-per-digit", type=int, default=4, help="evaluation clips per digit (directions cycle, seeds 0..)")
    args = p.parse_args(argv)
    if args.quick:
        words = sys.argv[1:] if argv is None else argv
        given = {a.dest for a in p._actions if any(w.split("=")[0] in a.option_strings for w in words)}
        for key, value in QUICK.items():
            if key not in given:
                setattr(args, key, value)
    return args


def relative(path: Path) -> str:
    """``path`` relative to the repository when inside it (the logs are committed: no machine paths)."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return path.name


def stamp() -> str:
    """Wall-clock time for progress lines (a run under a hard limit is read by the clock)."""
    return time.strftime("%H:%M:%S")


# ---------------------------------------------------------------------------------------------------- components ---


def build_vae(base: int):
    """The untrained ``AutoencoderKLWan``: 3 levels (x1, x2, x2 channels), space x4, time x4, 16 latent channels."""
    from diffusers import AutoencoderKLWan

    z_dim = 16
    return AutoencoderKLWan(
        base_dim=base,
        z_dim=z_dim,
        dim_mult=[1, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[True, True],
        # Placeholders: set from the trained encoder's latents (calibrate_vae).
        latents_mean=[0.0] * z_dim,
        latents_std=[1.0] * z_dim,
        scale_factor_temporal=4,
        scale_factor_spatial=4,
    )


def build_transformer(args: argparse.Namespace):
    """The untrained ``WanTransformer3DModel`` over (1, 2, 2) patches of the 16-channel latents: 48 tokens a clip."""
    from diffusers import WanTransformer3DModel

    head_dim = 32
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=args.hidden // head_dim,
        attention_head_dim=head_dim,
        in_channels=16,
        out_channels=16,
        text_dim=TEXT_DIM,
        freq_dim=64,
        ffn_dim=args.ffn,
        num_layers=args.layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )


def build_pipeline(args: argparse.Namespace):
    """Assemble the untrained pipeline (seeded: the frozen text encoder is fixed by ``args.seed``)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline
    from transformers import UMT5Config, UMT5EncoderModel

    from fastdit.testing.components.encoders import build, t5_config_kwargs
    from fastdit.testing.components.tokenizers import t5_tokenizer

    tokenizer = t5_tokenizer(extra_words=MOTION_WORDS)
    config = UMT5Config(**t5_config_kwargs(tokenizer, TEXT_DIM, 2))
    return WanPipeline(
        transformer=build(build_transformer, args, seed=args.seed + 3),
        vae=build(build_vae, args.vae_base, seed=args.seed + 2),
        text_encoder=build(UMT5EncoderModel, config, seed=args.seed + 1),
        tokenizer=tokenizer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=args.shift, use_dynamic_shifting=False),
    )


# --------------------------------------------------------------------------------------------------------- data ---


class Clips:
    """Endless random clips on the training device: ``(B, 3, T, H, W)`` in [-1, 1], digit and direction labels."""

    def __init__(self, device: torch.device, generator: torch.Generator) -> None:
        self.sprites, self.labels = (t.to(device) for t in digit_sprites())
        self.generator = generator

    def __call__(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        index = torch.randint(0, len(self.labels), (n,), generator=self.generator, device=self.sprites.device)
        directions, speeds, starts = sample_motions(n, self.generator, frames=NUM_FRAMES, side=FRAME_SIDE)
        clips = render_moving_digits(self.sprites[index], directions, speeds, starts, frames=NUM_FRAMES)
        video = (clips * 2.0 - 1.0)[:, None].expand(n, 3, *clips.shape[1:]).contiguous()
        return video, self.labels[index], directions


# ------------------------------------------------------------------------------------------------------ training ---


def train_vae(vae: Any, clips: Clips, args: argparse.Namespace) -> dict[str, Any]:
    """Reconstruction (per-pixel MSE) plus ``kl_weight`` times the per-element KL to the unit Gaussian."""
    vae.train()
    generator = clips.generator

    def loss_fn(step: int) -> torch.Tensor:
        x, _, _ = clips(args.vae_batch)
        posterior = vae.encode(x).latent_dist
        recon = vae.decode(posterior.sample(generator=generator)).sample
        kl = posterior.kl().mean() / posterior.mean[0].numel()
        return F.mse_loss(recon, x) + args.kl_weight * kl

    params = [p for p in vae.parameters() if p.requires_grad]
    result = run_loop(args.vae_steps, loss_fn, params, args, args.vae_lr, time_limit=args.vae_time_limit)
    vae.eval().requires_grad_(False)
    return result


@torch.no_grad()
def encode_bank(
    vae: Any, clips: Clips, n: int, chunk: int = 1024
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Encode ``n`` fresh clips: posterior means and standard deviations, digit and direction labels, recon MSE."""
    means, stds, digits, directions, errors = [], [], [], [], []
    for start in range(0, n, chunk):
        x, y, d = clips(min(chunk, n - start))
        posterior = vae.encode(x).latent_dist
        if start == 0:  # reconstruction error of the first chunk, from the posterior mean
            errors.append(F.mse_loss(vae.decode(posterior.mean).sample, x).item())
        means.append(posterior.mean)
        stds.append(posterior.std)
        digits.append(y)
        directions.append(d)
    return torch.cat(means), torch.cat(stds), torch.cat(digits), torch.cat(directions), errors[0]


def calibrate_vae(vae: Any, means: torch.Tensor, stds: torch.Tensor, generator: torch.Generator) -> dict[str, Any]:
    """Set per-channel ``latents_mean``/``latents_std`` from posterior samples of the bank (WanPipeline undoes them)."""
    z = means + stds * torch.randn(means.shape, generator=generator, device=means.device)
    channel_mean = z.mean(dim=(0, 2, 3, 4))
    channel_std = z.std(dim=(0, 2, 3, 4))
    vae.register_to_config(
        latents_mean=[round(v, 6) for v in channel_mean.tolist()],
        latents_std=[round(v, 6) for v in channel_std.tolist()],
    )
    return {"latents_mean": vae.config.latents_mean, "latents_std": vae.config.latents_std}


@torch.no_grad()
def text_conditions(pipe: Any, device: torch.device) -> torch.Tensor:
    """UMT5 embeddings of the 40 prompts (digit-major, directions inner) and the empty one (row :data:`EMPTY`)."""
    prompts = [video_prompt(d, r) for d in range(NUM_CLASSES) for r in range(len(DIRECTIONS))] + [""]
    embeds, _ = pipe.encode_prompt(
        prompts,
        do_classifier_free_guidance=False,
        device=device,
        max_sequence_length=VIDEO_REFERENCE_DEFAULTS["max_sequence_length"],
    )
    return embeds


def replace_dir(staged: Path, final: Path) -> None:
    """Put the complete directory ``staged`` at ``final``: never a half-written folder there.

    Two renames (old aside, new in): a kill between them leaves ``final`` missing and the previous folder beside it
    as ``.<name>.old``, still whole.
    """
    old = final.with_name(f".{final.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    staged.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def save_atomically(save: Callable[[Path], None], final: Path) -> None:
    """Run ``save(directory)`` into a hidden sibling of ``final``, then swap it in (:func:`replace_dir`)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    staged = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(staged, ignore_errors=True)
    save(staged)
    replace_dir(staged, final)


def save_pipeline(pipe: Any, out: Path) -> None:
    """The whole pipeline in ``save_pretrained`` layout, on the CPU in float32, swapped in atomically."""
    device = pipe.transformer.device
    pipe.to("cpu")
    save_atomically(lambda d: pipe.save_pretrained(d, safe_serialization=True), out)
    pipe.to(device)


def train_transformer(
    pipe: Any, bank: tuple[torch.Tensor, ...], args: argparse.Namespace, generator: torch.Generator, log: Callable
) -> dict[str, Any]:
    """Rectified flow on standardised bank latents, conditioned on the precomputed prompt embeddings."""
    means, stds, digits, directions = bank
    device = means.device
    transformer, vae = pipe.transformer.train(), pipe.vae
    embeds = text_conditions(pipe, device)
    mean = torch.tensor(vae.config.latents_mean, device=device).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, device=device).view(1, -1, 1, 1, 1)
    shadow, update_ema = ema_updater(transformer, args.ema)
    ema_model = build_transformer(args).eval().requires_grad_(False)  # CPU copy the checkpoints are written from
    done = [0]

    def checkpoint() -> None:
        ema_model.load_state_dict({k: v.detach().cpu() for k, v in shadow.items()})
        save_atomically(lambda d: ema_model.save_pretrained(d, safe_serialization=True), args.out / "transformer")
        log(transformer_steps=done[0])
        print(f"  {stamp()}  checkpoint: EMA transformer of step {done[0]} written", flush=True)

    def after_step() -> None:
        update_ema()
        done[0] += 1
        if args.save_every and done[0] % args.save_every == 0:
            checkpoint()

    def loss_fn(step: int) -> torch.Tensor:
        idx = torch.randint(0, means.shape[0], (args.batch,), generator=generator, device=device)
        z = means[idx] + stds[idx] * torch.randn(means[idx].shape, generator=generator, device=device)
        x0 = (z - mean) / std
        cond = digits[idx] * len(DIRECTIONS) + directions[idx]
        drop = torch.rand(cond.shape, generator=generator, device=device) < args.cfg_dropout
        cond = torch.where(drop, torch.full_like(cond, EMPTY), cond)
        sigma = sample_sigmas(args.batch, args.shift, generator, device)
        noise = torch.randn(x0.shape, generator=generator, device=device)
        s = sigma.view(-1, 1, 1, 1, 1)
        pred = transformer(
            hidden_states=(1.0 - s) * x0 + s * noise,
            timestep=sigma * 1000.0,
            encoder_hidden_states=embeds[cond],
            return_dict=False,
        )[0]
        return F.mse_loss(pred, noise - x0)

    params = [p for p in transformer.parameters() if p.requires_grad]
    result = run_loop(args.steps, loss_fn, params, args, args.lr, after_step, time_limit=args.time_limit)
    transformer.load_state_dict(shadow)
    transformer.eval().requires_grad_(False)
    return result


# ----------------------------------------------------------------------------------------------------- evaluate ---


def evaluate(pipe: Any, args: argparse.Namespace) -> dict[str, Any]:
    """``video_accuracy`` of ``eval_per_digit`` clips per digit, one forward per step and with CFG."""
    from fastdit.reference.digits import fit_digit_classifier

    classifier = fit_digit_classifier()
    n = NUM_CLASSES * args.eval_per_digit
    digits = [i % NUM_CLASSES for i in range(n)]
    directions = [(i // NUM_CLASSES + i) % len(DIRECTIONS) for i in range(n)]  # every digit meets every direction
    seeds = list(range(n))
    results: dict[str, Any] = {"clips": n, "num_inference_steps": args.eval_steps, "paths": {}}
    for name, extra in (("one forward per step", {}), ("CFG", dict(VIDEO_REFERENCE_CFG))):
        start = time.perf_counter()
        frames = generate_videos(pipe, digits, directions, seeds, num_inference_steps=args.eval_steps, **extra)
        seconds = time.perf_counter() - start
        acc = video_accuracy(frames, digits, directions, classifier)
        results["paths"][name] = {**{k: round(v, 4) for k, v in vars(acc).items()}, "call_s": round(seconds, 2),
                                  "call_kwargs": {k: v for k, v in extra.items()}}  # fmt: skip
        print(f"  {stamp()}  eval {name}: {acc} ({seconds:.1f}s)", flush=True)
    return results


# ---------------------------------------------------------------------------------------------------------- main ---


def main(argv: list[str] | None = None) -> None:
    """Train both stages, save the pipeline after each, evaluate, write the logs."""
    import diffusers

    args = parse_args(argv)
    seed_everything(args.seed)
    device = torch.device(args.device)
    if device.type == "cuda":
        # TF32, not bf16 autocast: these models are launch-bound, and autocast's casts made an H200 step ~1.5x
        # slower (transformer 90 vs 57 ms, VAE 159 vs 147 ms); batch 1024 costs what batch 256 does.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    generator = torch.Generator(device).manual_seed(args.seed)
    start = time.perf_counter()
    pipe = build_pipeline(args).to(device)
    pipe.text_encoder.requires_grad_(False)
    clips = Clips(device, generator)
    log: dict[str, Any] = {
        "complete": False,
        "device": device_name(device),
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "params": {name: num_params(getattr(pipe, name)) for name in COMPONENTS},
        "args": {k: relative(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }

    def write_log(**extra: Any) -> None:
        log.update(extra, total_time_s=round(time.perf_counter() - start, 2))
        write_json(args.log, log, indent=1)

    print(f"{stamp()}  VAE: {num_params(pipe.vae):,} parameters, {args.vae_steps} steps on {device_name(device)}")
    log["vae"] = train_vae(pipe.vae, clips, args)
    means, stds, digits, directions, recon = encode_bank(pipe.vae, clips, args.bank)
    log["vae"]["bank_recon_mse"] = round(recon, 6)
    log["vae"]["calibration"] = calibrate_vae(pipe.vae, means, stds, generator)
    print(f"{stamp()}  bank of {args.bank} clips encoded; reconstruction MSE {recon:.5f}", flush=True)
    save_pipeline(pipe, args.out)  # usable folder from here on (the transformer untrained until its checkpoints)
    write_log(transformer_steps=0)

    print(f"{stamp()}  transformer: {num_params(pipe.transformer):,} parameters, {args.steps} steps", flush=True)
    log["transformer"] = train_transformer(pipe, (means, stds, digits, directions), args, generator, write_log)
    del means, stds
    save_pipeline(pipe, args.out)
    weights = directory_bytes(args.out)
    write_log(transformer_steps=log["transformer"]["steps"], weights_bytes=weights)
    print(f"{stamp()}  saved {args.out} ({weights / 1e6:.2f} MB)", flush=True)
    if weights > MAX_WEIGHTS_BYTES:
        print(f"warning: the weights exceed the {MAX_WEIGHTS_BYTES / 1e6:.0f} MB the package ships")

    pipe.set_progress_bar_config(disable=True)
    evaluation = evaluate(pipe, args)
    evaluation["device"] = device_name(device)
    write_json(args.eval_log, evaluation, indent=1)
    write_log(complete=True)
    print(f"{stamp()}  done in {log['total_time_s']}s: {args.out}, {args.log}, {args.eval_log}", flush=True)


if __name__ == "__main__":
    main()
