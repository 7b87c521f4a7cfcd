"""`VisionCache`: the vision tower's per-image outputs, kept across calls and requests.

An entry maps (model, weights fingerprint, image key) to the per-image outputs a model's
``get_image_features`` / ``get_video_features`` returns (the projected embeddings the language
model reads; Qwen3-VL's deepstack features too). The image key is a 128-bit XXH3 hash of the
pixel tensor as the vision tower receives it (its bytes, shape and dtype, with the image's
grid), or a key the caller names (:meth:`VisionCache.named_images`). Entries of other weights
fingerprints stay until evicted, so models switching between weights (adapters) keep theirs.
Entries are evicted least recently used first once their bytes pass ``max_bytes``. Values stay
on the device they were computed on. All methods are thread-safe.
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


@dataclass
class _NamedKeys:
    """The keys a `named_images` block hands out in order, to the thread that opened it."""

    keys: tuple
    thread: int
    used: int = 0


# The named keys of the innermost active named_images block (see VisionCache.named_images).
_NAMED: contextvars.ContextVar[_NamedKeys | None] = contextvars.ContextVar(
    "ascend_vlm_named_images", default=None
)


@dataclass(frozen=True)
class CachedFeatures:
    """One image's outputs as cached: the output class to rebuild, whether its deepstack layers
    came as one tensor over all images (else split per image), and the tensors (the pooled
    embeddings, then one per deepstack layer)."""

    output_class: type
    deepstack_joined: bool
    tensors: tuple[torch.Tensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(tensor.numel() * tensor.element_size() for tensor in self.tensors)


@dataclass(frozen=True)
class VisionCacheStats:
    """Counters since the cache was made (or cleared): ``hits`` / ``misses`` per image looked up,
    ``evictions`` (entries dropped for room), ``entries`` and ``bytes``
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
        self._entries: OrderedDict[tuple, CachedFeatures] = OrderedDict()
        self._bytes = 0
        self._counts = {"hits": 0, "misses": 0, "evictions": 0, "hashed_images": 0}
        self._hash_seconds = 0.0

    # ------------------------------------------------------------------ keys

    @contextlib.contextmanager
    def named_images(self, keys: Sequence[Hashable]) -> Iterator[None]:
        """Within the block, the images a cached model encodes are keyed by ``keys`` in order
        (one per image, e.g. image ids, each with the image's grid) instead of hashed: the
        caller vouches that equal keys mean equal pixels. The keys serve the thread that opens
        the block (RuntimeError from another: their order would be a race); a block that ends
        normally with keys left over raises ValueError (the keys did not match the images).
        TypeError for a key that is not a str, bytes or int."""
        keys = tuple(keys)
        for key in keys:
            if not isinstance(key, (str, bytes, int)) or isinstance(key, bool):
                raise TypeError(f"keys: expected str, bytes or int image keys, got {key!r}")
        named = _NamedKeys(keys, threading.get_ident())
        token = _NAMED.set(named)
        try:
            yield
        finally:
            _NAMED.reset(token)
        if named.used != len(keys):
            raise ValueError(
                f"keys: named_images got {len(keys)} keys but {named.used} images were encoded"
            )

    def image_keys(self, images: Sequence[tuple[torch.Tensor, Sequence[int]]]) -> list:
        """The key of each ``(pixels, grid)``: the next named keys (with the grids) when a
        `named_images` block is active (ValueError when it has too few left), else their
        content hashes."""
        named = _NAMED.get()
        if named is not None:
            if named.thread != threading.get_ident():
                raise RuntimeError(
                    "keys: named_images keys serve the thread that opened the block; encode "
                    "from that thread or open a block in each thread"
                )
            left = len(named.keys) - named.used
            if left < len(images):
                raise ValueError(
                    f"keys: named_images has {left} keys left for {len(images)} images"
                )
            taken = named.keys[named.used : named.used + len(images)]
            named.used += len(images)
            return [
                ("named", key, tuple(pixels.shape), tuple(grid))
                for key, (pixels, grid) in zip(taken, images, strict=True)
            ]
        start = time.perf_counter()
        keys = [("content", content_key(pixels, grid)) for pixels, grid in images]
        with self._lock:
            self._hash_seconds += time.perf_counter() - start
            self._counts["hashed_images"] += len(images)
        return keys

    # ------------------------------------------------------------------ store

    def lookup(self, owner: int, fingerprint: Hashable, keys: Sequence) -> list:
        """The cached features of each key (None where missing) for the model ``owner`` (an int
        naming one enabled model, see `cached_features`) at weights ``fingerprint``."""
        with self._lock:
            found = []
            for key in keys:
                entry = (owner, fingerprint, key)
                value = self._entries.get(entry)
                if value is not None:
                    self._entries.move_to_end(entry)
                found.append(value)
            hits = sum(value is not None for value in found)
            self._counts["hits"] += hits
            self._counts["misses"] += len(found) - hits
            return found

    def store(
        self, owner: int, fingerprint: Hashable, key: Hashable, value: CachedFeatures
    ) -> None:
        """Keep ``value`` for ``key``, evicting the least recently used entries past
        ``max_bytes``; a value larger than ``max_bytes`` alone is not kept."""
        size = value.nbytes
        with self._lock:
            if size > self.max_bytes:
                return
            entry = (owner, fingerprint, key)
            if entry in self._entries:
                self._drop(entry)
            self._entries[entry] = value
            self._bytes += size
            while self._bytes > self.max_bytes:
                self._drop(next(iter(self._entries)))
                self._counts["evictions"] += 1

    def _drop(self, entry: tuple) -> None:
        self._bytes -= self._entries.pop(entry).nbytes

    def clear(self) -> None:
        """Drop every entry and reset the counters."""
        with self._lock:
            self._entries.clear()
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
            return [entry[2] for entry in self._entries]
