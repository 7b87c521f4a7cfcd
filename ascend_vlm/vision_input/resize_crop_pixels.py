"""CLIP-style image preprocessing (CLIP, SigLIP, LLaVA) equal to Hugging Face's PIL backend.

Those processors take each image through RGB conversion, optional padding to a square in the
mean colour (LLaVA's ``do_pad``), a PIL resize (to a shortest edge or a fixed size), an
optional centre crop, then rescale and normalize, and stack the results as ``[images, 3, H,
W]``. Here the same PIL resize runs on the PIL image itself (no round trips through NumPy),
the output size comes from the reference's own rule, padding and cropping are the same
placements on uint8 pixels, and rescale and normalize are the shared lookup table
(:mod:`ascend_vlm.vision_input._pixels`), written straight into the batch's output.
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
    images, uint8 arrays (HxWxC or CxHxW) and local file paths.

    ``reference`` must use the standard resize / crop / rescale / normalize pipeline (or
    LLaVA's, with its pad to square) and produce one size for every image: a centre crop, or a
    resize to a fixed height and width. ``workers`` as for
    :class:`~ascend_vlm.vision_input.QwenVLPixels`.
    """

    family = "a CLIP-style (CLIP, SigLIP, LLaVA) PIL image processor"

    def __init__(self, reference: Any, workers: int = 2) -> None:
        super().__init__(reference, workers)
        try:
            standard, llava = _standard_pipelines()
            pipeline = type(reference)._preprocess
            if pipeline not in (standard, llava):
                raise ValueError(
                    f"reference: expected {self.family}; {type(reference).__name__} has its "
                    f"own preprocessing steps"
                )
            # LLaVA's do_pad pads to a square before resizing; the standard pipeline's pads
            # the normalized batch to a common size, which is not reproduced here.
            self._pad = bool(getattr(reference, "do_pad", False))
            if self._pad and pipeline is standard:
                raise ValueError(
                    f"reference: expected do_pad off (padding the normalized images to "
                    f"pad_size is not reproduced), got {type(reference).__name__} with do_pad"
                )
            self._crop = bool(getattr(reference, "do_center_crop", False))
            target = reference.crop_size if self._crop else reference.size
            if not (target.height and target.width):
                raise ValueError(
                    f"reference: expected one output size for every image (a centre crop or a "
                    f"resize to height and width), got size={dict(reference.size)} without a "
                    f"crop"
                )
            # The reference tries its size rules in this order: shortest edge (with a longest
            # edge, not reproduced), max height and width (not reproduced), height and width.
            size = reference.size
            shortest = bool(size.shortest_edge) and not size.longest_edge
            fixed = (
                not size.shortest_edge
                and not (size.max_height and size.max_width)
                and bool(size.height and size.width)
            )
            if not (shortest or fixed):
                raise ValueError(
                    f"reference: expected a resize to a shortest edge alone or to height and "
                    f"width, got size={dict(size)}"
                )
            self._fixed_size = fixed
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

    def _resized_size(self, height: int, width: int) -> tuple[int, int]:
        """``(height, width)`` the reference resizes an image of that size to."""
        size = self.reference.size
        if self._fixed_size:
            return int(size.height), int(size.width)
        from transformers.image_transforms import get_resize_output_image_size
        from transformers.image_utils import ChannelDimension

        # The reference's own rule, given a zero-stride stand-in of the image's shape.
        stand_in = np.broadcast_to(np.uint8(0), (3, height, width))
        new_height, new_width = get_resize_output_image_size(
            stand_in,
            size=size.shortest_edge,
            default_to_square=False,
            input_data_format=ChannelDimension.FIRST,
        )
        return int(new_height), int(new_width)

    def _fill(self, image: Image.Image, layout: None, out: np.ndarray) -> None:
        reference = self.reference
        rgb = self._rgb(image)
        if self._pad and rgb.width != rgb.height:
            # LLaVA's pad to square: centred on a canvas of the mean colour.
            side = max(rgb.width, rgb.height)
            canvas = Image.new("RGB", (side, side), self._background)
            canvas.paste(rgb, ((side - rgb.width) // 2, (side - rgb.height) // 2))
            rgb = canvas
        height, width = self._resized_size(rgb.height, rgb.width)
        hwc = np.asarray(rgb.resize((width, height), resample=reference.resample))
        if self._crop:
            top = (height - self.height) // 2
            left = (width - self.width) // 2
            if top >= 0 and left >= 0:
                hwc = hwc[top : top + self.height, left : left + self.width]
            else:  # smaller than the crop: the reference pads it
                chw = reference.center_crop(np.moveaxis(hwc, -1, 0), reference.crop_size)
                hwc = np.moveaxis(chw, 0, -1)
        chw = np.ascontiguousarray(np.moveaxis(hwc, -1, 0))
        self._channel_values(chw.reshape(3, -1), [out.reshape(3, -1)])
