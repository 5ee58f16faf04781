"""`fastdit metrics`: images, directories and videos, JSON and table output, and exit code 2 on bad input."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fastdit.cli import main
from fastdit.io import load_video, save_image, save_video, write_text
from tests.metrics.independent import (
    add_noise,
    astronaut_small,
    blur,
    coffee_crop,
    jpeg,
    psnr_reference,
    ssim_reference,
)

PSNR_TOLERANCE_DB = 0.05
SSIM_TOLERANCE = 0.01


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture
def image_pair(tmp_path: Path) -> tuple[Path, Path, np.ndarray, np.ndarray]:
    reference, test = astronaut_small(), add_noise(astronaut_small(), 7.0)
    return save_image(tmp_path / "ref.png", reference), save_image(tmp_path / "test.png", test), reference, test


def _assert_one_line_error(code: int, out: str, err: str, *needles: str) -> None:
    assert code == 2 and out == ""
    assert err.startswith("fastdit: error: ") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, (needle, err)


def test_image_pair_json_matches_independent_metrics(image_pair: tuple, capsys: pytest.CaptureFixture[str]) -> None:
    path_a, path_b, reference, test = image_pair
    code, out, _ = _run(["metrics", "psnr", "ssim", str(path_a), str(path_b), "--json"], capsys)
    assert code == 0
    payload = _last_json(out)
    assert set(payload) == {"psnr", "ssim"}
    assert payload["psnr"] == pytest.approx(psnr_reference(reference, test, 255.0), abs=PSNR_TOLERANCE_DB)
    assert payload["ssim"] == pytest.approx(ssim_reference(reference, test, 255.0), abs=SSIM_TOLERANCE)


def test_identical_images_write_inf_as_string(image_pair: tuple, capsys: pytest.CaptureFixture[str]) -> None:
    path_a = image_pair[0]
    code, out, _ = _run(["metrics", str(path_a), str(path_a), "--json"], capsys)
    payload = _last_json(out)  # json.loads would also accept the invalid token Infinity: check the text too
    assert code == 0 and payload == {"psnr": "inf", "ssim": 1.0} and "Infinity" not in out


def test_table_output(image_pair: tuple, capsys: pytest.CaptureFixture[str]) -> None:
    path_a, path_b, reference, test = image_pair
    code, out, _ = _run(["metrics", "ssim", "psnr", str(path_a), str(path_b)], capsys)
    header, row = out.strip().splitlines()
    assert code == 0
    assert header.split() == ["SSIM", "PSNR", "(dB)"]  # the user's metric order
    assert row.split() == [
        "test.png",
        f"{ssim_reference(reference, test, 255.0):.4f}",
        f"{psnr_reference(reference, test, 255.0):.2f}",
    ]


def test_single_metric_json(image_pair: tuple, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(["metrics", "psnr", str(image_pair[0]), str(image_pair[1]), "--json"], capsys)
    assert code == 0 and set(_last_json(out)) == {"psnr"}


def _write_directories(tmp_path: Path) -> tuple[Path, Path, dict[str, tuple[np.ndarray, np.ndarray]]]:
    pairs = {
        "a.png": (astronaut_small(), blur(astronaut_small(), 1.0)),
        "b.png": (coffee_crop(), jpeg(coffee_crop(), 20)),  # another size: pairs need not share one
        "c.png": (astronaut_small(), astronaut_small()),
    }
    for name, (reference, test) in pairs.items():
        save_image(tmp_path / "A" / name, reference)
        save_image(tmp_path / "B" / name, test)
    # Not images, or hidden: ignored by the pairing.
    write_text(tmp_path / "A" / "notes.txt", "ignored")
    save_image(tmp_path / "B" / ".hidden.png", astronaut_small())
    return tmp_path / "A", tmp_path / "B", pairs


def test_directories_pair_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dir_a, dir_b, pairs = _write_directories(tmp_path)
    code, out, _ = _run(["metrics", "psnr", "ssim", str(dir_a), str(dir_b), "--json"], capsys)
    assert code == 0
    payload = _last_json(out)
    psnrs = [psnr_reference(a, b, 255.0) for a, b in pairs.values()]
    ssims = [ssim_reference(a, b, 255.0) for a, b in pairs.values()]
    assert set(payload) == {"psnr", "ssim", "psnr_min", "ssim_min", "count"}
    assert payload["count"] == 3
    assert payload["psnr"] == "inf"  # c.png is identical
    assert payload["psnr_min"] == pytest.approx(min(psnrs), abs=PSNR_TOLERANCE_DB)
    assert payload["ssim"] == pytest.approx(float(np.mean(ssims)), abs=SSIM_TOLERANCE)
    assert payload["ssim_min"] == pytest.approx(min(ssims), abs=SSIM_TOLERANCE)


def test_directory_table_has_one_row_per_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dir_a, dir_b, _ = _write_directories(tmp_path)
    code, out, _ = _run(["metrics", str(dir_a), str(dir_b)], capsys)
    labels = [line.split()[0] for line in out.strip().splitlines()[1:]]
    assert code == 0 and labels == ["a.png", "b.png", "c.png", "mean", "min"]


def test_unpaired_names_are_listed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dir_a, dir_b, _ = _write_directories(tmp_path)
    save_image(dir_a / "only_a.png", astronaut_small())
    save_image(dir_b / "only_b.jpg", astronaut_small())
    _assert_one_line_error(*_run(["metrics", str(dir_a), str(dir_b)], capsys), "only_a.png", "only_b.jpg")


def test_video_pair_reports_per_frame_min(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = astronaut_small()[:96, :96]
    clean = np.stack([np.roll(base, 2 * i, axis=1) for i in range(5)])
    # Frame 3 is damaged far more than the others: the minimum must find it, the mean must not hide it.
    damaged = np.stack([add_noise(frame, 40.0 if i == 3 else 2.0, seed=i) for i, frame in enumerate(clean)])
    path_a, path_b = save_video(tmp_path / "a.mp4", clean), save_video(tmp_path / "b.mp4", damaged)
    code, out, _ = _run(["metrics", "psnr", "ssim", str(path_a), str(path_b), "--json"], capsys)
    assert code == 0
    payload = _last_json(out)
    decoded_a, decoded_b = load_video(path_a), load_video(path_b)  # mp4 is lossy: compare what was stored
    psnrs = [psnr_reference(a, b, 255.0) for a, b in zip(decoded_a, decoded_b, strict=True)]
    ssims = [ssim_reference(a, b, 255.0) for a, b in zip(decoded_a, decoded_b, strict=True)]
    assert int(np.argmin(psnrs)) == 3 and int(np.argmin(ssims)) == 3
    assert payload["count"] == 5
    assert payload["psnr_min"] == pytest.approx(min(psnrs), abs=PSNR_TOLERANCE_DB)
    assert payload["ssim_min"] == pytest.approx(min(ssims), abs=SSIM_TOLERANCE)
    assert payload["psnr"] == pytest.approx(float(np.mean(psnrs)), abs=PSNR_TOLERANCE_DB)
    assert payload["ssim"] == pytest.approx(float(np.mean(ssims)), abs=SSIM_TOLERANCE)
    assert payload["psnr_min"] < payload["psnr"] - 1.0


def test_missing_file_names_argument_and_path(image_pair: tuple, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(image_pair[0].parent / "nope.png")
    _assert_one_line_error(*_run(["metrics", str(image_pair[0]), missing], capsys), "argument B", missing)


def test_size_mismatch_names_both_shapes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path_a = save_image(tmp_path / "a.png", astronaut_small())
    path_b = save_image(tmp_path / "b.png", coffee_crop())
    result = _run(["metrics", str(path_a), str(path_b)], capsys)
    _assert_one_line_error(*result, "(128, 128, 3)", "(96, 144, 3)", str(path_a), str(path_b))


def test_unknown_metric_names_value(image_pair: tuple, capsys: pytest.CaptureFixture[str]) -> None:
    result = _run(["metrics", "psnr", "lpips", str(image_pair[0]), str(image_pair[1])], capsys)
    _assert_one_line_error(*result, "METRIC", "'lpips'")


def test_mixed_kinds_and_unsupported_files(image_pair: tuple, capsys: pytest.CaptureFixture[str]) -> None:
    path_a = image_pair[0]
    _assert_one_line_error(*_run(["metrics", str(path_a), str(path_a.parent)], capsys), "directory", str(path_a))
    text = write_text(path_a.parent / "notes.txt", "x")
    _assert_one_line_error(*_run(["metrics", str(text), str(text)], capsys), "argument A", "'.txt'")
    corrupt = write_text(path_a.parent / "corrupt.png", "not a png")
    _assert_one_line_error(*_run(["metrics", str(corrupt), str(corrupt)], capsys), "argument A", str(corrupt))
    _assert_one_line_error(*_run(["metrics", str(path_a)], capsys), "two inputs")


def test_images_too_small_for_ssim(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = save_image(tmp_path / "tiny.png", astronaut_small()[:8, :8])
    _assert_one_line_error(*_run(["metrics", "ssim", str(path), str(path)], capsys), "at least 11")
    code, out, _ = _run(["metrics", "psnr", str(path), str(path), "--json"], capsys)
    assert code == 0 and _last_json(out) == {"psnr": "inf"}


def test_python_dash_m_prints_json_last(image_pair: tuple) -> None:
    path_a, path_b, reference, test = image_pair
    completed = subprocess.run(
        [sys.executable, "-m", "fastdit", "metrics", "psnr", "ssim", str(path_a), str(path_b), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert completed.returncode == 0, completed.stderr
    payload = json.loads(completed.stdout.strip().splitlines()[-1])
    assert payload["psnr"] == pytest.approx(psnr_reference(reference, test, 255.0), abs=PSNR_TOLERANCE_DB)
    assert payload["ssim"] == pytest.approx(ssim_reference(reference, test, 255.0), abs=SSIM_TOLERANCE)
    assert math.isfinite(payload["psnr"])
