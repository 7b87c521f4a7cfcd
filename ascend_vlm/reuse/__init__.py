"""Reuse across turns and requests: chat sessions that keep their KV cache, and a
vision-feature cache shared by models and requests.

``ChatSession(model, processor)`` answers ``ask(text, images=...)`` turn after turn, prefilling
only each new turn's tokens; its greedy answers are those of ``generate`` over the whole
conversation. ``VisionCache(max_bytes=...)`` holds the vision tower's per-image outputs (an LRU
bounded by bytes, keyed by a hash of the pixels or a caller's image key, and by the vision
weights); ``enable_vision_cache(model, cache)`` makes ``model`` answer repeated images from it
and ``disable_vision_cache(model)`` stops that.
"""

from __future__ import annotations

from ascend_vlm.reuse.cached_features import (
    disable_vision_cache,
    enable_vision_cache,
    vision_cache_of,
)
from ascend_vlm.reuse.chat_session import ChatSession
from ascend_vlm.reuse.vision_cache import VisionCache, VisionCacheStats

__all__ = [
    "ChatSession",
    "VisionCache",
    "VisionCacheStats",
    "disable_vision_cache",
    "enable_vision_cache",
    "vision_cache_of",
]
