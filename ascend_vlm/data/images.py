"""The one image loader behind every command and API that takes images.

:func:`load_image` turns what a user hands over into an upright RGB PIL image, the way Hugging
Face processors read the same input: a local file path, an ``http(s)://`` URL (fetched with
transformers' ``load_image``), a ``data:image/...;base64,`` URL, a PIL image, or a numpy array
or torch tensor (HxWxC or CxHxW with 1, 3 or 4 channels; uint8, or floats in [0, 1] as
transformers' ``to_pil_image`` rescales them). Whatever cannot become a non-empty image raises
``ValueError`` naming the image (``name``: an option, a request line, ``images[2]``) and what is
accepted; nothing is half-read: the pixels are decoded here, so a truncated file fails here too.
:func:`load_image_bytes` reads an image file's bytes already in memory the same way.
"""

from __future__ import annotations

import io
import os
import struct
from typing import Any

from PIL import Image, ImageOps, UnidentifiedImageError

ACCEPTED_IMAGES = (
    "a local image file, an http(s) URL, a data: URL, a PIL image, or an HxWxC / CxHxW array "
    "or tensor (uint8, or float in [0, 1])"
)
URL_SCHEMES = ("http://", "https://")
DATA_URL_PREFIX = "data:"
DEFAULT_TIMEOUT_SECONDS = 30.0


def is_remote(source: object) -> bool:
    """Whether ``source`` is a string naming an http(s) URL or a data: URL (not a file path,
    so it must not be joined to a folder or normalised as a path)."""
    return isinstance(source, str) and source.startswith((*URL_SCHEMES, DATA_URL_PREFIX))


def _short(source: str) -> str:
    return source if len(source) <= 80 else f"{source[:77]}..."


def _from_string(source: str, name: str, timeout: float) -> Image.Image:
    if is_remote(source):
        from transformers.image_utils import load_image as transformers_load_image

        try:
            return transformers_load_image(source, timeout=timeout)
        except Exception as error:  # httpx, base64 and PIL each raise their own kinds
            raise ValueError(
                f"{name}: cannot read an image from {_short(source)!r} ({type(error).__name__}: "
                f"{error})"
            ) from None
    if not os.path.isfile(source):
        raise ValueError(f"{name}: expected {ACCEPTED_IMAGES}, got {source!r} (no such file)")
    try:
        return Image.open(source)
    except (UnidentifiedImageError, OSError, SyntaxError, struct.error) as error:
        raise ValueError(f"{name}: cannot read {source!r} as an image ({error})") from None


def _from_array(array: Any, name: str) -> Image.Image:
    import numpy as np
    from transformers.image_transforms import to_pil_image

    if hasattr(array, "detach"):  # a torch tensor
        array = array.detach().cpu().numpy()
    channels = (1, 3, 4)
    if array.ndim != 3 or not (array.shape[0] in channels or array.shape[-1] in channels):
        raise ValueError(
            f"{name}: expected an HxWxC or CxHxW array with C in {channels}, got shape "
            f"{tuple(array.shape)}"
        )
    if array.dtype != np.uint8 and not np.issubdtype(array.dtype, np.floating):
        raise ValueError(f"{name}: expected a uint8 or float array, got dtype {array.dtype}")
    if array.size and np.issubdtype(array.dtype, np.floating):
        low, high = float(array.min()), float(array.max())
        if not (low >= 0.0 and high <= 1.0):
            raise ValueError(
                f"{name}: expected float pixel values in [0, 1], got values in [{low}, {high}]"
            )
    if 0 in array.shape:
        raise ValueError(f"{name}: expected a non-empty image, got shape {tuple(array.shape)}")
    return to_pil_image(array)


def check_image_size(image: Image.Image, name: str) -> None:
    """Raise ``ValueError`` naming ``name`` when ``image`` has no pixels (width or height 0)."""
    if image.width == 0 or image.height == 0:
        raise ValueError(
            f"{name}: expected a non-empty image, got {image.width}x{image.height} pixels"
        )


def load_image(
    source: Any, *, name: str = "image", timeout: float = DEFAULT_TIMEOUT_SECONDS
) -> Image.Image:
    """``source`` (see the module docstring) as an upright (EXIF orientation applied) RGB PIL
    image with its pixels read. ``timeout`` bounds a URL fetch, in seconds.

    Raises ``ValueError`` naming ``name`` for a missing or unreadable file, a URL that cannot be
    fetched or decoded, an empty image, or an array of the wrong shape, dtype or range, and
    ``TypeError`` for any other kind of ``source``.
    """
    import numpy as np

    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if isinstance(source, str):
        image = _from_string(source, name, timeout)
    elif isinstance(source, Image.Image):
        image = source
    elif isinstance(source, np.ndarray) or hasattr(source, "detach"):
        image = _from_array(source, name)
    else:
        raise TypeError(f"{name}: expected {ACCEPTED_IMAGES}, got {type(source).__name__}")
    # Files and URLs are turned upright, as transformers does.
    return _loaded_rgb(image, name, upright=isinstance(source, str))


def load_image_bytes(data: bytes, *, name: str = "image") -> Image.Image:
    """An image file's encoded ``data`` as :func:`load_image` reads the file: upright, RGB,
    its pixels read. ``ValueError`` naming ``name`` when it is no image or an empty one."""
    try:
        image = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError, SyntaxError, struct.error) as error:
        raise ValueError(f"{name}: cannot read the data as an image ({error})") from None
    return _loaded_rgb(image, name, upright=True)


def _loaded_rgb(image: Image.Image, name: str, upright: bool) -> Image.Image:
    """``image`` with its pixels read, turned upright by its EXIF orientation when
    ``upright``, in RGB."""
    check_image_size(image, name)
    try:
        image.load()
        if upright:
            image = ImageOps.exif_transpose(image)
        return image.convert("RGB")
    except (OSError, SyntaxError, struct.error) as error:  # PIL decodes the data only now
        raise ValueError(f"{name}: cannot read the image's pixels ({error})") from None
