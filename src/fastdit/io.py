"""Load images and videos, and write outputs atomically.

Every writer here produces its file under a temporary name in the destination directory and renames it into place
with :func:`os.replace` (atomic on POSIX and Windows within one file system), so a reader never sees a half-written
image, video or report, and a crash or exception leaves the previous file (or no file) behind. Parent directories are
created as needed.

Images go through Pillow. GIF videos go through Pillow too; mp4 and the other container formats need the optional
packages ``imageio`` and ``imageio-ffmpeg`` (``pip install fastdit[video]``).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageSequence

__all__ = [
    "FFMPEG_VIDEO_SUFFIXES",
    "IMAGE_SUFFIXES",
    "VIDEO_SUFFIXES",
    "atomic_output",
    "load_image",
    "load_video",
    "save_image",
    "save_video",
    "write_json",
    "write_text",
]

IMAGE_SUFFIXES: frozenset[str] = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff"})
"""File suffixes read and written as still images."""

FFMPEG_VIDEO_SUFFIXES: frozenset[str] = frozenset({".mp4", ".mov", ".mkv", ".webm", ".avi"})
"""Video suffixes handled through imageio's ffmpeg plugin."""

VIDEO_SUFFIXES: frozenset[str] = FFMPEG_VIDEO_SUFFIXES | {".gif"}
"""File suffixes read and written as videos (GIF through Pillow, the rest through ffmpeg)."""

