"""Atomic writes, image and video round trips, and the install hint for the optional video packages."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import fastdit.io as fio
from fastdit.metrics import psnr
from tests.metrics.independent import astronaut_small


def _listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _frames(count: int = 4) -> np.ndarray:
    # Smooth, shifted crops of a real image: what an encoder is built for, so lossy round trips stay close.
    image = astronaut_small()
    return np.stack([image[4 * i : 4 * i + 64, 8:72] for i in range(count)])


def test_atomic_output_failure_leaves_no_file_and_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "out" / "report.json"
    with pytest.raises(RuntimeError, match="writer failed"), fio.atomic_output(target) as temp:
        temp.write_text('{"half": ')
        raise RuntimeError("writer failed")
    assert _listing(tmp_path / "out") == []


def test_atomic_output_failure_keeps_previous_file(tmp_path: Path) -> None:
    target = fio.write_text(tmp_path / "notes.txt", "old")
    with pytest.raises(RuntimeError), fio.atomic_output(target) as temp:
        temp.write_text("new but unfinished")
        raise RuntimeError
    assert target.read_text() == "old"
    assert _listing(tmp_path) == ["notes.txt"]


def test_failing_rename_removes_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_replace(src: object, dst: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(fio.os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        fio.write_text(tmp_path / "a.txt", "text")
    assert _listing(tmp_path) == []


def test_temp_file_lives_beside_target_with_its_suffix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[Path, Path]] = []
    real_replace = os.replace

    def spying_replace(src: Path, dst: Path) -> None:
        seen.append((Path(src), Path(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(fio.os, "replace", spying_replace)
    fio.save_image(tmp_path / "img.png", astronaut_small())
    ((src, dst),) = seen
    assert src.parent == dst.parent == tmp_path and src.suffix == ".png" and src != dst


def test_written_files_follow_umask(tmp_path: Path) -> None:
    umask = os.umask(0o022)
    try:
        path = fio.write_text(tmp_path / "a.txt", "x")
    finally:
        os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o644


def test_write_json_round_trip_and_parents(tmp_path: Path) -> None:
    path = fio.write_json(tmp_path / "a" / "b" / "result.json", {"psnr": "inf", "ssim": 0.93})
    assert json.loads(path.read_text()) == {"psnr": "inf", "ssim": 0.93}
    assert path.read_text().endswith("}\n")


@pytest.mark.parametrize("bad", [{"psnr": float("inf")}, {"x": object()}])
def test_write_json_rejects_invalid_json_and_writes_nothing(tmp_path: Path, bad: dict) -> None:
    with pytest.raises((ValueError, TypeError)):
        fio.write_json(tmp_path / "r.json", bad)
    assert _listing(tmp_path) == []


def test_write_text_replaces_content(tmp_path: Path) -> None:
    fio.write_text(tmp_path / "t.txt", "first")
    fio.write_text(tmp_path / "t.txt", "second")
    assert (tmp_path / "t.txt").read_text() == "second"
    assert _listing(tmp_path) == ["t.txt"]


def test_png_round_trip_is_exact(tmp_path: Path) -> None:
    image = astronaut_small()
    assert np.array_equal(fio.load_image(fio.save_image(tmp_path / "x.png", image)), image)


def test_float_images_are_rounded_to_uint8(tmp_path: Path) -> None:
    image = astronaut_small()
    loaded = fio.load_image(fio.save_image(tmp_path / "x.png", image.astype(np.float32) / 255.0))
    assert np.array_equal(loaded, image)


def test_jpeg_and_greyscale(tmp_path: Path) -> None:
    image = astronaut_small()
    loaded = fio.load_image(fio.save_image(tmp_path / "x.jpg", image, quality=95))
    assert loaded.shape == image.shape and psnr(image, loaded) > 30.0
    grey = image[..., 0]
    fio.save_image(tmp_path / "g.png", grey)
    assert fio.load_image(tmp_path / "g.png", mode=None).shape == grey.shape
    assert fio.load_image(tmp_path / "g.png").shape == (*grey.shape, 3)


def test_mp4_round_trip(tmp_path: Path) -> None:
    frames = _frames()
    loaded = fio.load_video(fio.save_video(tmp_path / "v.mp4", frames, fps=4))
    assert loaded.shape == frames.shape and loaded.dtype == np.uint8
    assert psnr(frames, loaded) > 28.0  # lossy H.264, but the same frames in the same order
    assert psnr(frames[0], loaded[0]) > psnr(frames[0], loaded[1])
    assert _listing(tmp_path) == ["v.mp4"]


def test_gif_round_trip_is_exact_for_few_colours(tmp_path: Path) -> None:
    frames = np.zeros((3, 16, 24, 3), dtype=np.uint8)
    for index in range(3):
        frames[index, :, 4 * index : 4 * index + 8] = (255, 64 * index, 0)
    assert np.array_equal(fio.load_video(fio.save_video(tmp_path / "v.gif", frames)), frames)


def test_video_generator_failing_midway_leaves_nothing(tmp_path: Path) -> None:
    def frames() -> Iterator[np.ndarray]:
        yield from _frames(2)
        raise RuntimeError("decoder crashed")

    with pytest.raises(RuntimeError, match="decoder crashed"):
        fio.save_video(tmp_path / "v.mp4", frames())
    assert _listing(tmp_path) == []


def test_mp4_rejects_odd_sizes_without_output(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="even"):
        fio.save_video(tmp_path / "v.mp4", _frames()[:, :63])
    assert _listing(tmp_path) == []


def test_unknown_video_suffix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"\.png"):
        fio.save_video(tmp_path / "v.png", _frames())
    with pytest.raises(ValueError, match=r"\.txt"):
        fio.load_video(tmp_path / "v.txt")


@pytest.mark.parametrize(("missing", "named"), [("imageio", "'imageio'"), ("imageio_ffmpeg", "'imageio-ffmpeg'")])
def test_missing_video_packages_name_package_and_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, missing: str, named: str
) -> None:
    frames = _frames()  # before hiding imageio: scikit-image reads its sample images through it
    for module in [name for name in sys.modules if name == missing or name.startswith(missing + ".")]:
        monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.setitem(sys.modules, missing, None)  # an entry of None makes `import` raise ImportError
    for call in (lambda: fio.save_video(tmp_path / "v.mp4", frames), lambda: fio.load_video(tmp_path / "v.mp4")):
        with pytest.raises(ImportError, match=named) as error:
            call()
        assert "pip install fastdit[video]" in str(error.value)
    assert _listing(tmp_path) == []
    # GIF needs Pillow only.
    fio.save_video(tmp_path / "v.gif", frames)
