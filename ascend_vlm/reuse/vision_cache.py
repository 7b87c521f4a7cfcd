"""`VisionCache`: the vision tower's per-image outputs, kept across calls and requests.

An entry maps (model, weights fingerprint, image key) to the per-image outputs a model's
``get_image_features`` / ``get_video_features`` returns (the projected embeddings the language
model reads; Qwen3-VL's deepstack features too). The image key is a 128-bit XXH3 hash of the
pixel tensor as the vision tower receives it (its bytes, shape and dtype, with the image's
grid), a key the caller names (:meth:`VisionCache.named_images`), or the key of what the
processor made of the image, named around the forward that encodes it
(:func:`~ascend_vlm.data.content_keys.encoding_content_keys`, as the batch generator does for
images whose content was hashed where they came in). Entries of other weights
fingerprints stay until evicted, so models switching between weights (adapters) keep theirs.
Entries are evicted least recently used first once their bytes pass ``max_bytes``. Values stay
on the device they were computed on; with ``host_bytes`` the entries the device evicts move to
a second LRU in pinned host memory and come back from there on a hit (see
:mod:`ascend_vlm.reuse.host_tier`). All methods are thread-safe.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass

import torch

from ascend_vlm.data.content_keys import take_encoding_content_keys
from ascend_vlm.reuse.cache_entry import CachedFeatures
from ascend_vlm.reuse.host_tier import HostTier, produced_event


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
class VisionCacheStats:
    """Counters since the cache was made (or cleared): ``hits`` / ``misses`` per image looked up
    (``host_hits``: the hits answered from the host tier), ``evictions`` (entries that left the
    cache for room), ``demotions`` (entries moved from the device to the host tier),
    ``entries`` / ``bytes`` held on the device tier now and ``host_entries`` / ``host_bytes`` on
    the host tier, ``hashed_images`` and ``hash_seconds`` spent hashing pixels (named images and
    images with processed keys are not hashed)."""

    hits: int
    misses: int
    evictions: int
    entries: int
    bytes: int
    hashed_images: int
    hash_seconds: float
    host_hits: int = 0
    demotions: int = 0
    host_entries: int = 0
    host_bytes: int = 0

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


def _require_budget(name: str, value: object, allow_zero: bool) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name}: expected {'>= 0' if allow_zero else '> 0'}, got {value}")


class VisionCache:
    """A byte-bounded LRU of per-image vision outputs, shared by any models enabled with it.

    ``max_bytes``: the most bytes of cached tensors held at once where they were computed (an
    int > 0); an image whose outputs alone exceed it is computed but not kept. ``host_bytes``:
    the most bytes of pinned host memory holding the entries evicted from there (an int >= 0;
    0, the default, drops them). TypeError / ValueError name the argument otherwise.
    """

    def __init__(self, max_bytes: int, host_bytes: int = 0) -> None:
        _require_budget("max_bytes", max_bytes, allow_zero=False)
        _require_budget("host_bytes", host_bytes, allow_zero=True)
        self.max_bytes = max_bytes
        self.host_bytes = host_bytes
        self._lock = threading.RLock()
        self._entries: OrderedDict[tuple, CachedFeatures] = OrderedDict()
        self._bytes = 0
        self._counts = dict.fromkeys(
            ("hits", "misses", "evictions", "hashed_images", "host_hits", "demotions"), 0
        )
        self._hash_seconds = 0.0
        self._host = HostTier(host_bytes) if host_bytes else None
        if self._host is not None:
            # The tier's streams and AscendCL session reference go with the cache.
            weakref.finalize(self, self._host.close)

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
        `named_images` block is active (ValueError when it has too few left), else the keys of
        an active :func:`~ascend_vlm.data.content_keys.encoding_content_keys` block (keys of
        what a processor made of each image, which the pixels are a deterministic function of)
        when it names as many images, else their content hashes."""
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
        processed = take_encoding_content_keys(len(images))
        if processed is not None:
            return [
                ("processed", key, tuple(pixels.shape), str(pixels.dtype), tuple(grid))
                for key, (pixels, grid) in zip(processed, images, strict=True)
            ]
        start = time.perf_counter()
        keys = [("content", content_key(pixels, grid)) for pixels, grid in images]
        with self._lock:
            self._hash_seconds += time.perf_counter() - start
            self._counts["hashed_images"] += len(images)
        return keys

    # ------------------------------------------------------------------ store

    def lookup(self, owner: int, fingerprint: Hashable, keys: Sequence, wait: bool = True) -> list:
        """The cached features of each key (None where missing) for the model ``owner`` (an int
        naming one enabled model, see `cached_features`) at weights ``fingerprint``. Host-tier
        hits move back to the device tier; with ``wait=False`` their copies may still be
        running: call ``wait_ready()`` on each value before reading its tensors."""
        with self._lock:
            found = []
            for key in keys:
                entry = (owner, fingerprint, key)
                value = self._entries.get(entry)
                if value is not None:
                    self._entries.move_to_end(entry)
                elif self._host is not None and (value := self._host.take(entry)) is not None:
                    self._counts["host_hits"] += 1
                    self._insert(entry, value)
                found.append(value)
            hits = sum(value is not None for value in found)
            self._counts["hits"] += hits
            self._counts["misses"] += len(found) - hits
        if wait:
            for value in found:
                if value is not None:
                    value.wait_ready()
        return found

    def store(
        self, owner: int, fingerprint: Hashable, key: Hashable, value: CachedFeatures
    ) -> None:
        """Keep ``value`` for ``key``, moving the least recently used entries past
        ``max_bytes`` to the host tier (or dropping them without one); a value larger than
        ``max_bytes`` alone is not kept."""
        with self._lock:
            entry = (owner, fingerprint, key)
            if self._host is not None:
                self._host.discard(entry)
                value = produced_event(value)
            self._insert(entry, value)

    def _insert(self, entry: tuple, value: CachedFeatures) -> None:
        if value.nbytes > self.max_bytes:
            return
        if entry in self._entries:
            self._bytes -= self._entries.pop(entry).nbytes
        self._entries[entry] = value
        self._bytes += value.nbytes
        while self._bytes > self.max_bytes:
            oldest, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.nbytes
            if self._host is None:
                self._counts["evictions"] += 1
                continue
            self._counts["demotions"] += 1
            self._counts["evictions"] += self._host.keep(oldest, evicted)

    def clear(self) -> None:
        """Drop every entry (of both tiers) and reset the counters."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0
            if self._host is not None:
                self._host.clear()
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
                host_hits=self._counts["host_hits"],
                demotions=self._counts["demotions"],
                host_entries=len(self._host) if self._host is not None else 0,
                host_bytes=self._host.bytes if self._host is not None else 0,
            )

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def cached_keys(self) -> list:
        """The image keys held on the device tier, least recently used first."""
        with self._lock:
            return [entry[2] for entry in self._entries]

    def host_cached_keys(self) -> list:
        """The image keys held on the host tier, least recently used first."""
        with self._lock:
            return [] if self._host is None else [entry[2] for entry in self._host.held_keys()]
