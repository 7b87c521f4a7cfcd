"""The vision input path: images to the pixels a VLM's vision tower takes, staged in
page-locked memory, uploaded on the runtime's own stream, prepared ahead of the model.

* :class:`QwenVLPixels` (Qwen2/2.5/3-VL) and :class:`ResizeCropPixels` (CLIP, SigLIP, LLaVA):
  drop-ins for a processor's image part, equal to Hugging Face's output, faster, writing every
  image straight into one output buffer from a pool of worker threads;
* :class:`StagingPool`: a bounded pool of page-locked buffers that output is written into;
* :class:`BatchUploader`: host-to-device copies on a dedicated runtime stream, the consumer
  (torch_npu's stream) ordered after them by an event;
* :class:`Prefetcher`: batches prepared (and uploaded) in a background thread, in order,
  a bounded number ahead.
"""

from ascend_vlm.vision_input.prefetch import Prefetcher
from ascend_vlm.vision_input.qwen_vl_pixels import QwenVLPixels
from ascend_vlm.vision_input.resize_crop_pixels import ResizeCropPixels
from ascend_vlm.vision_input.staging import StagingPool
from ascend_vlm.vision_input.upload import BatchUploader

__all__ = ["BatchUploader", "Prefetcher", "QwenVLPixels", "ResizeCropPixels", "StagingPool"]
