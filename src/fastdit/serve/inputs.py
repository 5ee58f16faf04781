"""Uploaded images (``/v1/images/edits``, ``input_reference`` of ``/v1/videos``): read and checked before queueing.

A file is refused with 422 naming its form field when it is too large, not an image Pillow reads, or wider or
taller than :attr:`~fastdit.serve.limits.Limits.max_side`. The dimensions are read from the header before any pixel
is decoded, so a small file that claims a huge image (a decompression bomb) costs nothing.
"""

from __future__ import annotations

import io
from typing import Any

from PIL import Image, UnidentifiedImageError

from fastdit.serve.jobs import invalid
from fastdit.serve.limits import Limits

__all__ = ["decode_image", "read_upload"]


async def read_upload(upload: Any, field: str, limits: Limits) -> bytes:
    """The bytes of a form file, refusing one above :attr:`Limits.max_upload_mb` without reading all of it.

    Raises:
        RequestError: 422 naming ``field``.
    """
    cap = int(limits.max_upload_mb * 1_000_000)
    data = await upload.read(cap + 1)
    if len(data) > cap:
        raise invalid(field, f"the file is larger than {limits.max_upload_mb:g} MB")
    if not data:
        raise invalid(field, "the file is empty")
    return data


def decode_image(data: bytes, field: str, limits: Limits, *, mode: str = "RGB") -> Image.Image:
    """An uploaded image as a loaded PIL image in ``mode`` (``"RGB"``; ``"L"`` for masks).

    Raises:
        RequestError: 422 naming ``field``: not an image, or larger than the limits.
    """
    try:
        image = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError, ValueError):
        raise invalid(field, "not an image file (PNG, JPEG, WebP, ...)") from None
    width, height = image.size
    if max(width, height) > limits.max_side:
        raise invalid(field, f"{width}x{height}: width and height must be at most {limits.max_side}")
    try:
        image.load()
        return image.convert(mode)
    except (OSError, ValueError, Image.DecompressionBombError):
        raise invalid(field, "the image data is truncated or corrupt") from None
