"""Turn numpy arrays, PIL images and torch tensors into numpy images with one explicit, documented layout.

Layout rules (never guessed from the shape, because a 3×3×3 array is ambiguous):

* numpy arrays and PIL images are channels-last: ``(H, W)`` or ``(H, W, C)``; batches and videos ``(N, H, W, C)``.
* torch tensors are channels-first, as torch models produce them: ``(H, W)`` or ``(C, H, W)``; batches and videos
  ``(N, C, H, W)``.
* ``layout="HWC"`` or ``layout="CHW"`` overrides the default for any input (a 4-D input then reads as ``NHWC`` or
  ``NCHW``).

Images come back channels-last, ``(H, W)`` or ``(H, W, C)``, in their own dtype, except half-precision tensors, which
become ``float32`` because numpy has no bfloat16.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from PIL import Image

__all__ = ["Layout", "as_image", "as_images", "default_data_range"]

Layout = Literal["HWC", "CHW"]

# PIL modes numpy cannot represent as plain pixel values (palettes, bit planes, other colour spaces) become RGB(A).
_CONVERT_MODES = frozenset({"1", "P", "PA", "CMYK", "YCbCr", "LAB", "HSV"})


def _is_torch_tensor(value: Any) -> bool:
    # Only look torch up if the caller already imported it: a metric on numpy images should not pay for `import torch`.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _resolve_layout(value: Any, layout: Layout | None) -> Layout:
    if layout is None:
        return "CHW" if _is_torch_tensor(value) else "HWC"
    if layout not in ("HWC", "CHW"):
        raise ValueError(f"layout={layout!r}: must be 'HWC', 'CHW' or None")
    return layout


def _pil_to_array(image: Image.Image) -> np.ndarray:
    if image.mode in _CONVERT_MODES:
        has_alpha = image.mode in ("PA", "LA") or "transparency" in image.info
        image = image.convert("RGBA" if has_alpha else "RGB")
    return np.asarray(image)


def _to_numpy(value: Any) -> np.ndarray:
    if isinstance(value, Image.Image):
        return _pil_to_array(value)
    if _is_torch_tensor(value):
        tensor = value.detach().cpu()
        if tensor.dtype.is_floating_point and tensor.element_size() < 4:
            tensor = tensor.float()
        return tensor.numpy()
    if isinstance(value, np.ndarray):
        return value
    raise TypeError(f"expected a numpy array, PIL image or torch tensor, got {type(value).__name__}")


def as_image(value: Any, *, layout: Layout | None = None) -> np.ndarray:
    """Convert one image to a channels-last numpy array.

    Args:
        value: A numpy array, PIL image or torch tensor holding one image (see the module docstring for layouts).
        layout: ``"HWC"`` or ``"CHW"`` to override the per-type default; ``None`` uses the default.

    Returns:
        An ``(H, W)`` or ``(H, W, C)`` array.

    Raises:
        ValueError: If the array is not 2-D or 3-D.
        TypeError: If the value is not an image type.
    """
    resolved = _resolve_layout(value, layout)
    array = _to_numpy(value)
    if array.ndim == 2:
        return array
    if array.ndim != 3:
        raise ValueError(f"expected one image of shape (H, W) or 3-D {resolved}, got shape {tuple(array.shape)}")
    return np.moveaxis(array, 0, -1) if resolved == "CHW" else array


def as_images(value: Any, *, layout: Layout | None = None) -> list[np.ndarray]:
    """Convert one image, a batch, a video, or a sequence of images to a list of channels-last arrays.

    A 4-D array or tensor is a batch or video (``NHWC`` for numpy, ``NCHW`` for torch unless ``layout`` says
    otherwise); a list or tuple holds one image per item (items may differ in size); anything else is one image.

    Args:
        value: The image(s).
        layout: ``"HWC"`` or ``"CHW"`` to override the per-type default.

    Returns:
        A list of ``(H, W)`` or ``(H, W, C)`` arrays.
    """
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return [as_image(item, layout=layout) for item in value]
    if isinstance(value, Image.Image):
        return [as_image(value, layout=layout)]
    resolved = _resolve_layout(value, layout)
    array = _to_numpy(value)
    if array.ndim == 4:
        return [np.moveaxis(frame, 0, -1) if resolved == "CHW" else frame for frame in array]
    return [as_image(array, layout=resolved)]


def default_data_range(image: np.ndarray) -> float:
    """Return the data range implied by an image's dtype: 255 for uint8, 65535 for uint16, 1.0 for floats in [0, 1].

    Args:
        image: A numpy image.

    Returns:
        The distance between the smallest and the largest value the type can hold.

    Raises:
        ValueError: For floats outside [0, 1] or other dtypes, whose range is not implied by the type; pass
            ``data_range`` explicitly then.
    """
    if image.dtype == np.uint8:
        return 255.0
    if image.dtype == np.uint16:
        return 65535.0
    if np.issubdtype(image.dtype, np.floating):
        low, high = float(np.min(image)), float(np.max(image))
        if not (low >= 0.0 and high <= 1.0):  # written so that NaN fails too
            raise ValueError(
                f"float image values span [{low:.4g}, {high:.4g}], outside [0, 1]: "
                "rescale or clip to [0, 1], or pass data_range explicitly"
            )
        return 1.0
    raise ValueError(f"dtype {image.dtype} has no implied data range: pass data_range explicitly")