_VIDEO_EXTRA_HINT = "install it with: pip install fastdit[video]"


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success rename it onto ``path``, on error delete it.

    The temporary name keeps ``path``'s suffix, so writers that pick the format from the suffix (Pillow, ffmpeg)
    work unchanged. It is created empty and exclusively before it is yielded, with the process umask's permissions.

    Args:
        path: The final destination; its parent directories are created.

    Yields:
        The temporary path to write to.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    temp = final.with_name(f".{final.stem}.{secrets.token_hex(6)}.tmp{final.suffix}")
    os.close(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        yield temp
        _fsync(temp)
        os.replace(temp, final)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def _fsync(path: Path) -> None:
    # Flush the data before the rename so that a power loss cannot leave the new name pointing at empty blocks.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text(path: str | os.PathLike[str], text: str, *, encoding: str = "utf-8") -> Path:
    """Atomically write ``text`` to ``path``.

    Args:
        path: Destination file.
        text: Content.
        encoding: Text encoding.

    Returns:
        The destination path.
    """
    with atomic_output(path) as temp:
        temp.write_text(text, encoding=encoding)
    return Path(path)


def write_json(path: str | os.PathLike[str], data: Any, *, indent: int | None = 2) -> Path:
    """Atomically write ``data`` as strict JSON (a trailing newline included).

    Args:
        path: Destination file.
        data: A JSON-serialisable object. Non-finite floats are rejected, because ``Infinity``/``NaN`` are not JSON;
            convert them first (e.g. with :func:`fastdit.metrics.json_safe`).
        indent: Indentation, or ``None`` for one line.

    Returns:
        The destination path.

    Raises:
        ValueError: If ``data`` holds a non-finite float (nothing is written).
        TypeError: If ``data`` is not serialisable (nothing is written).
    """
    text = json.dumps(data, indent=indent, allow_nan=False) + "\n"
    return write_text(path, text)


def _to_uint8_frame(frame: Any) -> np.ndarray:
    if isinstance(frame, Image.Image):
        return np.asarray(frame.convert("RGB"))
    array = np.asarray(frame)
    if np.issubdtype(array.dtype, np.floating):
        # Floats are taken as [0, 1] images, the range fastdit's metrics assume for floats.
        array = np.round(np.clip(array, 0.0, 1.0) * 255.0).astype(np.uint8)
    if array.dtype != np.uint8 or array.ndim not in (2, 3):
        raise ValueError(f"expected a uint8 or [0, 1] float image (H, W) or (H, W, C), got {array.dtype} {array.shape}")
    return array


def save_image(path: str | os.PathLike[str], image: Any, **save_kwargs: Any) -> Path:
    """Atomically save one image; the format follows the suffix of ``path``.

    Args:
        path: Destination file (``.png``, ``.jpg``, ...).
        image: A PIL image, or a channels-last numpy array: uint8, or float in [0, 1] (rounded to uint8).
        **save_kwargs: Passed to :meth:`PIL.Image.Image.save` (e.g. ``quality=95`` for JPEG).

    Returns:
        The destination path.
    """
    pil = image if isinstance(image, Image.Image) else Image.fromarray(_to_uint8_frame(image))
    with atomic_output(path) as temp:
        pil.save(temp, **save_kwargs)
    return Path(path)


def load_image(path: str | os.PathLike[str], *, mode: str | None = "RGB") -> np.ndarray:
    """Load an image file as a channels-last numpy array.

    Args:
        path: Image file (anything Pillow reads).
        mode: Pillow mode to convert to (default ``"RGB"``, giving ``(H, W, 3)`` uint8); ``None`` keeps the file's
            own mode (e.g. ``(H, W)`` for greyscale, 16-bit PNGs as uint16).

    Returns:
        The pixels.
    """
    with Image.open(path) as image:
        if mode is not None and image.mode != mode:
            image = image.convert(mode)
        return np.array(image)


def _import_imageio() -> Any:
    try:
        import imageio.v2 as imageio_v2
    except ImportError as error:
        raise ImportError(f"reading or writing mp4 videos needs the package 'imageio'; {_VIDEO_EXTRA_HINT}") from error
    try:
        import imageio_ffmpeg  # noqa: F401  (imageio's ffmpeg plugin needs it; fail here with the install hint)
    except ImportError as error:
        raise ImportError(
            f"reading or writing mp4 videos needs the package 'imageio-ffmpeg'; {_VIDEO_EXTRA_HINT}"
        ) from error
    return imageio_v2


def load_video(path: str | os.PathLike[str]) -> np.ndarray:
    """Load all frames of a video as an ``(F, H, W, 3)`` uint8 array.

    Args:
        path: A ``.gif`` (read with Pillow) or an mp4/mov/mkv/webm/avi file (read with imageio + ffmpeg).

    Returns:
        The frames, RGB.

    Raises:
        ImportError: For ffmpeg formats when ``imageio``/``imageio-ffmpeg`` are missing.
        ValueError: If the file has no frames or an unknown suffix.
    """
    suffix = Path(path).suffix.lower()
    if suffix == ".gif":
        with Image.open(path) as image:
            frames = [np.asarray(frame.convert("RGB")) for frame in ImageSequence.Iterator(image)]
    elif suffix in FFMPEG_VIDEO_SUFFIXES:
        reader = _import_imageio().get_reader(os.fspath(path), format="FFMPEG")
        try:
            frames = [np.asarray(frame) for frame in reader]
        finally:
            reader.close()
    else:
        raise ValueError(
            f"unsupported video suffix {suffix!r} for {os.fspath(path)!r}: use one of {sorted(VIDEO_SUFFIXES)}"
        )
    if not frames:
        raise ValueError(f"video {os.fspath(path)!r} has no frames")
    return np.stack(frames)


def _write_gif(temp: Path, frames: Iterable[Any], fps: float) -> None:
    images = [Image.fromarray(_to_uint8_frame(frame)) for frame in frames]
    if not images:
        raise ValueError("save_video got no frames")
    duration_ms = max(1, round(1000.0 / fps))
    images[0].save(temp, save_all=True, append_images=images[1:], duration=duration_ms, loop=0)


def _write_ffmpeg(temp: Path, frames: Iterable[Any], fps: float, quality: float | None) -> None:
    imageio_v2 = _import_imageio()
    # macro_block_size=1: never let the writer rescale frames behind our back (it would change every metric).
    writer = imageio_v2.get_writer(os.fspath(temp), format="FFMPEG", fps=fps, quality=quality, macro_block_size=1)
    count = 0
    try:
        for frame in frames:
            array = _to_uint8_frame(frame)
            if array.shape[0] % 2 or array.shape[1] % 2:
                raise ValueError(f"mp4 (yuv420p) needs an even height and width, got frame shape {array.shape}")
            writer.append_data(array)
            count += 1
    finally:
        writer.close()
    if count == 0:
        raise ValueError("save_video got no frames")


def save_video(
    path: str | os.PathLike[str], frames: Iterable[Any], *, fps: float = 8.0, quality: float | None = 8.0
) -> Path:
    """Atomically save frames as a video; the container follows the suffix of ``path``.

    Frames are streamed to the encoder, so a generator works; if it raises part-way, no file is left behind.

    Args:
        path: Destination ``.gif`` (Pillow) or ``.mp4``/``.mov``/``.mkv``/``.webm``/``.avi`` (imageio + ffmpeg,
            H.264 yuv420p for mp4, which needs even height and width).
        frames: An ``(F, H, W, C)`` array or an iterable of ``(H, W, C)`` frames (uint8, or float in [0, 1]).
        fps: Frames per second.
        quality: ffmpeg quality from 0 to 10 (10 is best), or ``None`` for the encoder default; ignored for GIF.

    Returns:
        The destination path.

    Raises:
        ImportError: For ffmpeg formats when ``imageio``/``imageio-ffmpeg`` are missing.
        ValueError: On an unknown suffix, no frames, or odd frame sizes for mp4.
    """
    suffix = Path(path).suffix.lower()
    if suffix not in VIDEO_SUFFIXES:
        raise ValueError(
            f"unsupported video suffix {suffix!r} for {os.fspath(path)!r}: use one of {sorted(VIDEO_SUFFIXES)}"
        )
    if suffix != ".gif":
        _import_imageio()  # fail before creating anything
    with atomic_output(path) as temp:
        if suffix == ".gif":
            _write_gif(temp, frames, fps)
        else:
            _write_ffmpeg(temp, frames, fps, quality)
    return Path(path)
