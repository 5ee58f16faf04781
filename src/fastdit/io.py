"""Load images and videos, and write outputs atomically.

Every writer here produces its file under a temporary name in the destination directory and renames it into place
with :func:`os.replace` (atomic on POSIX and Windows within one file system), so a reader never sees a half-written
image, video or report, and a crash or exception leaves the previous file (or no file) behind. Several files of one
directory are written all or nothing (:func:`atomic_outputs`): they are staged in a hidden directory and moved into
place only once every one of them is complete. Parent directories are created as needed, and removed again when the
write fails.

Temporary names are hidden (they start with ``.fastdit-``) and never end in the destination's suffix, so a process
killed part-way (``kill -9``, a power loss) leaves nothing that a ``*.png`` or ``*.mp4`` glob picks up; they carry the
host and process id of the writer, and the next write into the same directory removes those of writers that are no
longer running (on POSIX; elsewhere they stay).

Images go through Pillow. GIF videos go through Pillow too; mp4 and the other container formats need the optional
packages ``imageio`` and ``imageio-ffmpeg`` (``pip install fastdit[video]``).
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import re
import secrets
import shutil
import socket
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageSequence

__all__ = [
    "AUDIO_SUFFIXES",
    "FFMPEG_VIDEO_SUFFIXES",
    "IMAGE_SUFFIXES",
    "VIDEO_SUFFIXES",
    "atomic_output",
    "atomic_outputs",
    "check_writable",
    "encode_audio",
    "encode_image",
    "encode_video",
    "image_bytes",
    "load_image",
    "load_video",
    "save_audio",
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

AUDIO_SUFFIXES: frozenset[str] = frozenset({".wav"})
"""File suffixes written as audio (16-bit PCM WAV through the standard library)."""

_VIDEO_EXTRA_HINT = "install it with: pip install fastdit[video]"

# ffmpeg's muxer names: the temporary file's name does not tell ffmpeg the container.
_FFMPEG_MUXERS = {".mp4": "mp4", ".mov": "mov", ".mkv": "matroska", ".webm": "webm", ".avi": "avi"}

_FFMPEG_PIXEL_FORMATS = {1: "gray", 3: "rgb24", 4: "rgba"}

_TEMP_PREFIX = ".fastdit-tmp."
_STAGING_PREFIX = ".fastdit-staging."


def _host() -> str:
    # Only characters that cannot be mistaken for the dots separating the fields of a temporary name.
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"


def _temporary_name(prefix: str, label: str = "") -> str:
    """``<prefix><host>.<pid>.<random>[.<label>].part``: hidden, never ending in an image or video suffix."""
    tail = f".{label}" if label else ""
    return f"{prefix}{_host()}.{os.getpid()}.{secrets.token_hex(6)}{tail}.part"


def _process_running(pid: int) -> bool:
    if os.name != "posix":  # os.kill(pid, 0) would terminate the process on Windows: never treat one as gone
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _is_stale(name: str) -> bool:
    """Whether ``name`` is a temporary of a writer on this host that is no longer running."""
    for prefix in (_TEMP_PREFIX, _STAGING_PREFIX):
        if name.startswith(prefix):
            host, _, rest = name[len(prefix) :].partition(".")
            pid = rest.partition(".")[0]
            # Another host's process cannot be checked from here: its temporaries stay.
            return host == _host() and pid.isdigit() and not _process_running(int(pid))
    return False


def _remove_stale(directory: Path) -> None:
    """Remove the temporaries and staging directories that killed writers left in ``directory``."""
    try:
        entries = list(os.scandir(directory))
    except OSError:  # missing or unreadable: there is nothing of ours to clean
        return
    for entry in entries:
        if not _is_stale(entry.name):
            continue
        with contextlib.suppress(OSError):  # another run may be cleaning the same entry
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)


def _make_parents(directory: Path) -> list[Path]:
    """Create ``directory`` and its missing parents; return the ones created, deepest first."""
    missing = []
    for candidate in (directory, *directory.parents):
        if candidate.exists():
            break
        missing.append(candidate)
    directory.mkdir(parents=True, exist_ok=True)
    return missing


def _remove_created(created: Sequence[Path]) -> None:
    # Deepest first, and only while empty: a directory another process filled meanwhile stays.
    for directory in created:
        try:
            directory.rmdir()
        except OSError:
            return


def _fsync_directory(directory: Path) -> None:
    # Make the renames durable; directories cannot be opened for fsync on every platform.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def check_writable(path: str | os.PathLike[str], *, directory: bool = False) -> None:
    """Check, without leaving anything behind, that ``path`` could be written.

    The nearest existing ancestor must be a directory in which a file can be created (tried, then removed: a
    permission bit alone does not tell, e.g. for root, on read-only mounts or in ``/proc``). An existing ``path``
    must be a file (or, with ``directory``, a directory).

    Args:
        path: The file to write, or with ``directory`` the directory to write files into.
        directory: Whether ``path`` is a directory.

    Raises:
        OSError: Its ``filename`` is what is in the way, its ``strerror`` what is wrong with it, so that
            ``f"{error.filename} {error.strerror}"`` reads as a sentence (``"/tmp/f is a file, not a directory"``).
    """
    target = Path(path)
    if target.is_dir() and not directory:
        raise IsADirectoryError(errno.EISDIR, "is a directory", str(target))
    if target.exists() and not target.is_dir() and directory:
        raise NotADirectoryError(errno.ENOTDIR, "is a file, not a directory", str(target))
    ancestor = target if directory and target.is_dir() else target.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "is a file, not a directory", str(ancestor))
    probe = ancestor / _temporary_name(_TEMP_PREFIX, "probe")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError as error:
        raise type(error)(error.errno, f"is not writable ({error.strerror})", str(ancestor)) from None
    probe.unlink()


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success rename it onto ``path``, on error delete it.

    The temporary name is hidden and does not end in ``path``'s suffix (see the module docstring), so writers must
    be told the format rather than read it from the name (:func:`encode_image`, ``savefig(..., format=...)``). It is
    created empty and exclusively before it is yielded, with the process umask's permissions.

    Args:
        path: The final destination; its missing parent directories are created (and removed again on error).

    Yields:
        The temporary path to write to.
    """
    final = Path(path)
    created = _make_parents(final.parent)
    _remove_stale(final.parent)
    temp = final.parent / _temporary_name(_TEMP_PREFIX, final.name)
    try:
        os.close(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    except BaseException:
        _remove_created(created)
        raise
    try:
        yield temp
        _fsync(temp)
        os.replace(temp, final)
    except BaseException:
        temp.unlink(missing_ok=True)
        _remove_created(created)
        raise


@contextlib.contextmanager
def atomic_outputs(paths: Sequence[str | os.PathLike[str]]) -> Iterator[list[Path]]:
    """Write several files of one directory all or nothing.

    Yields one temporary path per destination, inside a hidden staging directory beside the destination directory
    (inside it when it already exists, so the final renames never cross a mount point). When the block ends without
    an exception, every file is flushed and renamed into place; a destination directory that did not exist appears
    at once, complete (the staging directory is renamed onto it). On an exception nothing is moved, the staging
    directory is deleted, and so are the parent directories this call created. Files already in the destination
    directory stay untouched until the renames replace those of the same names.

    Args:
        paths: Destinations, all in one directory, with distinct names.

    Yields:
        The temporary paths, in the order of ``paths``; like :func:`atomic_output`'s, their names do not tell the
        format.

    Raises:
        ValueError: If ``paths`` is empty, spans several directories or repeats a name.
    """
    finals = [Path(p) for p in paths]
    if not finals or len({p.parent for p in finals}) != 1 or len({p.name for p in finals}) != len(finals):
        raise ValueError(f"atomic_outputs needs distinct files of one directory, got {[str(p) for p in finals]}")
    destination = finals[0].parent
    existed = destination.is_dir()
    home = destination if existed else destination.parent
    created = _make_parents(home)
    _remove_stale(destination.parent)
    _remove_stale(destination)
    staging = home / _temporary_name(_STAGING_PREFIX)
    try:
        staging.mkdir()
        temps = [staging / f"{index:04d}.part" for index in range(len(finals))]
        yield temps
        for temp in temps:
            _fsync(temp)
        _move_into_place(staging, temps, finals, existed)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        _remove_created(created)
        raise
    _fsync_directory(destination)
    _fsync_directory(destination.parent)


def _move_into_place(staging: Path, temps: Sequence[Path], finals: Sequence[Path], existed: bool) -> None:
    destination = finals[0].parent
    if not existed:
        # Final names inside the hidden staging directory, then one rename: the directory appears complete. A kill
        # in between leaves only the hidden directory, which the next write here removes.
        for temp, final in zip(temps, finals, strict=True):
            os.replace(temp, staging / final.name)
        try:
            os.rename(staging, destination)
            return
        except OSError:
            if not destination.is_dir():  # not a directory created meanwhile by another process: a real failure
                raise
        temps = [staging / final.name for final in finals]
    for temp, final in zip(temps, finals, strict=True):
        os.replace(temp, final)
    staging.rmdir()


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


def _image_format(suffix: str) -> str:
    image_format = Image.registered_extensions().get(suffix.lower())
    if image_format is None:
        raise ValueError(f"unsupported image suffix {suffix!r}: use one of {sorted(IMAGE_SUFFIXES)}")
    return image_format


def encode_image(file: str | os.PathLike[str], image: Any, *, suffix: str, **save_kwargs: Any) -> None:
    """Write one image to ``file`` (not atomically) in the format of ``suffix``, whatever ``file`` is named.

    For the temporaries of :func:`atomic_output` and :func:`atomic_outputs`; :func:`save_image` does both.

    Args:
        file: Where the bytes go.
        image: A PIL image, or a channels-last numpy array: uint8, or float in [0, 1] (rounded to uint8).
        suffix: The format's file suffix (``".png"``, ``".jpg"``, ...).
        **save_kwargs: Passed to :meth:`PIL.Image.Image.save` (e.g. ``quality=95`` for JPEG).

    Raises:
        ValueError: On a suffix Pillow does not write, or an image that is not uint8 or float.
    """
    image_format = _image_format(suffix)
    pil = image if isinstance(image, Image.Image) else Image.fromarray(_to_uint8_frame(image))
    pil.save(file, format=image_format, **save_kwargs)


def image_bytes(image: Any, *, suffix: str = ".png", **save_kwargs: Any) -> bytes:
    """One image encoded in memory in the format of ``suffix`` (what a server sends), as :func:`encode_image` writes.

    Raises:
        ValueError: On a suffix Pillow does not write, or an image that is not uint8 or float.
    """
    buffer = io.BytesIO()
    encode_image(buffer, image, suffix=suffix, **save_kwargs)  # Pillow writes to file objects as to paths
    return buffer.getvalue()


def save_image(path: str | os.PathLike[str], image: Any, **save_kwargs: Any) -> Path:
    """Atomically save one image; the format follows the suffix of ``path``.

    Args:
        path: Destination file (``.png``, ``.jpg``, ...).
        image: A PIL image, or a channels-last numpy array: uint8, or float in [0, 1] (rounded to uint8).
        **save_kwargs: Passed to :meth:`PIL.Image.Image.save` (e.g. ``quality=95`` for JPEG).

    Returns:
        The destination path.
    """
    suffix = Path(path).suffix
    _image_format(suffix)  # fail before creating anything
    with atomic_output(path) as temp:
        encode_image(temp, image, suffix=suffix, **save_kwargs)
    return Path(path)


def encode_audio(file: str | os.PathLike[str], waveform: Any, *, sample_rate: int) -> None:
    """Write one waveform to ``file`` (not atomically) as 16-bit PCM WAV; :func:`save_audio` does it atomically.

    Args:
        file: Where the bytes go (a path or a writable binary file).
        waveform: ``(channels, samples)`` or ``(samples,)`` floats at full scale [-1, 1] (clipped there, as a
            converter to integer samples must).
        sample_rate: Samples per second.

    Raises:
        ValueError: A waveform of another shape, or a sample rate that is not a positive integer.
    """
    import wave

    array = np.asarray(waveform, dtype=np.float64)
    if array.ndim == 1:
        array = array[None]
    if array.ndim != 2 or array.shape[-1] == 0:
        raise ValueError(f"a waveform is (channels, samples) or (samples,), got shape {tuple(array.shape)}")
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, int) or sample_rate < 1:
        raise ValueError(f"sample_rate={sample_rate!r}: must be a positive integer")
    pcm = np.round(np.clip(array, -1.0, 1.0) * 32767.0).astype("<i2")
    with wave.open(file if hasattr(file, "write") else os.fspath(file), "wb") as out:
        out.setnchannels(array.shape[0])
        out.setsampwidth(2)
        out.setframerate(sample_rate)
        out.writeframes(pcm.T.tobytes())  # frames interleave the channels


