"""`ContentCache`: a least-recently-used cache bounded in bytes, keyed by content hashes, for
work done again on the same image (its decoding, its preprocessing) when requests repeat it.

Thread-safety: :meth:`ContentCache.get` and :meth:`ContentCache.put` may be called from any
thread (one lock guards the entries); the values are shared, so whoever holds one must not
change it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np
import xxhash
from PIL import Image


def bytes_key(data: bytes | memoryview, seed: int = 0) -> bytes:
    """A 128-bit content hash of ``data``; keys of different ``seed`` stand apart (equal only
    by a hash collision)."""
    return xxhash.xxh3_128_digest(data, seed=seed)


def image_key(image: Image.Image) -> bytes:
    """A 128-bit content hash of a loaded PIL image's mode, size, palette and transparency
    colour (RGB conversion reads both) and pixels: equal for images whose pixels are equal,
    whatever file they came from."""
    palette = image.getpalette() if image.mode in ("P", "PA") else None
    transparency = image.info.get("transparency")
    digest = xxhash.xxh3_128(f"{image.mode}{image.size}{palette}{transparency!r}".encode())
    digest.update(np.asarray(image))
    return digest.digest()


class ContentCache:
    """At most ``max_bytes`` of values (each weighing ``size_of(value)`` bytes), the least
    recently used evicted first; a value heavier than ``max_bytes`` is not kept. ``hits`` and
    ``misses`` count :meth:`get`'s answers."""

    def __init__(self, max_bytes: int, size_of: Callable[[Any], int]) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_bytes: expected an int >= 1, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._size_of = size_of
        self._entries: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> Any | None:
        """The value kept under ``key`` (now the most recently used), or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0]

    def put(self, key: Hashable, value: Any) -> None:
        """Keep ``value`` under ``key``, evicting the least recently used values it needs
        room from."""
        size = self._size_of(value)
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            while self._entries and self.bytes + size > self.max_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self.bytes -= evicted
            self._entries[key] = (value, size)
            self.bytes += size
