"""PSNR/SSIM of fastdit.metrics against an independent numpy implementation, on real images with real distortions."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

from fastdit.metrics import Comparison, as_images, compare, json_safe, psnr, ssim
from tests.metrics.independent import (
    add_noise,
    astronaut_small,
    blur,
    camera_small,
    coffee_crop,
    jpeg,
    psnr_reference,
    ssim_reference,
)

PSNR_TOLERANCE_DB = 0.05
SSIM_TOLERANCE = 0.01

IMAGES = {"astronaut": astronaut_small, "coffee": coffee_crop, "camera": camera_small}
DISTORTIONS = {
    "noise": lambda image: add_noise(image, sigma=8.0),
    "blur": lambda image: blur(image, sigma=1.2),
    "jpeg": lambda image: jpeg(image, quality=25),
}


@pytest.mark.parametrize("distortion", DISTORTIONS)
@pytest.mark.parametrize("image_name", IMAGES)
def test_agrees_with_independent_implementation(image_name: str, distortion: str) -> None:
    reference = IMAGES[image_name]()
    test = DISTORTIONS[distortion](reference)
    result = compare(reference, test)
    expected_psnr, expected_ssim = psnr_reference(reference, test, 255.0), ssim_reference(reference, test, 255.0)
    # The distortions are strong enough that a metric computed on the wrong data would show.
    assert 20.0 < expected_psnr < 45.0 and expected_ssim < 0.95
    assert result.psnr == pytest.approx(expected_psnr, abs=PSNR_TOLERANCE_DB)
    assert result.ssim == pytest.approx(expected_ssim, abs=SSIM_TOLERANCE)
    assert result.count == 1 and result.psnr_min == result.psnr and result.ssim_min == result.ssim


def test_ssim_definition_is_exact() -> None:
    # Population vs sample covariance moves SSIM by only ~3e-4 here, well inside the 0.01 tolerance above; pin the
    # definition (Gaussian 11x11, σ=1.5, population statistics, valid-region mean) to floating-point accuracy.
    reference = astronaut_small()
    test = add_noise(reference, sigma=8.0)
    assert ssim(reference, test) == pytest.approx(ssim_reference(reference, test, 255.0), abs=1e-9)
    assert psnr(reference, test) == pytest.approx(psnr_reference(reference, test, 255.0), abs=1e-9)


def test_identical_images_give_inf_psnr_and_unit_ssim() -> None:
    image = astronaut_small()
    result = compare(image, image.copy())
    assert result.psnr == math.inf and result.psnr_min == math.inf
    assert result.ssim == pytest.approx(1.0, abs=1e-12)
    text = json.dumps(result.to_dict(), allow_nan=False)
    assert json.loads(text)["psnr"] == "inf"
    assert float(json.loads(text)["psnr"]) == math.inf


def test_json_safe() -> None:
    assert json_safe(31.5) == 31.5
    assert json_safe(math.inf) == "inf"
    assert json_safe(-math.inf) == "-inf"
    assert json_safe(math.nan) == "nan"


def test_batch_reports_mean_min_and_per_frame() -> None:
    reference = astronaut_small()
    frames_a = np.stack([reference] * 4)
    frames_b = np.stack([reference, add_noise(reference, 4.0), add_noise(reference, 12.0), blur(reference, 1.5)])
    result = compare(frames_a, frames_b)
    expected_psnr = [psnr_reference(a, b, 255.0) for a, b in zip(frames_a, frames_b, strict=True)]
    expected_ssim = [ssim_reference(a, b, 255.0) for a, b in zip(frames_a, frames_b, strict=True)]
    assert result.count == 4
    assert result.psnr_per_frame[0] == math.inf
    assert list(result.psnr_per_frame[1:]) == pytest.approx(expected_psnr[1:], abs=PSNR_TOLERANCE_DB)
    assert list(result.ssim_per_frame) == pytest.approx(expected_ssim, abs=SSIM_TOLERANCE)
    assert result.psnr == math.inf  # the mean of dB values including an identical frame
    assert result.psnr_min == pytest.approx(min(expected_psnr), abs=PSNR_TOLERANCE_DB)
    assert result.ssim == pytest.approx(float(np.mean(expected_ssim)), abs=SSIM_TOLERANCE)
    assert result.ssim_min == pytest.approx(min(expected_ssim), abs=SSIM_TOLERANCE)
    assert psnr(frames_a[1:], frames_b[1:]) == pytest.approx(float(np.mean(expected_psnr[1:])), abs=1e-9)


def test_sequences_may_change_size_between_positions() -> None:
    pairs = [(astronaut_small(), add_noise(astronaut_small(), 6.0)), (coffee_crop(), jpeg(coffee_crop(), 30))]
    result = compare([a for a, _ in pairs], [b for _, b in pairs])
    assert result.count == 2
    assert list(result.ssim_per_frame) == pytest.approx([ssim_reference(a, b, 255.0) for a, b in pairs], abs=1e-9)


def test_input_types_and_layouts_agree() -> None:
    reference, test = coffee_crop(), add_noise(coffee_crop(), 10.0)
    expected = compare(reference, test)
    chw_a, chw_b = torch.from_numpy(reference).permute(2, 0, 1), torch.from_numpy(test).permute(2, 0, 1)
    variants = {
        "pil": (Image.fromarray(reference), Image.fromarray(test), None),
        "torch CHW (default)": (chw_a, chw_b, None),
        "torch HWC": (torch.from_numpy(reference), torch.from_numpy(test), "HWC"),
        "numpy CHW": (chw_a.numpy(), chw_b.numpy(), "CHW"),
    }
    for name, (a, b, layout) in variants.items():
        result = compare(a, b, layout=layout)
        assert (result.psnr, result.ssim) == (expected.psnr, expected.ssim), name
    batch = compare(torch.stack([chw_a, chw_a]), torch.stack([chw_b, chw_a]))  # NCHW
    assert batch.psnr_per_frame[0] == expected.psnr and batch.psnr_per_frame[1] == math.inf


def test_torch_half_precision_and_float_images() -> None:
    reference = astronaut_small().astype(np.float32) / 255.0
    test = add_noise(astronaut_small(), 8.0).astype(np.float32) / 255.0
    expected_ssim = ssim_reference(reference, test, 1.0)
    assert ssim(reference, test) == pytest.approx(expected_ssim, abs=1e-6)
    assert psnr(reference, test) == pytest.approx(psnr_reference(reference, test, 1.0), abs=1e-4)
    as_bf16 = [torch.from_numpy(x).permute(2, 0, 1).to(torch.bfloat16) for x in (reference, test)]
    # bfloat16 keeps ~3 significant digits: the metric is computed on its float32 expansion.
    assert ssim(*as_bf16) == pytest.approx(expected_ssim, abs=SSIM_TOLERANCE)


def test_float_outside_unit_range_needs_data_range() -> None:
    reference = astronaut_small().astype(np.float64) / 127.5 - 1.0  # [-1, 1]
    test = add_noise(astronaut_small(), 8.0).astype(np.float64) / 127.5 - 1.0
    with pytest.raises(ValueError, match="data_range"):
        psnr(reference, test)
    assert psnr(reference, test, data_range=2.0) == pytest.approx(psnr_reference(reference, test, 2.0), abs=1e-9)
    assert ssim(reference, test, data_range=2.0) == pytest.approx(ssim_reference(reference, test, 2.0), abs=1e-9)


def test_shape_mismatch_names_both_shapes() -> None:
    with pytest.raises(ValueError, match=r"\(128, 128, 3\).*\(64, 128, 3\)"):
        compare(astronaut_small(), astronaut_small()[:64])


def test_dtype_mismatch_names_both() -> None:
    image = astronaut_small()
    with pytest.raises(ValueError, match=r"uint8.*float32"):
        psnr(image, image.astype(np.float32) / 255.0)


def test_batch_count_mismatch_names_both_shapes() -> None:
    frames = np.stack([astronaut_small()] * 3)
    with pytest.raises(ValueError, match=r"\(3, 128, 128, 3\).*\(2, 128, 128, 3\)"):
        compare(frames, frames[:2])


def test_ssim_rejects_images_smaller_than_window() -> None:
    small = astronaut_small()[:8, :8]
    with pytest.raises(ValueError, match="at least 11"):
        ssim(small, add_noise(small, 5.0))
    assert math.isfinite(psnr(small, add_noise(small, 5.0)))


def test_unknown_metric_is_rejected() -> None:
    with pytest.raises(ValueError, match="lpips"):
        compare(astronaut_small(), astronaut_small(), metrics=("psnr", "lpips"))


def test_only_requested_metrics_are_computed() -> None:
    result = compare(camera_small(), blur(camera_small(), 1.0), metrics=("psnr",))
    assert result.ssim is None and result.ssim_per_frame == ()
    assert set(result.to_dict()) == {"count", "psnr", "psnr_min"}
    assert isinstance(result, Comparison)


def test_as_images_splits_batches_and_keeps_single_images() -> None:
    assert len(as_images(np.zeros((5, 16, 16, 3), dtype=np.uint8))) == 5
    assert as_images(np.zeros((3, 16, 16), dtype=np.uint8))[0].shape == (3, 16, 16)  # numpy: one HWC image
    assert as_images(torch.zeros(3, 16, 20, dtype=torch.uint8))[0].shape == (16, 20, 3)  # torch: one CHW image
    assert as_images(Image.new("P", (20, 16)))[0].shape == (16, 20, 3)  # palettes become RGB
