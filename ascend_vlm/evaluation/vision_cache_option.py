"""The "vision-cache" feature option of ``python -m ascend_vlm eval``: ``--vision-cache MIB``
answers repeated images from a :class:`~ascend_vlm.reuse.VisionCache` of that many MiB, and the
report records its counters after the run."""

from __future__ import annotations

import argparse
from typing import Any

MIB = 1 << 20


def _mebibytes(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int number of MiB, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected >= 0 MiB (0: no cache), got {value}")
    return value


def add_vision_cache_arguments(group: Any) -> None:
    """Add ``--vision-cache MIB`` (default 0: every image is encoded)."""
    group.add_argument(
        "--vision-cache",
        type=_mebibytes,
        default=0,
        metavar="MIB",
        help="keep the vision tower's per-image outputs in an LRU cache of MIB MiB (keyed by a "
        "hash of the pixels and the vision weights); default 0: no cache",
    )


def apply_vision_cache(model: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Enable a fresh cache of ``args.vision_cache`` MiB on ``model`` (nothing for 0)."""
    if not args.vision_cache:
        return {"summary": "no vision cache", "max_bytes": 0}
    from ascend_vlm.reuse import VisionCache, enable_vision_cache

    enable_vision_cache(model, VisionCache(max_bytes=args.vision_cache * MIB))
    return {
        "summary": f"vision cache: {args.vision_cache} MiB",
        "max_bytes": args.vision_cache * MIB,
    }


def finish_vision_cache(model: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The cache's counters after the run, and a summary line with its hit rate."""
    if not args.vision_cache:
        return {}
    from ascend_vlm.reuse import vision_cache_of

    cache = vision_cache_of(model)
    if cache is None:
        return {"summary": f"vision cache: {args.vision_cache} MiB (disabled during the run)"}
    stats = cache.stats()
    per_image = stats.hash_seconds / stats.hashed_images * 1e3 if stats.hashed_images else 0.0
    summary = (
        f"vision cache: {args.vision_cache} MiB; {stats.hits} hits / {stats.misses} misses "
        f"({stats.hit_rate:.1%}), {stats.evictions} evictions, {stats.bytes / MIB:.1f} MiB held, "
        f"hashing {per_image:.3f} ms per image"
    )
    counters = {
        "hits": stats.hits,
        "misses": stats.misses,
        "evictions": stats.evictions,
        "entries": stats.entries,
        "bytes": stats.bytes,
        "hashed_images": stats.hashed_images,
        "hash_seconds": stats.hash_seconds,
    }
    return {"summary": summary, "stats": counters}
