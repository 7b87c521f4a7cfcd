"""The images of a chat request, read under the server's limits
(:class:`~ascend_vlm.serving.limits.ServingLimits`).

* ``data:image/...;base64,`` URLs are always read;
* ``http(s)://`` URLs only with ``allow_image_urls``: fetched with a timeout and a size cap,
  redirects followed to http(s) only;
* anything else is a local path (``file://`` or plain), read only under the ``local_images``
  directory: symlinks are resolved first, and a path that resolves outside it is refused.

Each image's width x height is read from its header before its pixels are decoded and must
not pass ``max_image_pixels``; then :func:`ascend_vlm.data.images.load_image` reads it as every
other command does (upright, RGB). Every refusal is an :class:`~ascend_vlm.serving.errors.
ApiError` (400) whose message names the field and the limit or flag.
"""

from __future__ import annotations

import base64
import binascii
import io
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import unquote, urlparse

from PIL import Image

from ascend_vlm.data.images import DATA_URL_PREFIX, URL_SCHEMES, load_image
from ascend_vlm.serving.errors import ApiError
from ascend_vlm.serving.limits import LIMIT_FLAGS, ServingLimits

FILE_URL_PREFIX = "file://"


def _refuse(param: str, message: str, code: str = "invalid_image") -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code=code)


class _HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if not newurl.startswith(URL_SCHEMES):
            raise urllib.error.URLError(f"redirect to a non-http(s) URL {newurl!r} refused")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _fetch(url: str, param: str, limits: ServingLimits) -> bytes:
    opener = urllib.request.build_opener(_HttpOnlyRedirects)
    try:
        with opener.open(url, timeout=limits.url_timeout) as response:
            data = response.read(limits.url_max_bytes + 1)
    except (OSError, ValueError) as error:  # URLError, timeouts, malformed URLs
        message = f"cannot fetch {url[:80]!r} ({type(error).__name__}: {error})"
        raise _refuse(param, message) from None
    if len(data) > limits.url_max_bytes:
        raise _refuse(
            param,
            f"the image at {url[:80]!r} is larger than {LIMIT_FLAGS['url_max_bytes']} "
            f"({limits.url_max_bytes} bytes)",
            code="image_too_large",
        )
    return data


def _local_file(url: str, param: str, limits: ServingLimits) -> Path:
    if limits.local_images is None:
        raise _refuse(
            param,
            "expected a data: URL (local image files are off; the server reads them only under "
            "the directory named by --allow-local-images)",
        )
    text = unquote(urlparse(url).path) if url.startswith(FILE_URL_PREFIX) else url
    root = Path(limits.local_images).resolve()
    path = (root / text).resolve()  # an absolute text replaces root
    if not path.is_relative_to(root):
        raise _refuse(param, f"expected a file under {root} (--allow-local-images), got {text!r}")
    if not path.is_file():
        raise _refuse(param, f"no such image file under {root}: {text!r}")
    return path


def _check_pixels(data: bytes, param: str, limits: ServingLimits) -> None:
    limit = f"{LIMIT_FLAGS['max_image_pixels']} ({limits.max_image_pixels})"
    try:
        with Image.open(io.BytesIO(data)) as header:  # reads the header, not the pixels
            width, height = header.size
    except Image.DecompressionBombError:  # PIL's own bound, far above any sane limit
        message = f"the image has more pixels than {limit}"
        raise _refuse(param, message, code="image_too_large") from None
    except Exception as error:  # PIL raises several kinds for data that is no image
        raise _refuse(param, f"cannot read an image ({type(error).__name__}: {error})") from None
    if width * height > limits.max_image_pixels:
        raise _refuse(
            param,
            f"the image has {width}x{height} pixels, more than {limit}",
            code="image_too_large",
        )


def _data_url_bytes(url: str, param: str) -> bytes:
    header, comma, payload = url.partition(",")
    if not (comma and header.startswith("data:image/") and header.endswith(";base64")):
        raise _refuse(param, f"expected a data:image/<type>;base64,<data> URL, got {url[:40]!r}")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as error:
        raise _refuse(param, f"the data URL's payload is not base64 ({error})") from None


def read_image(url: str, param: str, limits: ServingLimits) -> Image.Image:
    """The image ``url`` names (see the module docstring), as an RGB PIL image; ``param`` is
    the request field it came from, named by every refusal."""
    if url.startswith(DATA_URL_PREFIX):
        data = _data_url_bytes(url, param)
        source: str = url
    elif url.startswith(URL_SCHEMES):
        if not limits.allow_image_urls:
            raise _refuse(
                param, "http(s) image URLs are off (start the server with --allow-image-urls)"
            )
        data = _fetch(url, param, limits)
        source = DATA_URL_PREFIX + "image/*;base64," + base64.b64encode(data).decode()
    else:
        path = _local_file(url, param, limits)
        data = path.read_bytes()
        source = str(path)
    _check_pixels(data, param, limits)
    try:
        return load_image(source, name=param)
    except ValueError as error:
        raise _refuse(param, str(error).removeprefix(f"{param}: ")) from None