def save_audio(path: str | os.PathLike[str], waveform: Any, *, sample_rate: int) -> Path:
    """Atomically save one waveform as a 16-bit PCM ``.wav`` file (see :func:`encode_audio`).

    Returns:
        The destination path.

    Raises:
        ValueError: ``path`` does not end in ``.wav``, or the waveform or rate is invalid (before creating anything).
    """
    if Path(path).suffix.lower() not in AUDIO_SUFFIXES:
        raise ValueError(f"{os.fspath(path)!r}: audio is saved as one of {', '.join(sorted(AUDIO_SUFFIXES))}")
    encode_audio(io.BytesIO(), waveform, sample_rate=sample_rate)  # fail before creating anything
    with atomic_output(path) as temp:
        encode_audio(temp, waveform, sample_rate=sample_rate)
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


def _write_gif(file: Path, frames: Iterable[Any], fps: float) -> None:
    images = [Image.fromarray(_to_uint8_frame(frame)) for frame in frames]
    if not images:
        raise ValueError("save_video got no frames")
    duration_ms = max(1, round(1000.0 / fps))
    images[0].save(file, format="GIF", save_all=True, append_images=images[1:], duration=duration_ms, loop=0)


def _write_ffmpeg(file: Path, frames: Iterable[Any], suffix: str, fps: float, quality: float | None) -> None:
    _import_imageio()
    import imageio_ffmpeg

    writer = None
    count = 0
    try:
        for frame in frames:
            array = np.ascontiguousarray(_to_uint8_frame(frame))
            channels = 1 if array.ndim == 2 else array.shape[2]
            if channels not in _FFMPEG_PIXEL_FORMATS:
                raise ValueError(f"a video frame needs 1, 3 or 4 channels, got frame shape {array.shape}")
            if array.shape[0] % 2 or array.shape[1] % 2:
                raise ValueError(f"mp4 (yuv420p) needs an even height and width, got frame shape {array.shape}")
            if writer is None:
                # imageio_ffmpeg directly: imageio's own writer refuses a file name without a video suffix. The
                # muxer is named, since the temporary's name does not tell ffmpeg the container; macro_block_size=1
                # never lets the writer rescale frames behind our back (it would change every metric).
                writer = imageio_ffmpeg.write_frames(
                    os.fspath(file),
                    (array.shape[1], array.shape[0]),
                    pix_fmt_in=_FFMPEG_PIXEL_FORMATS[channels],
                    fps=fps,
                    quality=quality,
                    macro_block_size=1,
                    output_params=["-f", _FFMPEG_MUXERS[suffix]],
                )
                writer.send(None)
            writer.send(array)
            count += 1
    finally:
        if writer is not None:
            writer.close()
    if count == 0:
        raise ValueError("save_video got no frames")


