"""Atomic writes, image and video round trips, and the install hint for the optional video packages."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

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
    assert _listing(tmp_path) == []  # the parent it created is gone too


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


def test_temp_file_lives_beside_target_hidden_and_without_its_suffix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[Path, Path]] = []
    real_replace = os.replace

    def spying_replace(src: Path, dst: Path) -> None:
        seen.append((Path(src), Path(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(fio.os, "replace", spying_replace)
    fio.save_image(tmp_path / "img.png", astronaut_small())
    ((src, dst),) = seen
    assert src.parent == dst.parent == tmp_path and src != dst
    # A kill -9 mid-write must leave nothing that an image glob picks up.
    assert src.name.startswith(".") and not src.name.endswith(".png")


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


def _failing_on_call(number: int) -> Any:
    """A stand-in for Pillow's writer that fills the disk on its ``number``-th call."""
    real_save = Image.Image.save
    calls = []

    def save(self: Image.Image, *args: Any, **kwargs: Any) -> None:
        calls.append(1)
        if len(calls) == number:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(self, *args, **kwargs)

    return save


def _save_all(paths: list[Path]) -> None:
    with fio.atomic_outputs(paths) as temps:
        for index, temp in enumerate(temps):
            fio.encode_image(temp, astronaut_small() // (index + 1), suffix=paths[index].suffix)


def test_atomic_outputs_write_all_or_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = [tmp_path / "a" / "many" / f"{i:04d}.png" for i in range(6)]
    monkeypatch.setattr(Image.Image, "save", _failing_on_call(3))
    with pytest.raises(OSError, match="No space left"):
        _save_all(paths)
    assert _listing(tmp_path) == []  # no image, no staging directory, not even the parents it created
    monkeypatch.undo()
    _save_all(paths)
    assert _listing(tmp_path / "a") == ["many"]
    assert _listing(tmp_path / "a" / "many") == [p.name for p in paths]
    assert np.array_equal(fio.load_image(paths[1]), astronaut_small() // 2)


def test_atomic_outputs_into_an_existing_directory_replace_or_keep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = [tmp_path / f"{i:04d}.png" for i in range(3)]
    fio.save_image(paths[0], np.zeros((8, 8, 3), np.uint8))
    (tmp_path / "notes.txt").write_text("mine")
    monkeypatch.setattr(Image.Image, "save", _failing_on_call(2))
    with pytest.raises(OSError):
        _save_all(paths)
    assert _listing(tmp_path) == ["0000.png", "notes.txt"]  # the earlier file is untouched
    assert fio.load_image(paths[0]).max() == 0
    monkeypatch.undo()
    _save_all(paths)
    assert _listing(tmp_path) == ["0000.png", "0001.png", "0002.png", "notes.txt"]
    assert np.array_equal(fio.load_image(paths[0]), astronaut_small())


def test_atomic_outputs_refuse_several_directories(tmp_path: Path) -> None:
    for paths in ([tmp_path / "a.png", tmp_path / "b" / "c.png"], [], [tmp_path / "a.png", tmp_path / "a.png"]):
        with pytest.raises(ValueError, match="one directory"), fio.atomic_outputs(paths):
            pass
    assert _listing(tmp_path) == []


_KILLED_WRITER = """
import os, signal, sys
from pathlib import Path
import numpy as np
from PIL import Image
import fastdit.io as fio

real_save, calls = Image.Image.save, []

def save(self, *args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    real_save(self, *args, **kwargs)

Image.Image.save = save
directory = Path(sys.argv[1])
fio.save_image(directory / "single.png", np.zeros((8, 8, 3), np.uint8))
fio.save_video(directory / "clip.gif", np.zeros((2, 8, 8, 3), np.uint8))  # killed in its writer
"""

_KILLED_STAGING = """
import os, signal, sys
from pathlib import Path
import numpy as np
import fastdit.io as fio

paths = [Path(sys.argv[1]) / "many" / f"{i:04d}.png" for i in range(4)]
with fio.atomic_outputs(paths) as temps:
    for index, temp in enumerate(temps):
        if index == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        fio.encode_image(temp, np.zeros((8, 8, 3), np.uint8), suffix=".png")
"""


@pytest.mark.skipif(os.name != "posix", reason="kill -9 and the stale-writer check are POSIX")
@pytest.mark.parametrize("script", [_KILLED_WRITER, _KILLED_STAGING], ids=["single", "staged"])
def test_kill_9_leaves_no_image_and_the_next_write_cleans_up(script: str, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    leftovers = [p for p in tmp_path.rglob("*") if p.name.startswith(".fastdit-")]
    assert leftovers, "the killed writer left no temporary: the test did not kill it mid-write"
    images = {p.name for p in tmp_path.rglob("*") if p.suffix in {".png", ".gif", ".mp4"}}
    assert images <= {"single.png"}  # only what was complete before the kill
    _save_all([tmp_path / "many" / f"{i:04d}.png" for i in range(2)])  # the next write here cleans up
    fio.save_image(tmp_path / "clip.png", astronaut_small())
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(".fastdit-")]


def test_stale_temporaries_of_running_writers_stay(tmp_path: Path) -> None:
    mine = tmp_path / fio._temporary_name(fio._STAGING_PREFIX)  # this process is running
    mine.mkdir()
    other_host = tmp_path / ".fastdit-staging.elsewhere.1.abc.part"
    other_host.mkdir()
    fio.save_image(tmp_path / "x.png", astronaut_small())
    assert _listing(tmp_path) == sorted([mine.name, other_host.name, "x.png"])


@pytest.mark.parametrize(
    ("where", "directory", "message"),
    [
        ("{file}/x.png", False, "is a file, not a directory"),
        ("{file}/deeper/x.png", False, "is a file, not a directory"),
        ("{tmp}", False, "is a directory"),
        ("{file}", True, "is a file, not a directory"),
        ("/proc/x.png", False, "is not writable"),
    ],
)
def test_check_writable_refuses(where: str, directory: bool, message: str, tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    path = where.format(file=tmp_path / "f", tmp=tmp_path)
    with pytest.raises(OSError, match=message) as caught:
        fio.check_writable(path, directory=directory)
    assert caught.value.strerror.startswith(message) and caught.value.filename in {str(tmp_path / "f"), path, "/proc"}
    assert _listing(tmp_path) == ["f"]


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only directories")
def test_check_writable_refuses_a_read_only_directory(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        with pytest.raises(PermissionError, match="is not writable"):
            fio.check_writable(locked / "new" / "x.png")
    finally:
        locked.chmod(0o700)


def test_check_writable_accepts_new_paths_and_leaves_nothing(tmp_path: Path) -> None:
    fio.check_writable(tmp_path / "a" / "b" / "x.png")
    fio.check_writable(tmp_path / "dir", directory=True)
    fio.check_writable(tmp_path, directory=True)
    assert _listing(tmp_path) == []


def test_save_audio_writes_16_bit_pcm_wav(tmp_path: Path) -> None:
    import wave

    t = np.arange(400) / 100.0
    waveform = np.stack([0.5 * np.sin(2 * np.pi * t), np.clip(2.0 * np.cos(2 * np.pi * t), -3, 3)])
    path = fio.save_audio(tmp_path / "out" / "tone.wav", waveform, sample_rate=100)
    with wave.open(str(path)) as read:
        assert (read.getnchannels(), read.getsampwidth(), read.getframerate(), read.getnframes()) == (2, 2, 100, 400)
        pcm = np.frombuffer(read.readframes(400), dtype="<i2").reshape(400, 2).T / 32767.0
    np.testing.assert_allclose(pcm[0], waveform[0], atol=1 / 32767)
    assert pcm[1].max() == 1.0 and pcm[1].min() == -1.0  # beyond full scale: clipped, not wrapped
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["tone.wav"]  # no temporary left
    fio.save_audio(tmp_path / "mono.wav", waveform[0], sample_rate=100)
    with pytest.raises(ValueError, match=r"audio is saved as one of \.wav"):
        fio.save_audio(tmp_path / "tone.mp3", waveform, sample_rate=100)
    with pytest.raises(ValueError, match="sample_rate=0"):
        fio.save_audio(tmp_path / "bad.wav", waveform, sample_rate=0)
    with pytest.raises(ValueError, match=r"\(channels, samples\) or \(samples,\), got shape \(1, 2, 400\)"):
        fio.save_audio(tmp_path / "bad.wav", waveform[None], sample_rate=100)
    assert not (tmp_path / "bad.wav").exists()
