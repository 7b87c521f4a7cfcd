"""The vision input path: images to the pixels a VLM's vision tower takes.

* :class:`QwenVLPixels` (:mod:`~ascend_vlm.vision_input.qwen_vl_pixels`): a drop-in for a
  Qwen2/2.5-VL processor's image part, equal to Hugging Face's output, faster, and writing
  every image straight into one output buffer from a pool of worker threads.
"""

from ascend_vlm.vision_input.qwen_vl_pixels import QwenVLPixels

__all__ = ["QwenVLPixels"]
