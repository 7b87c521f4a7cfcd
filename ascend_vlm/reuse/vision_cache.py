"""`VisionCache`: the vision tower's per-image outputs, kept across calls and requests.

An entry maps (model, weights fingerprint, image key) to the per-image outputs a model's
``get_image_features`` / ``get_video_features`` returns (the projected embeddings the language
model reads; Qwen3-VL's deepstack features too). The image key is a 128-bit XXH3 hash of the
pixel tensor as the vision tower receives it (its bytes, shape and dtype, with the image's
grid), or a key the caller names (:meth:`VisionCache.named_images`). Entries are evicted least
recently used first once their bytes pass ``max_bytes``. Values stay on the device they were
computed on. All methods are thread-safe.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass

import torch

# The keys the caller names for the next images a cached model encodes (see named_images).
_NAMED: contextvars.ContextVar[list[Hashable] | None] = contextvars.ContextVar(
    "ascend_vlm_named_images", default=None
)


@dataclass(frozen=True)
class VisionCacheStats:
    """Counters since the cache was made (or cleared): ``hits`` / ``misses`` per image looked up,
    ``evictions`` (entries dropped for room or for stale weights), ``entries`` and ``bytes``
    held now, ``hashed_images`` and ``hash_seconds`` spent hashing pixels (named images are not
    hashed)."""

    hits: int
    misses: int
    evictions: int
    entries: int
    bytes: int
    hashed_images: int
    hash_seconds: float

    @property
    def hit_rate(self) -> float:
        """``hits / (hits + misses)`` (0 before the first lookup)."""
        looked_up = self.hits + self.misses
        return self.hits / looked_up if looked_up else 0.0


def _value_bytes(value: tuple) -> int:
    return sum(
        part.numel() * part.element_size() for part in value if isinstance(part, torch.Tensor)
    )


def content_key(pixels: torch.Tensor, grid: Sequence[int] = ()) -> bytes:
    """128-bit XXH3 digest of ``pixels`` (bytes, shape, dtype) and ``grid``; pixels on a device
    are copied to the host first (pass named keys to avoid that)."""
    import xxhash

    digest = xxhash.xxh3_128()
    digest.update(repr((tuple(pixels.shape), str(pixels.dtype), tuple(grid))).encode())
    host = pixels.detach().contiguous().cpu()
    digest.update(memoryview(host.view(torch.uint8).numpy()))
    return digest.digest()


class VisionCache:
    """A byte-bounded LRU of per-image vision outputs, shared by any models enabled with it.

    ``max_bytes``: the most bytes of cached tensors held at once (an int > 0); an image whose
    outputs alone exceed it is computed but not kept. TypeError / ValueError name the argument
    otherwise.
    """

    def __init__(self, max_bytes: int) -> None:
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool):
            raise TypeError(f"max_bytes: expected an int, got {type(max_bytes).__name__}")
        if max_bytes <= 0:
            raise ValueError(f"max_bytes: expected > 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._lock = threading.RLock()
        self._entries: OrderedDict[tuple, tuple] = OrderedDict()
        self._fingerprints: dict[int, Hashable] = {}
        self._bytes = 0
        self._counts = {"hits": 0, "misses": 0, "evictions": 0, "hashed_images": 0}
        self._hash_seconds = 0.0

    # ------------------------------------------------------------------ keys

    @contextlib.contextmanager
    def named_images(self, keys: Sequence[Hashable]) -> Iterator[None]:
        """Within the block, the images a cached model encodes are keyed by ``keys`` in order
        (one per image, e.g. image ids) instead of hashed: the caller vouches that equal keys
        mean equal pixels. TypeError for a key that is not a str, bytes or int."""
        keys = list(keys)
        for key in keys:
            if not isinstance(key, (str, bytes, int)) or isinstance(key, bool):
                raise TypeError(f"keys: expected str, bytes or int image keys, got {key!r}")
        token = _NAMED.set(keys)
        try:
            yield
        finally:
            _NAMED.reset(token)

    def image_keys(self, images: Sequence[tuple[torch.Tensor, Sequence[int]]]) -> list:
        """The key of each ``(pixels, grid)``: the next named keys when a `named_images` block
        is active (ValueError when it has too few left), else their content hashes."""
        named = _NAMED.get()
        if named is not None:
            if len(named) < len(images):
                raise ValueError(
                    f"keys: named_images has {len(named)} keys left for {len(images)} images"
                )
            taken, named[:] = named[: len(images)], named[len(images) :]
            return [("named", key) for key in taken]
        start = time.perf_counter()
        keys = [("content", content_key(pixels, grid)) for pixels, grid in images]
        with self._lock:
            self._hash_seconds += time.perf_counter() - start
            self._counts["hashed_images"] += len(images)
        return keys

    # ------------------------------------------------------------------ store

    def lookup(self, owner: int, fingerprint: Hashable, keys: Sequence) -> list:
        """The cached value of each key for model ``owner`` at weights ``fingerprint`` (None
        where missing). A new fingerprint of ``owner`` first drops that model's entries: they
        can never hit again."""
        with self._lock:
            if self._fingerprints.get(owner) != fingerprint:
                stale = [entry for entry in self._entries if entry[0] == owner]
                for entry in stale:
                    self._drop(entry)
                self._counts["evictions"] += len(stale)
                self._fingerprints[owner] = fingerprint
            found = []
            for key in keys:
                value = self._entries.get((owner, key))
                if value is not None:
                    self._entries.move_to_end((owner, key))
                found.append(value)
            hits = sum(value is not None for value in found)
            self._counts["hits"] += hits
            self._counts["misses"] += len(found) - hits
            return found

    def store(self, owner: int, fingerprint: Hashable, key: Hashable, value: tuple) -> None:
        """Keep ``value`` (a tuple; its tensors count against the bound) for ``key``, evicting the least recently used
        entries past ``max_bytes``; a value larger than ``max_bytes`` alone is not kept."""
        size = _value_bytes(value)
        with self._lock:
            if size > self.max_bytes or self._fingerprints.get(owner) != fingerprint:
                return
            entry = (owner, key)
            if entry in self._entries:
                self._drop(entry)
            self._entries[entry] = value
            self._bytes += size
            while self._bytes > self.max_bytes:
                self._drop(next(iter(self._entries)))
                self._counts["evictions"] += 1

    def _drop(self, entry: tuple) -> None:
        self._bytes -= _value_bytes(self._entries.pop(entry))

    def clear(self) -> None:
        """Drop every entry and reset the counters."""
        with self._lock:
            self._entries.clear()
            self._fingerprints.clear()
            self._bytes = 0
            self._counts = dict.fromkeys(self._counts, 0)
            self._hash_seconds = 0.0

    def stats(self) -> VisionCacheStats:
        """The counters now (a consistent snapshot)."""
        with self._lock:
            return VisionCacheStats(
                hits=self._counts["hits"],
                misses=self._counts["misses"],
                evictions=self._counts["evictions"],
                entries=len(self._entries),
                bytes=self._bytes,
                hashed_images=self._counts["hashed_images"],
                hash_seconds=self._hash_seconds,
            )

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def cached_keys(self) -> list:
        """The cached image keys, least recently used first."""
        with self._lock:
            return [entry[1] for entry in self._entries]
