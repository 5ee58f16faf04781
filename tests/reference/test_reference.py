"""The packaged reference pipeline: it loads offline, has the declared shape, and draws the digit it is asked for."""

from __future__ import annotations

import pytest
import torch

from fastdit.reference import (
    REFERENCE_DEFAULTS,
    REFERENCE_TRUE_CFG,
    digit_prompt,
    load_reference_pipeline,
    reference_dir,
)
from fastdit.reference.digits import digit_accuracy, digit_features, fit_digit_classifier, generate_digits
from fastdit.testing.components.tokenizers import clip_tokenizer, t5_tokenizer

pytest.importorskip("sklearn")

DIGITS = [d for _ in range(3) for d in range(10)]
SEEDS = [s for s in range(3) for _ in range(10)]
MIN_ACCURACY = 0.9


@pytest.fixture(scope="module")
def pipe():
    return load_reference_pipeline()


@pytest.fixture(scope="module")
def classifier():
    return fit_digit_classifier()


def test_weights_are_packaged_and_small():
    files = [f for f in reference_dir().rglob("*") if f.is_file()]
    assert any(f.suffix == ".safetensors" for f in files)
    assert sum(f.stat().st_size for f in files) <= 20 * 10**6


def test_pipeline_has_declared_shape(pipe):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    assert isinstance(pipe, FluxPipeline)
    assert isinstance(pipe.transformer, FluxTransformer2DModel)
    assert isinstance(pipe.vae, AutoencoderKL)
    assert isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler)
    blocks = len(pipe.transformer.transformer_blocks) + len(pipe.transformer.single_transformer_blocks)
    assert blocks >= 8
    assert pipe.transformer.config.guidance_embeds is False
    # 4 latent channels packed 2x2 -> 16 transformer channels; VAE factor 2 -> 32x32 images make 64 tokens.
    assert pipe.transformer.config.in_channels == 4 * pipe.vae.config.latent_channels
    assert pipe.vae_scale_factor == 2
    assert all(p.dtype == torch.float32 for p in pipe.transformer.parameters())


def test_tokenizers_are_the_local_ones(pipe):
    prompts = [digit_prompt(d) for d in range(10)] + [""]
    assert pipe.tokenizer(prompts).input_ids == clip_tokenizer()(prompts).input_ids
    assert pipe.tokenizer_2(prompts).input_ids == t5_tokenizer()(prompts).input_ids


def test_digit_prompt():
    assert digit_prompt(7) == "a handwritten digit 7"
    for bad in (-1, 10, 3.0, "3"):
        with pytest.raises(ValueError, match="digit"):
            digit_prompt(bad)


def test_classifier_reads_real_digits(classifier):
    # The quality checks below are only as good as the classifier: it must read pooled-back training digits.
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.from_numpy(data.images[:200] / 16.0).float()[:, None]
    big = torch.nn.functional.interpolate(images, size=(32, 32), mode="bicubic").clamp(0, 1)
    rgb = big.permute(0, 2, 3, 1).repeat(1, 1, 1, 3).numpy()
    assert digit_features(rgb).shape == (200, 64)
    assert digit_accuracy(rgb, data.target[:200], classifier) >= 0.98


def test_generated_digits_match_prompt(pipe, classifier):
    images = generate_digits(pipe, DIGITS, SEEDS)
    assert images.shape == (len(DIGITS), REFERENCE_DEFAULTS["height"], REFERENCE_DEFAULTS["width"], 3)
    assert digit_accuracy(images, DIGITS, classifier) >= MIN_ACCURACY


def test_true_cfg_digits_match_prompt(pipe, classifier):
    images = generate_digits(pipe, DIGITS, SEEDS, **REFERENCE_TRUE_CFG)
    assert digit_accuracy(images, DIGITS, classifier) >= MIN_ACCURACY
