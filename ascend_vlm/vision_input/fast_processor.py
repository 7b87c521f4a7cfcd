"""A processor whose image part is this package's fast preprocessor, where one applies."""

from __future__ import annotations

import copy
from typing import Any

from ascend_vlm.vision_input.content_cache import ContentCache
from ascend_vlm.vision_input.qwen_vl_pixels import QwenVLPixels
from ascend_vlm.vision_input.resize_crop_pixels import ResizeCropPixels


def with_fast_pixels(processor: Any, workers: int = 1, cache_bytes: int = 0) -> Any:
    """A shallow copy of ``processor`` whose image part is a :class:`QwenVLPixels` or a
    :class:`ResizeCropPixels` (same tensors, faster), the first that accepts its image
    processor; otherwise ``processor`` itself. The original keeps its image processor, so
    saving it is unchanged. ``cache_bytes`` > 0 gives the fast part a ``pixel_cache`` of that
    many bytes (images processed before are copied, not processed again)."""
    for fast_class in (QwenVLPixels, ResizeCropPixels):
        try:
            fast = fast_class(processor.image_processor, workers=workers)
        except ValueError:
            continue
        if cache_bytes:
            fast.pixel_cache = ContentCache(cache_bytes, size_of=lambda rows: rows.nbytes)
        clone = copy.copy(processor)
        clone.image_processor = fast
        return clone
    return processor
