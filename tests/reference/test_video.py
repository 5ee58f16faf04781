"""The video reference: its clip generator, the independent checker (on ground-truth clips, no weights needed), the
training script end to end (``--quick``, slow) and, where the trained weights are packaged, their quality."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fastdit.reference.video import (
    DIRECTIONS,
    MOTION_WORDS,
    VIDEO_REFERENCE_CFG,
    VIDEO_REFERENCE_DEFAULTS,
    digit_sprites,
    frame_centres,
    generate_videos,
    load_video_reference_pipeline,
    motion_directions,
    render_moving_digits,
    sample_motions,
    video_accuracy,
    video_prompt,
    video_reference_dir,
)
from fastdit.testing.components.tokenizers import t5_tokenizer

pytest.importorskip("sklearn")

ROOT = Path(__file__).resolve().parents[2]
N_CLIPS = 40


@pytest.fixture(scope="module")
def classifier():
    from fastdit.reference.digits import fit_digit_classifier

    return fit_digit_classifier()


@pytest.fixture(scope="module")
def truth():
    """40 ground-truth clips rendered exactly as the training data: frames, digits, directions."""
    sprites, labels = digit_sprites()
    generator = torch.Generator().manual_seed(0)
    index = torch.randint(0, len(labels), (N_CLIPS,), generator=generator)
    directions, speeds, starts = sample_motions(N_CLIPS, generator)
    clips = render_moving_digits(sprites[index], directions, speeds, starts)
    return clips.numpy(), labels[index].tolist(), directions.tolist()


def test_video_prompt():
    assert video_prompt(7, "left") == "a handwritten digit 7 moving left"
    assert video_prompt(0, 3) == "a handwritten digit 0 moving down"
    for digit, direction in ((10, "up"), (-1, "up"), (3.0, "up"), (True, "up"), (3, "sideways"), (3, 4)):
        with pytest.raises(ValueError, match=r"digit|direction"):
            video_prompt(digit, direction)


def test_motion_words_are_whole_tokens_and_the_default_vocabulary_is_unchanged():
    plain, extended = t5_tokenizer(), t5_tokenizer(extra_words=MOTION_WORDS)
    assert len(extended) == len(plain) + len(MOTION_WORDS)
    assert plain.get_vocab() == t5_tokenizer(extra_words=()).get_vocab()
    assert extended.tokenize(video_prompt(7, "right"))[-2:] == ["▁moving", "▁right"]
    assert len(extended(video_prompt(7, "right")).input_ids) <= VIDEO_REFERENCE_DEFAULTS["max_sequence_length"]


def test_clips_move_rigidly_inside_the_frame():
    sprites, _ = digit_sprites()
    generator = torch.Generator().manual_seed(1)
    directions, speeds, starts = sample_motions(200, generator)
    clips = render_moving_digits(sprites[:200], directions, speeds, starts)
    assert clips.shape == (200, 9, 32, 32)
    # Nothing leaves the frame: every frame holds the whole sprite.
    assert torch.allclose(clips.sum(dim=(2, 3)), sprites[:200].sum(dim=(1, 2))[:, None].expand(200, 9), atol=1e-3)
    # The first frame's sprite sits at its start; the last moved speed x 8 pixels in its direction.
    steps = torch.tensor([(-1, 0), (1, 0), (0, -1), (0, 1)])[directions] * speeds[:, None] * 8
    for i in range(0, 200, 37):
        (x0, y0), (x1, y1) = starts[i].tolist(), (starts[i] + steps[i]).tolist()
        assert torch.equal(clips[i, 0, y0 : y0 + 16, x0 : x0 + 16], sprites[i])
        assert torch.equal(clips[i, -1, y1 : y1 + 16, x1 : x1 + 16], sprites[i])
    assert set(speeds.tolist()) == {1, 2} and set(directions.tolist()) == {0, 1, 2, 3}


def test_checker_reads_ground_truth(truth, classifier):
    frames, digits, directions = truth
    rgb = np.repeat(frames[..., None], 3, axis=-1)  # pipelines return (N, T, H, W, 3)
    acc = video_accuracy(rgb, digits, directions, classifier)
    assert acc.direction == 1.0
    assert acc.digit >= 0.95 and acc.frame_digit >= 0.95
    assert acc.both == pytest.approx(acc.digit)
    names = [DIRECTIONS[d] for d in directions]
    assert video_accuracy(frames, digits, names, classifier) == acc


def test_checker_fails_on_wrong_digits_and_directions(truth, classifier):
    frames, digits, directions = truth
    wrong_digit = video_accuracy(frames, [(d + 1) % 10 for d in digits], directions, classifier)
    assert wrong_digit.digit <= 0.1 and wrong_digit.both <= 0.1 and wrong_digit.direction == 1.0
    opposite = [d ^ 1 for d in directions]  # left <-> right, up <-> down
    assert video_accuracy(frames, digits, opposite, classifier).direction == 0.0
    assert video_accuracy(frames[:, ::-1], digits, directions, classifier).direction == 0.0  # played backwards
    turned = [(d + 2) % 4 for d in directions]  # horizontal <-> vertical
    assert video_accuracy(frames, digits, turned, classifier).direction == 0.0


def test_still_and_empty_clips_have_no_direction(truth):
    frames, _, _ = truth
    still = np.repeat(frames[:, :1], 9, axis=1)
    assert (motion_directions(still) == -1).all()
    empty = np.zeros((2, 9, 32, 32), dtype=np.float32)
    assert (motion_directions(empty) == -1).all()
    assert np.allclose(frame_centres(empty), 15.5)


def test_checker_rejects_bad_input(truth, classifier):
    frames, digits, directions = truth
    with pytest.raises(ValueError, match="clips"):
        video_accuracy(frames, digits[:-1], directions, classifier)
    with pytest.raises(ValueError, match="direction"):
        video_accuracy(frames, digits, ["north"] * len(digits), classifier)
    with pytest.raises(ValueError, match="expected"):
        video_accuracy(frames[0], digits, directions, classifier)


def test_missing_weights_name_the_training_script(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"model_index\.json"):
        load_video_reference_pipeline(path=tmp_path)
    try:
        video_reference_dir()
    except FileNotFoundError as error:
        assert "tools/train_video_reference.py" in str(error)


@pytest.mark.slow
@pytest.mark.timeout(900)  # about 30 s of CPU time, but minutes of wall time on a loaded machine
def test_training_script_quick_run_loads_and_generates(tmp_path):
    # The whole script on a CPU with tiny step counts: both stages, the checkpoints, the folder, the logs.
    from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel

    out, log, eval_log = tmp_path / "pipe", tmp_path / "train.json", tmp_path / "eval.json"
    cmd = [sys.executable, str(ROOT / "tools/train_video_reference.py"), "--quick", "--out", str(out)]
    cmd += ["--log", str(log), "--eval-log", str(eval_log)]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, timeout=840)
    record = json.loads(log.read_text())
    assert record["complete"] and record["transformer"]["steps"] == record["args"]["steps"]
    assert set(json.loads(eval_log.read_text())["paths"]) == {"one forward per step", "CFG"}
    assert not list(tmp_path.glob(".*"))  # no staging folder left behind

    pipe = load_video_reference_pipeline(path=out)
    assert isinstance(pipe, WanPipeline)
    assert isinstance(pipe.transformer, WanTransformer3DModel) and isinstance(pipe.vae, AutoencoderKLWan)
    assert pipe.vae_scale_factor_spatial == 4 and pipe.vae_scale_factor_temporal == 4
    frames = generate_videos(pipe, [3, 5], ["left", "up"], [0, 1], num_inference_steps=2, **VIDEO_REFERENCE_CFG)
    assert frames.shape == (2, 9, 32, 32, 3) and frames.min() >= 0.0 and frames.max() <= 1.0


# ------------------------------------------------------------------------------------------ the packaged weights ---

# Clips of the quality checks: digits 0-9 with seeds 0-9, every digit meeting every direction across the set.
QUALITY_DIGITS = list(range(10))
QUALITY_DIRECTIONS = [d % 4 for d in range(10)]


@pytest.fixture(scope="module")
def pipe():
    try:
        video_reference_dir()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    return load_video_reference_pipeline()


def test_packaged_pipeline_is_small_and_has_declared_shape(pipe):
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    files = [f for f in video_reference_dir().rglob("*") if f.is_file()]
    assert sum(f.stat().st_size for f in files) <= 15 * 10**6
    assert isinstance(pipe, WanPipeline) and isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler)
    assert isinstance(pipe.transformer, WanTransformer3DModel) and pipe.transformer_2 is None
    assert isinstance(pipe.vae, AutoencoderKLWan)
    assert len(pipe.transformer.blocks) >= 8
    # 9x32x32 pixels -> 3x8x8 latents -> (1, 2, 2) patches: 48 tokens.
    assert (pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal) == (4, 4)
    assert tuple(pipe.transformer.config.patch_size) == (1, 2, 2)
    # Trained latent statistics, not the placeholders the untrained VAE starts with.
    assert pipe.vae.config.latents_std != [1.0] * pipe.vae.config.z_dim
    prompts = [video_prompt(d, r) for d in range(10) for r in DIRECTIONS] + [""]
    assert pipe.tokenizer(prompts).input_ids == t5_tokenizer(extra_words=MOTION_WORDS)(prompts).input_ids


def test_packaged_pipeline_draws_the_prompt_with_cfg(pipe, classifier):
    frames = generate_videos(pipe, QUALITY_DIGITS, QUALITY_DIRECTIONS, list(range(10)), **VIDEO_REFERENCE_CFG)
    assert frames.shape == (10, 9, 32, 32, 3)
    acc = video_accuracy(frames, QUALITY_DIGITS, QUALITY_DIRECTIONS, classifier)
    assert acc.direction == 1.0 and acc.digit >= 0.8, acc
    # The check can fail: the same clips against shifted labels.
    wrong = video_accuracy(
        frames, [(d + 3) % 10 for d in QUALITY_DIGITS], [d ^ 1 for d in QUALITY_DIRECTIONS], classifier
    )
    assert wrong.digit <= 0.2 and wrong.direction == 0.0, wrong


@pytest.mark.slow
def test_packaged_pipeline_quality_on_40_clips(pipe, classifier):
    n = 40
    digits, directions = [i % 10 for i in range(n)], [(i // 10 + i) % 4 for i in range(n)]
    cfg = video_accuracy(generate_videos(pipe, digits, directions, list(range(n)), **VIDEO_REFERENCE_CFG), digits,
                         directions, classifier)  # fmt: skip
    assert cfg.digit >= 0.9 and cfg.direction >= 0.95, cfg
    plain = video_accuracy(generate_videos(pipe, digits, directions, list(range(n))), digits, directions, classifier)
    assert plain.direction >= 0.9 and plain.digit >= 0.5, plain
