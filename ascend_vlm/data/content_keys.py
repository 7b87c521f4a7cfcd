"""Content keys vouched for images, so that an image's content is hashed once, where it comes in.

Whoever makes an image from content it has hashed already (the server hashes the bytes it
decodes: :mod:`ascend_vlm.serving.images`) vouches that hash for the image object with
:func:`vouch_content_key`. What keys images later reads it with :func:`vouched_content_key`
instead of hashing the pixels again, beside :func:`processor_settings_key` where what it keys
is the image as a processor turns it into tensors (the preprocessed-pixel cache of
:mod:`ascend_vlm.vision_input`, the prefix cache of :mod:`ascend_vlm.batching`): those
tensors are a deterministic function of the image and the processor's settings
(:func:`processed_content_key`). Where the tensors are encoded out of sight of the code that
knows the images (the vision cache of :mod:`ascend_vlm.reuse`, inside a model's forward), the
caller names their keys around the forward with :func:`encoding_content_keys`.

The voucher promises that equal keys mean equal images (mode, size, palette, transparency,
pixels) and that the image is never changed while it lives. A key holds for the very object it
was vouched for, as long as that object lives: not for copies or images derived from it (PIL
hands an image's ``info`` on to those, so the key is kept beside the image, not in it). An
image derived by a deterministic step is vouched again with :func:`derived_content_key`.
Thread-safe: an entry is written by one dictionary operation, and removed only by its image's
death callback, which runs while that image still holds its id (no other image can be vouched
under the id before the entry is gone), after checking the entry is still that image's.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import xxhash

# id(image) -> (a weak reference to that image, its key); an entry leaves when its image dies.
_VOUCHED: dict[int, tuple[weakref.ref, bytes]] = {}
# Seeds that keep keys of different kinds apart: a content hash of bytes (seed 0), of a data
# URL's text, a derived key, a processor's settings and a processed key never equal each other.
DATA_URL_SEED = 1
_DERIVED_SEED = 2
_SETTINGS_SEED = 3
_PROCESSED_SEED = 4
# The keys of the images the model encodes within an encoding_content_keys block, in a list
# the first take empties.
_ENCODING: contextvars.ContextVar[list[tuple[bytes, ...]] | None] = contextvars.ContextVar(
    "ascend_vlm_encoding_content_keys", default=None
)


def _forget(ident: int, reference: weakref.ref) -> None:
    entry = _VOUCHED.get(ident)
    if entry is not None and entry[0] is reference:
        _VOUCHED.pop(ident, None)


def vouch_content_key(image: Any, key: bytes) -> None:
    """Vouch ``key`` (a content hash) for ``image`` as long as it lives (module docstring).
    TypeError for a ``key`` that is not bytes."""
    if not isinstance(key, bytes):
        raise TypeError(f"key: expected bytes, got {type(key).__name__}")
    ident = id(image)
    reference = weakref.ref(image, lambda dead: _forget(ident, dead))
    _VOUCHED[ident] = (reference, key)


def vouched_content_key(image: Any) -> bytes | None:
    """The key vouched for ``image`` itself, or None."""
    entry = _VOUCHED.get(id(image))
    if entry is None or entry[0]() is not image:
        return None
    return entry[1]


def derived_content_key(key: bytes, step: str) -> bytes:
    """The key of the image the deterministic ``step`` (e.g. ``"thumbnail 512"``) makes of the
    image keyed ``key``."""
    length = len(key).to_bytes(8, "little")  # so that no other key and step spell the same
    return xxhash.xxh3_128_digest(length + key + step.encode(), seed=_DERIVED_SEED)


def processor_settings_key(image_processor: Any) -> bytes | None:
    """A key of ``image_processor``'s settings (its ``to_dict()``, class name included), or
    None when it has no ``to_dict``."""
    settings = getattr(image_processor, "to_dict", None)
    if settings is None:
        return None
    text = repr(sorted(settings().items(), key=lambda item: item[0]))
    return xxhash.xxh3_128_digest(text.encode(), seed=_SETTINGS_SEED)


def processed_content_key(image: Any, settings: bytes | None) -> bytes | None:
    """The key of the tensors a processor whose settings key is ``settings``
    (:func:`processor_settings_key`) makes of ``image``: a deterministic function of both, so
    derived from ``settings`` and the key vouched for ``image``; None without either."""
    key = vouched_content_key(image)
    if key is None or settings is None:
        return None
    return xxhash.xxh3_128_digest(settings + key, seed=_PROCESSED_SEED)


def processed_content_keys(images: Sequence[Any], image_processor: Any) -> tuple[bytes, ...] | None:
    """:func:`processed_content_key` of each of ``images`` under ``image_processor``, in order;
    None unless every image has one."""
    if not images or any(vouched_content_key(image) is None for image in images):
        return None  # before reading the settings: most requests without images end here
    settings = processor_settings_key(image_processor)
    keys = tuple(processed_content_key(image, settings) for image in images)
    return None if None in keys else keys


@contextlib.contextmanager
def encoding_content_keys(keys: Sequence[bytes] | None) -> Iterator[None]:
    """Within the block (in this thread or task), the images a model encodes are those of
    ``keys`` (:func:`processed_content_keys`, in the processor's order; None: not known), for
    the first :func:`take_encoding_content_keys` to take."""
    token = _ENCODING.set(None if keys is None else [tuple(keys)])
    try:
        yield
    finally:
        _ENCODING.reset(token)


def take_encoding_content_keys(count: int) -> tuple[bytes, ...] | None:
    """The keys of the active :func:`encoding_content_keys` block when it holds ``count`` of
    them, else None; only the block's first call gets them (a later encoding in the block may
    be of other pixels)."""
    holder = _ENCODING.get()
    if not holder:
        return None
    keys = holder.pop()
    return keys if len(keys) == count else None
