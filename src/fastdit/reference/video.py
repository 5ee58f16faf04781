"""The video reference pipeline: a small trained ``WanPipeline`` that draws a handwritten digit moving across the frame.

Like the image reference (:mod:`fastdit.reference`), it exists because random weights never let a step cache hit:
this one gives cache and parallelism measurements a *video* model with real dynamics, offline. It is trained by
``tools/train_video_reference.py`` on procedurally generated clips (the data generator is here, so the training script
and the tests draw the same clips): a scikit-learn digit upscaled to 16x16 moves 1 or 2 pixels a frame across a black
32x32 frame, left, right, up or down, for 9 frames. The prompt names the digit and the direction
(:func:`video_prompt`); 10% of the training prompts were empty, so classifier-free guidance (WanPipeline's
``guidance_scale > 1``: a cond and an uncond forward per step) works.

The independent check (:func:`video_accuracy`) needs no weights: it follows the digit's centre of mass through the
frames, reads the motion direction from the slope of that trajectory, and classifies a 16x16 crop centred on every
frame's ink bounding box with the image reference's classifier (:func:`fastdit.reference.digits.fit_digit_classifier`);
a clip's digit is its frames' majority vote.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

__all__ = [
    "DIRECTIONS",
    "MOTION_WORDS",
    "VIDEO_REFERENCE_CFG",
    "VIDEO_REFERENCE_DEFAULTS",
    "VideoAccuracy",
    "digit_sprites",
    "frame_centres",
    "frame_digit_features",
    "generate_videos",
    "load_video_reference_pipeline",
    "motion_directions",
    "render_moving_digits",
    "sample_motions",
    "video_accuracy",
    "video_prompt",
    "video_reference_dir",
]

# Directions in prompt order, and their unit steps (dx, dy) in image coordinates (y grows downwards).
DIRECTIONS: tuple[str, ...] = ("left", "right", "up", "down")
_STEPS = np.array([(-1, 0), (1, 0), (0, -1), (0, 1)], dtype=np.int64)
# Words the prompts need beyond the shared tiny-tokenizer vocabulary (whole pieces keep prompts 7 tokens long).
MOTION_WORDS: tuple[str, ...] = ("moving", *DIRECTIONS)

FRAME_SIDE = 32  # pixels
NUM_FRAMES = 9  # 1 + 4k frames: the Wan VAE keeps the first frame and packs each further 4 into one latent frame
SPRITE_SIDE = 16  # a scikit-learn 8x8 digit upscaled 2x
SPEEDS = (1, 2)  # pixels per frame
# Pixels brighter than this (in [0, 1]) count towards a frame's centre of mass: well above a generated background's
# residual noise, well below a stroke.
_INK = 0.25
# Below this speed (pixels per frame, along the dominant axis) a clip counts as still: no direction is read.
_MIN_SPEED = 0.4

# The call arguments the pipeline was trained for. ``max_sequence_length`` matters: WanPipeline pads the UMT5 prompt
# to this length with zeros and the transformer attends to all of it, so another length shifts the conditioning.
# ``guidance_scale=1`` runs one transformer forward per step (WanPipeline's own default is 5: CFG, two forwards).
VIDEO_REFERENCE_DEFAULTS: MappingProxyType[str, Any] = MappingProxyType(
    {
        "height": FRAME_SIDE,
        "width": FRAME_SIDE,
        "num_frames": NUM_FRAMES,
        "num_inference_steps": 30,
        "max_sequence_length": 16,
        "guidance_scale": 1.0,
    }
)

# Extra arguments for the two-forward CFG path (cond and uncond branch per step, the uncond on the empty prompt).
VIDEO_REFERENCE_CFG: MappingProxyType[str, Any] = MappingProxyType({"negative_prompt": "", "guidance_scale": 3.0})


# ----------------------------------------------------------------------------------------------------- pipeline ---


def video_reference_dir() -> Path:
    """Directory of the packaged video pipeline (``WanPipeline.save_pretrained`` layout).

    Returns:
        The path to ``fastdit/reference/video_weights``.

    Raises:
        FileNotFoundError: If the weights are missing (not trained yet, or a source checkout without them).
    """
    path = Path(__file__).resolve().parent / "video_weights"
    if not (path / "model_index.json").is_file():
        raise FileNotFoundError(
            f"video reference weights not found in {path}; run tools/train_video_reference.py to create them"
        )
    return path


def load_video_reference_pipeline(
    device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, path: str | Path | None = None
) -> Any:
    """Load the packaged video reference ``WanPipeline`` (offline, progress bar off).

    Args:
        device: Where to put every component.
        dtype: Parameter dtype (the weights are stored in float32).
        path: Another pipeline folder written by the training script (e.g. a run's output); default the packaged one.

    Returns:
        A ``diffusers.WanPipeline``; call it with ``**VIDEO_REFERENCE_DEFAULTS``.

    Raises:
        FileNotFoundError: If the folder holds no pipeline.
    """
    folder = video_reference_dir() if path is None else Path(path)
    if not (folder / "model_index.json").is_file():
        raise FileNotFoundError(f"no pipeline in {folder}: model_index.json is missing")
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(folder, dtype=dtype, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


def _direction_index(direction: str | int) -> int:
    if isinstance(direction, str) and direction in DIRECTIONS:
        return DIRECTIONS.index(direction)
    if isinstance(direction, (int, np.integer)) and not isinstance(direction, bool) and 0 <= direction < 4:
        return int(direction)
    raise ValueError(f"direction={direction!r}: must be one of {DIRECTIONS} or its index 0-3")


def video_prompt(digit: int, direction: str | int) -> str:
    """The prompt the video reference was trained on.

    Args:
        digit: A numeral 0-9.
        direction: One of :data:`DIRECTIONS` or its index.

    Returns:
        ``"a handwritten digit <digit> moving <direction>"``.

    Raises:
        ValueError: If ``digit`` is not in 0-9 or ``direction`` is unknown.
    """
    if not isinstance(digit, (int, np.integer)) or isinstance(digit, bool) or not 0 <= digit <= 9:
        raise ValueError(f"digit={digit!r}: must be an int in 0-9")
    return f"a handwritten digit {int(digit)} moving {DIRECTIONS[_direction_index(direction)]}"


def generate_videos(
    pipe: Any, digits: Sequence[int], directions: Sequence[str | int], seeds: Sequence[int], **overrides: Any
) -> np.ndarray:
    """Generate one clip per ``(digit, direction, seed)`` in a single batched pipeline call.

    Each clip draws its initial noise from its own CPU generator seeded with its seed, so a clip depends on its seed
    alone (not on its place in the batch) and CPU and GPU runs start from the same noise.

    Args:
        pipe: The video reference ``WanPipeline`` (or an accelerated one).
        digits: Digits to draw (0-9).
        directions: One direction per digit.
        seeds: One seed per digit.
        **overrides: Call arguments replacing :data:`VIDEO_REFERENCE_DEFAULTS` (e.g. ``**VIDEO_REFERENCE_CFG``).

    Returns:
        ``(N, T, H, W, 3)`` float32 frames in [0, 1].

    Raises:
        ValueError: If the three sequences differ in length.
    """
    if not len(digits) == len(directions) == len(seeds):
        raise ValueError(
            f"len(digits)={len(digits)}, len(directions)={len(directions)}, len(seeds)={len(seeds)}: pass one "
            "direction and one seed per digit"
        )
    prompts = [video_prompt(int(d), r) for d, r in zip(digits, directions, strict=True)]
    kwargs = {**VIDEO_REFERENCE_DEFAULTS, "output_type": "np", **overrides}
    generators = [torch.Generator().manual_seed(int(s)) for s in seeds]
    with torch.no_grad():
        frames = pipe(prompts, generator=generators, **kwargs).frames
    return np.asarray(frames, dtype=np.float32)


# --------------------------------------------------------------------------------------------------------- data ---


def digit_sprites(side: int = SPRITE_SIDE) -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's 1,797 digits upscaled bicubically to ``side`` pixels: ``(N, side, side)`` in [0, 1], labels.

    Raises:
        ImportError: If scikit-learn is not installed (a test/benchmark dependency).
    """
    import torch.nn.functional as F
    from sklearn.datasets import load_digits

    data = load_digits()
    small = torch.from_numpy(data.images.astype(np.float32) / 16.0)[:, None]
    # Clamping removes bicubic overshoot, so white strokes stay at most 1 and the background exactly 0.
    big = F.interpolate(small, size=(side, side), mode="bicubic", align_corners=False).clamp(0.0, 1.0)
    return big[:, 0], torch.from_numpy(data.target.astype(np.int64))


def sample_motions(
    n: int, generator: torch.Generator, *, frames: int = NUM_FRAMES, side: int = FRAME_SIDE, sprite: int = SPRITE_SIDE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random motions that keep a ``sprite``-pixel digit inside the frame for all ``frames``.

    Args:
        n: Number of motions.
        generator: RNG (its device is where the tensors are made).
        frames: Frames per clip.
        side: Frame side in pixels.
        sprite: Sprite side in pixels.

    Returns:
        ``directions (n,)`` indices into :data:`DIRECTIONS`, ``speeds (n,)`` in pixels per frame (one of
        ``SPEEDS``), ``starts (n, 2)`` the sprite's top-left ``(x, y)`` in the first frame.

    Raises:
        ValueError: If the fastest motion cannot fit in the frame.
    """
    room = side - sprite
    if max(SPEEDS) * (frames - 1) > room:
        raise ValueError(f"frames={frames}: a {sprite}-pixel sprite at {max(SPEEDS)} px/frame leaves a {side} frame")
    device = generator.device
    directions = torch.randint(0, len(DIRECTIONS), (n,), generator=generator, device=device)
    speeds = torch.tensor(SPEEDS, device=device)[
        torch.randint(0, len(SPEEDS), (n,), generator=generator, device=device)
    ]
    travel = speeds * (frames - 1)
    # Along the motion: anywhere the whole path fits. Across it: anywhere in the frame.
    along = (torch.rand(n, generator=generator, device=device) * (room - travel + 1)).long()
    across = torch.randint(0, room + 1, (n,), generator=generator, device=device)
    backwards = (directions == 0) | (directions == 2)  # left and up start at the far side
    along = torch.where(backwards, along + travel, along)
    horizontal = directions < 2
    starts = torch.stack([torch.where(horizontal, along, across), torch.where(horizontal, across, along)], dim=1)
    return directions, speeds, starts


def render_moving_digits(
    sprites: torch.Tensor,
    directions: torch.Tensor,
    speeds: torch.Tensor,
    starts: torch.Tensor,
    *,
    frames: int = NUM_FRAMES,
    side: int = FRAME_SIDE,
) -> torch.Tensor:
    """Paste each sprite into ``frames`` black frames, moved ``speed`` pixels a frame in its direction.

    Args:
        sprites: ``(n, s, s)`` digits in [0, 1].
        directions: ``(n,)`` indices into :data:`DIRECTIONS`.
        speeds: ``(n,)`` pixels per frame.
        starts: ``(n, 2)`` top-left ``(x, y)`` of each sprite in the first frame.
        frames: Frames per clip.
        side: Frame side in pixels.

    Returns:
        ``(n, frames, side, side)`` clips in [0, 1]; pixels a sprite does not cover are 0.
    """
    n, s, _ = sprites.shape
    device = sprites.device
    steps = torch.as_tensor(_STEPS, device=device)[directions.long()] * speeds.long()[:, None]  # (n, 2)
    t = torch.arange(frames, device=device)
    origin = starts.long()[:, None, :] + t[None, :, None] * steps[:, None, :]  # (n, T, 2) top-left per frame
    pix = torch.arange(side, device=device)
    # Sprite coordinates of every frame pixel; outside the sprite they are masked to black.
    col = pix[None, None, None, :] - origin[..., 0, None, None]  # (n, T, 1, side)
    row = pix[None, None, :, None] - origin[..., 1, None, None]  # (n, T, side, 1)
    inside = (col >= 0) & (col < s) & (row >= 0) & (row < s)
    flat = sprites.reshape(n, 1, s * s).expand(n, frames, s * s)
    index = (row.clamp(0, s - 1) * s + col.clamp(0, s - 1)).reshape(n, frames, side * side)
    clips = torch.gather(flat, 2, index).reshape(n, frames, side, side)
    return torch.where(inside, clips, torch.zeros((), device=device, dtype=sprites.dtype))


# ------------------------------------------------------------------------------------------------------ checker ---


def _grey(frames: np.ndarray) -> np.ndarray:
    frames = np.asarray(frames, dtype=np.float32)
    if frames.ndim == 5:  # (N, T, H, W, C)
        frames = frames.mean(axis=-1)
    if frames.ndim != 4:
        raise ValueError(f"frames of shape {frames.shape}: expected (N, T, H, W) or (N, T, H, W, C) in [0, 1]")
    return frames


def frame_centres(frames: np.ndarray) -> np.ndarray:
    """Centre of mass ``(x, y)`` of the bright pixels of every frame.

    Args:
        frames: ``(N, T, H, W)`` or ``(N, T, H, W, C)`` in [0, 1] (white digit on black).

    Returns:
        ``(N, T, 2)`` in pixels; a frame with no bright pixel gets the frame's centre.
    """
    grey = _grey(frames)
    h, w = grey.shape[-2:]
    mass = np.where(grey > _INK, grey, 0.0)
    total = mass.sum(axis=(-2, -1))
    x = (mass.sum(axis=-2) * np.arange(w)).sum(axis=-1)
    y = (mass.sum(axis=-1) * np.arange(h)).sum(axis=-1)
    safe = np.maximum(total, 1e-8)
    centre = np.stack([x / safe, y / safe], axis=-1)
    empty = (total <= 0)[..., None]
    return np.where(empty, np.array([(w - 1) / 2, (h - 1) / 2]), centre)


def motion_directions(frames: np.ndarray, min_speed: float = _MIN_SPEED) -> np.ndarray:
    """The direction each clip moves in, from the least-squares slope of its centre-of-mass trajectory.

    Args:
        frames: ``(N, T, H, W[, C])`` clips in [0, 1], ``T >= 2``.
        min_speed: Slopes below this (pixels per frame, on the dominant axis) count as no motion.

    Returns:
        ``(N,)`` indices into :data:`DIRECTIONS`, or -1 for a clip that does not move.
    """
    centres = frame_centres(frames)
    t = np.arange(centres.shape[1], dtype=np.float64)
    if len(t) < 2:
        raise ValueError("a direction needs at least 2 frames")
    t -= t.mean()
    slope = (centres * t[None, :, None]).sum(axis=1) / (t**2).sum()  # (N, 2): px/frame in x and y
    horizontal = np.abs(slope[:, 0]) >= np.abs(slope[:, 1])
    index = np.where(horizontal, np.where(slope[:, 0] < 0, 0, 1), np.where(slope[:, 1] < 0, 2, 3))
    fast = np.abs(slope).max(axis=1) >= min_speed
    return np.where(fast, index, -1)


def _ink_boxes(grey: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Top-left ``(x, y)`` of the ``SPRITE_SIDE`` box centred on each frame's ink bounding box, ``(N, T)`` each."""
    ink = np.where(grey > _INK, grey, 0.0)

    def centre(profile: np.ndarray) -> np.ndarray:
        # A row or column counts when it holds at least half a pixel of ink: stray faint pixels do not stretch it.
        on = profile > 0.5
        idx = np.arange(profile.shape[-1])
        lo = np.where(on, idx, profile.shape[-1]).min(axis=-1)
        hi = np.where(on, idx, -1).max(axis=-1)
        mid = np.where(hi >= lo, (lo + hi) / 2.0, (profile.shape[-1] - 1) / 2.0)  # no ink: the frame's middle
        return np.rint(mid - (SPRITE_SIDE - 1) / 2.0).astype(np.int64)

    return centre(ink.sum(axis=-2)), centre(ink.sum(axis=-1))


def frame_digit_features(frames: np.ndarray) -> np.ndarray:
    """A ``SPRITE_SIDE`` crop centred on every frame's ink bounding box, pooled to scikit-learn's 8x8 digit format.

    The bounding box, not the centre of mass, places the crop: scikit-learn's digits fill their 8x8 box from top to
    bottom and are centred in it across, so the box centre finds the sprite within a pixel, while the centre of mass
    moves with the digit's shape; the RBF classifier reads a digit shifted by 2 pixels (1 after pooling) poorly.

    Args:
        frames: ``(N, T, H, W[, C])`` clips in [0, 1].

    Returns:
        ``(N * T, 64)`` grey levels in 0-16, frame-major within each clip (what the digit classifier reads).
    """
    grey = _grey(frames)
    n, t, _, _ = grey.shape
    xs, ys = _ink_boxes(grey)
    pad = SPRITE_SIDE  # a crop reaching past the edge sees black
    padded = np.pad(grey, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    crops = np.empty((n, t, SPRITE_SIDE, SPRITE_SIDE), dtype=np.float32)
    for i in range(n):
        for j in range(t):
            x, y = xs[i, j] + pad, ys[i, j] + pad
            crops[i, j] = padded[i, j, y : y + SPRITE_SIDE, x : x + SPRITE_SIDE]
    f = SPRITE_SIDE // 8
    pooled = crops.reshape(n * t, 8, f, 8, f).mean(axis=(2, 4))
    return pooled.reshape(n * t, 64) * 16.0


@dataclass(frozen=True)
class VideoAccuracy:
    """How many clips show what their prompt asked for.

    Attributes:
        digit: Fraction of clips whose frames' majority vote is the requested digit.
        frame_digit: Fraction of all frames read as the requested digit.
        direction: Fraction of clips moving in the requested direction.
        both: Fraction of clips right on digit and direction.
    """

    digit: float
    frame_digit: float
    direction: float
    both: float


def video_accuracy(
    frames: np.ndarray, digits: Sequence[int], directions: Sequence[str | int], classifier: Any = None
) -> VideoAccuracy:
    """Check clips against their prompts with an independent classifier and the centre-of-mass trajectory.

    Args:
        frames: ``(N, T, H, W[, C])`` clips in [0, 1] (white digit on black), e.g. from :func:`generate_videos`.
        digits: The requested digit of each clip.
        directions: The requested direction of each clip (name or index).
        classifier: A fitted scikit-learn classifier of 8x8 digits; default
            :func:`fastdit.reference.digits.fit_digit_classifier` (fitted on each call: pass one to reuse it).

    Returns:
        The :class:`VideoAccuracy` fractions.

    Raises:
        ValueError: If the lengths disagree, a direction is unknown or the frames are not ``(N, T, H, W[, C])``.
    """
    grey = _grey(frames)
    n, t = grey.shape[:2]
    if not len(digits) == len(directions) == n:
        raise ValueError(f"{n} clips, {len(digits)} digits, {len(directions)} directions: pass one of each per clip")
    if classifier is None:
        from fastdit.reference.digits import fit_digit_classifier

        classifier = fit_digit_classifier()
    wanted = np.asarray(digits, dtype=np.int64)
    read = np.asarray(classifier.predict(frame_digit_features(grey))).reshape(n, t)
    votes = np.array([np.bincount(row, minlength=10).argmax() for row in read])
    digit_ok = votes == wanted
    direction_ok = motion_directions(grey) == np.array([_direction_index(d) for d in directions])
    return VideoAccuracy(
        digit=float(digit_ok.mean()),
        frame_digit=float((read == wanted[:, None]).mean()),
        direction=float(direction_ok.mean()),
        both=float((digit_ok & direction_ok).mean()),
    )
