"""The "vision-cache" feature option of ``python -m ascend_vlm eval``: ``--vision-cache MIB``
answers repeated images from a :class:`~ascend_vlm.reuse.VisionCache` of that many MiB
(``--vision-cache MIB:HOST_MIB`` adds a host tier of that many MiB of pinned memory for the
entries it evicts), and the report records its counters after the run."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from ascend_vlm._byte_units import MIB


def _budgets(text: str) -> tuple[int, int]:
    """``MIB`` or ``MIB:HOST_MIB`` as ``(MiB, host MiB)``."""
    parts = text.split(":")
    try:
        if len(parts) > 2:
            raise ValueError
        device, host = (int(part) for part in (*parts, "0")[:2])
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected MIB or MIB:HOST_MIB (int numbers of MiB), got {text!r}"
        ) from None
    if device < 0 or host < 0:
        raise argparse.ArgumentTypeError(f"expected MiB >= 0 (0: no cache), got {text!r}")
    if host and not device:
        raise argparse.ArgumentTypeError(f"a host tier needs a cache of MIB > 0, got {text!r}")
    return device, host


def add_vision_cache_arguments(group: Any) -> None:
    """Add ``--vision-cache MIB[:HOST_MIB]`` (default 0: every image is encoded)."""
    group.add_argument(
        "--vision-cache",
        type=_budgets,
        default=(0, 0),
        metavar="MIB[:HOST_MIB]",
        help="keep the vision tower's per-image outputs in an LRU cache of MIB MiB (keyed by a "
        "hash of the pixels and the vision weights), and up to HOST_MIB MiB of the entries it "
        "evicts in pinned host memory (copied back on a hit); default 0: no cache",
    )


def apply_vision_cache(model: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Enable a fresh cache of ``args.vision_cache`` MiB on ``model`` (nothing for 0)."""
    device, host = args.vision_cache
    if not device:
        return {"summary": "no vision cache", "max_bytes": 0}
    from ascend_vlm.reuse import VisionCache, enable_vision_cache

    cache = VisionCache(max_bytes=device * MIB, host_bytes=host * MIB)
    enable_vision_cache(model, cache)
    host_tier = f" + {host} MiB host tier" if host else ""
    return {
        "summary": f"vision cache: {device} MiB{host_tier}",
        "max_bytes": cache.max_bytes,
        "host_bytes": cache.host_bytes,
    }


def finish_vision_cache(model: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The cache's counters after the run, and a summary line with its hit rate."""
    device, host = args.vision_cache
    if not device:
        return {}
    from ascend_vlm.reuse import vision_cache_of

    cache = vision_cache_of(model)
    if cache is None:
        return {"summary": f"vision cache: {device} MiB (disabled during the run)"}
    stats = cache.stats()
    per_image = stats.hash_seconds / stats.hashed_images * 1e3 if stats.hashed_images else 0.0
    summary = (
        f"vision cache: {device} MiB; {stats.hits} hits / {stats.misses} misses "
        f"({stats.hit_rate:.1%}), {stats.evictions} evictions, {stats.bytes / MIB:.1f} MiB held, "
        f"hashing {per_image:.3f} ms per image"
    )
    if host:
        summary += (
            f"; host tier: {stats.host_hits} hits, {stats.demotions} demotions, "
            f"{stats.host_bytes / MIB:.1f} MiB held"
        )
    counters = dataclasses.asdict(stats)
    return {"summary": summary, "stats": counters}
