"""CLIP-style image preprocessing (CLIP, SigLIP, LLaVA) equal to Hugging Face's PIL backend.

Those processors take each image through RGB conversion, optional padding to a square in the
mean colour (LLaVA's ``do_pad``), a PIL resize (to a shortest edge or a fixed size), an
optional centre crop, then rescale and normalize, and stack the results as ``[images, 3, H,
W]``. The geometric steps here are the reference's own methods on the uint8 image; rescale
and normalize are the shared lookup table (:mod:`ascend_vlm.vision_input._pixels`), written
straight into the batch's output.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image

from ascend_vlm.vision_input._pixels import ImagePixels


def _standard_pipelines() -> tuple[Any, ...]:
    """The ``_preprocess`` implementations whose steps this class reproduces."""
    from transformers.image_processing_backends import PilBackend
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    return (PilBackend._preprocess, LlavaImageProcessorPil._preprocess)


class ResizeCropPixels(ImagePixels):
    """The image part of a CLIP, SigLIP or LLaVA processor (PIL backend): ``pixels(images)``
    returns ``pixel_values`` float32 ``[images, 3, H, W]`` equal to the reference's, for PIL
    images and uint8 HWC arrays.

    ``reference`` must use the standard resize / crop / rescale / normalize pipeline (or
    LLaVA's, with its pad to square) and produce one size for every image: a centre crop, or a
    resize to a fixed height and width. ``workers`` as for
    :class:`~ascend_vlm.vision_input.QwenVLPixels`.
    """

    family = "a CLIP-style (CLIP, SigLIP, LLaVA) PIL image processor"

    def __init__(self, reference: Any, workers: int = 2) -> None:
        super().__init__(reference, workers)
        try:
            if type(reference)._preprocess not in _standard_pipelines():
                raise ValueError(
                    f"reference: expected {self.family}; {type(reference).__name__} has its "
                    f"own preprocessing steps"
                )
            self._crop = bool(getattr(reference, "do_center_crop", False))
            target = reference.crop_size if self._crop else reference.size
            if not (target.height and target.width):
                raise ValueError(
                    f"reference: expected one output size for every image (a centre crop or a "
                    f"resize to height and width), got size={dict(reference.size)} without a "
                    f"crop"
                )
            self._pad = bool(getattr(reference, "do_pad", False))
        except ValueError:
            self.close()
            raise
        self.height, self.width = int(target.height), int(target.width)
        self._background = tuple(int(x * 255) for x in reference.image_mean)

    def _layout(self, index: int, image: Image.Image) -> None:
        return None

    def _rows(self, layout: None) -> int:
        return 1

    def _row_shape(self) -> tuple[int, ...]:
        return (3, self.height, self.width)

    def _fill(self, image: Image.Image, layout: None, out: np.ndarray) -> None:
        reference = self.reference
        rgb = np.asarray(reference.convert_to_rgb(image))  # H x W x 3 uint8
        chw = np.moveaxis(rgb, -1, 0)
        if self._pad:
            chw = reference.pad_to_square(chw, background_color=self._background)
        chw = reference.resize(image=chw, size=reference.size, resample=reference.resample)
        if self._crop:
            chw = reference.center_crop(chw, reference.crop_size)
        if chw.dtype != np.uint8:
            raise RuntimeError(
                f"reference: its resize returned {chw.dtype} values, expected uint8; this "
                "transformers version is not supported by ResizeCropPixels"
            )
        self._channel_values(chw.reshape(3, -1), out.reshape(3, -1))
