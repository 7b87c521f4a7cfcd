"""The images of a chat request, read under the server's limits
(:class:`~ascend_vlm.serving.limits.ServingLimits`).

* ``data:image/...;base64,`` URLs are always read;
* ``http(s)://`` URLs only with ``allow_image_urls``: fetched within ``url_timeout`` seconds for
  the whole fetch (connection, headers and body: a server that sends slowly is cut off at the
  deadline) and at most ``url_max_bytes`` bytes, redirects followed to http(s) only;
* anything else is a local path (``file://`` or plain), read only under the ``local_images``
  directory (symlinks are resolved first, and a path that resolves outside it is refused), at
  most ``url_max_bytes`` bytes, read once.

Each image's width x height is read from its header before its pixels are decoded and must
not pass ``max_image_pixels``; then :func:`ascend_vlm.data.images.load_image_bytes` decodes its
bytes as every other command reads an image file (upright, RGB). With a ``decoded`` cache (a
:class:`~ascend_vlm.vision_input.content_cache.ContentCache`), an image read before is the
image decoded then, not decoded again (keyed by the content hash of its bytes, or of its data
URL's text, which is also vouched for the image so that no cache downstream hashes its pixels).
Every
refusal is an :class:`~ascend_vlm.serving.errors.ApiError` (400) whose message names the field
and the limit or flag.
"""

from __future__ import annotations

import base64
import binascii
import io
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import unquote, urlparse

from PIL import Image

from ascend_vlm.data.content_keys import DATA_URL_SEED, vouch_content_key
from ascend_vlm.data.images import DATA_URL_PREFIX, URL_SCHEMES, load_image_bytes
from ascend_vlm.serving.errors import ApiError
from ascend_vlm.serving.limits import LIMIT_FLAGS, ServingLimits
from ascend_vlm.vision_input.content_cache import ContentCache, bytes_key

FILE_URL_PREFIX = "file://"
# Bytes a fetch reads at a time (between two looks at its deadline).
FETCH_CHUNK_BYTES = 1 << 16


def _refuse(param: str, message: str, code: str = "invalid_image") -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code=code)


class _HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if not newurl.startswith(URL_SCHEMES):
            raise urllib.error.URLError(f"redirect to a non-http(s) URL {newurl!r} refused")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _too_large(param: str, what: str, limits: ServingLimits) -> ApiError:
    return _refuse(
        param,
        f"{what} is larger than {LIMIT_FLAGS['url_max_bytes']} ({limits.url_max_bytes} bytes)",
        code="image_too_large",
    )


def _download(url: str, limits: ServingLimits, deadline: float, outcome: dict) -> None:
    """Fetch ``url`` into ``outcome["data"]`` (at most ``url_max_bytes`` + 1 bytes), its error
    into ``outcome["error"]``, or ``outcome["late"] = True`` when ``deadline`` (a
    ``time.monotonic()`` value) came first."""
    opener = urllib.request.build_opener(_HttpOnlyRedirects)
    try:
        with opener.open(url, timeout=limits.url_timeout) as response:
            chunks, size = [], 0
            while size <= limits.url_max_bytes and time.monotonic() < deadline:
                chunk = response.read1(min(FETCH_CHUNK_BYTES, limits.url_max_bytes + 1 - size))
                if not chunk:
                    outcome["data"] = b"".join(chunks)
                    return
                chunks.append(chunk)
                size += len(chunk)
            outcome["data"] = b"".join(chunks)  # over the cap
            outcome["late"] = size <= limits.url_max_bytes  # or cut at the deadline
    except (OSError, ValueError) as error:  # URLError, timeouts, malformed URLs
        outcome["error"] = error


def _fetch(url: str, param: str, limits: ServingLimits) -> bytes:
    # The fetch runs in a thread of its own so that the deadline holds however the server
    # paces its bytes: each socket operation's own timeout bounds only that operation.
    deadline = time.monotonic() + limits.url_timeout
    outcome: dict = {}
    fetcher = threading.Thread(
        target=_download, args=(url, limits, deadline, outcome), name="ascend_vlm-fetch",
        daemon=True,
    )  # fmt: skip
    fetcher.start()
    fetcher.join(limits.url_timeout)
    if fetcher.is_alive() or outcome.get("late"):
        message = (
            f"cannot fetch {url[:80]!r} within {LIMIT_FLAGS['url_timeout']} "
            f"({limits.url_timeout:g} s)"
        )
        raise _refuse(param, message)
    if "error" in outcome:
        error = outcome["error"]
        message = f"cannot fetch {url[:80]!r} ({type(error).__name__}: {error})"
        raise _refuse(param, message)
    data = outcome["data"]
    if len(data) > limits.url_max_bytes:
        raise _too_large(param, f"the image at {url[:80]!r}", limits)
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


def _file_bytes(path: Path, param: str, limits: ServingLimits) -> bytes:
    try:
        with path.open("rb") as file:
            data = file.read(limits.url_max_bytes + 1)
    except OSError as error:
        raise _refuse(param, f"cannot read {path} ({type(error).__name__}: {error})") from None
    if len(data) > limits.url_max_bytes:
        raise _too_large(param, f"the image file {path}", limits)
    return data


def _image_bytes(url: str, param: str, limits: ServingLimits) -> bytes:
    """The encoded image ``url`` names, under the limits (module docstring)."""
    if url.startswith(DATA_URL_PREFIX):
        return _data_url_bytes(url, param)
    if url.startswith(URL_SCHEMES):
        if not limits.allow_image_urls:
            raise _refuse(
                param, "http(s) image URLs are off (start the server with --allow-image-urls)"
            )
        return _fetch(url, param, limits)
    return _file_bytes(_local_file(url, param, limits), param, limits)


def read_image(
    url: str, param: str, limits: ServingLimits, decoded: ContentCache | None = None
) -> Image.Image:
    """The image ``url`` names (see the module docstring), as an RGB PIL image, never to be
    changed; ``param`` is the request field it came from, named by every refusal. The image's
    content key is the hash of its bytes, or of its data URL's text (which names the bytes and
    is hashed without decoding it; a seed of its own keeps it apart from bytes' hashes): it is
    vouched for the image (:func:`~ascend_vlm.data.content_keys.vouch_content_key`), so the
    caches downstream hash it no more. ``decoded``: the images decoded before, by that key (the
    image returned may be one of them)."""
    data = None if url.startswith(DATA_URL_PREFIX) else _image_bytes(url, param, limits)
    key = bytes_key(data) if data is not None else bytes_key(url.encode(), seed=DATA_URL_SEED)
    if decoded is not None:
        image = decoded.get(key)
        if image is not None:
            return image
    if data is None:
        data = _image_bytes(url, param, limits)
    _check_pixels(data, param, limits)
    try:
        image = load_image_bytes(data, name=param)
    except ValueError as error:
        raise _refuse(param, str(error).removeprefix(f"{param}: ")) from None
    vouch_content_key(image, key)
    if decoded is not None:
        decoded.put(key, image)
    return image


def decoded_image_cache(max_bytes: int) -> ContentCache:
    """A cache of decoded images for :func:`read_image`, of at most ``max_bytes`` of pixels."""
    return ContentCache(
        max_bytes, size_of=lambda image: len(image.getbands()) * image.width * image.height
    )