def _video_suffix(path: str | os.PathLike[str], suffix: str) -> str:
    suffix = suffix.lower()
    if suffix not in VIDEO_SUFFIXES:
        raise ValueError(
            f"unsupported video suffix {suffix!r} for {os.fspath(path)!r}: use one of {sorted(VIDEO_SUFFIXES)}"
        )
    if suffix != ".gif":
        _import_imageio()  # fail with the install hint before creating anything
    return suffix


def encode_video(
    file: str | os.PathLike[str], frames: Iterable[Any], *, suffix: str, fps: float = 8.0, quality: float | None = 8.0
) -> None:
    """Write frames to ``file`` (not atomically) in the container of ``suffix``, whatever ``file`` is named.

    For the temporaries of :func:`atomic_output` and :func:`atomic_outputs`; :func:`save_video` does both. The
    arguments are :func:`save_video`'s, with the container given by ``suffix``.

    Raises:
        ImportError: For ffmpeg formats when ``imageio``/``imageio-ffmpeg`` are missing.
        ValueError: On an unknown suffix, no frames, or odd frame sizes for mp4.
    """
    suffix = _video_suffix(file, suffix)
    if suffix == ".gif":
        _write_gif(Path(file), frames, fps)
    else:
        _write_ffmpeg(Path(file), frames, suffix, fps, quality)


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
        quality: ffmpeg quality from 1 to 10 (10 is best), or ``None`` for the encoder default; ignored for GIF.

    Returns:
        The destination path.

    Raises:
        ImportError: For ffmpeg formats when ``imageio``/``imageio-ffmpeg`` are missing.
        ValueError: On an unknown suffix, no frames, or odd frame sizes for mp4.
    """
    suffix = _video_suffix(path, Path(path).suffix)
    with atomic_output(path) as temp:
        encode_video(temp, frames, suffix=suffix, fps=fps, quality=quality)
    return Path(path)
