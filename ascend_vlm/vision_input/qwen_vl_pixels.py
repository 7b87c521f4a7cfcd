"""Qwen2/2.5/3-VL image preprocessing equal to Hugging Face's, in two passes over the pixels.

Hugging Face's ``Qwen2VLImageProcessorPil`` (which Qwen3-VL uses too, with its own patch size
and statistics) turns each image into patches in five steps: convert to RGB, resize with PIL
to the ``smart_resize`` size (both sides multiples of ``patch_size * merge_size``, area within
the configured pixel range), rescale, normalize, and patchify: rows of ``C * T * P * P``
values, one per ``P x P`` patch, in merge-window order, each patch repeated over ``T`` =
``temporal_patch_size`` frames. Here the uint8 image is rearranged into patch order first (1
byte per value), then looked up through the rescale-and-normalize table
(:mod:`ascend_vlm.vision_input._pixels`) into its rows of the batch's output.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import numpy as np
import torch
from PIL import Image

from ascend_vlm.vision_input._pixels import ImagePixels

# The leading parameters of Qwen-VL's size rule; GLM-4V's module defines a smart_resize that
# takes the frame count first and rounds otherwise.
_SIZE_RULE_PARAMETERS = ("height", "width")


def _leading_parameters(function: Any) -> tuple[str, ...]:
    return tuple(inspect.signature(function).parameters)[: len(_SIZE_RULE_PARAMETERS)]


class QwenVLPixels(ImagePixels):
    """The image part of a Qwen2/2.5/3-VL processor: ``pixels(images)`` returns what
    ``reference(images=images, return_tensors="pt")`` returns (``pixel_values`` float32
    ``[sum of patches, C*T*P*P]`` and ``image_grid_thw`` int64 ``[images, 3]``), equal value
    for value, for PIL images, uint8 arrays (HxWxC or CxHxW) and local file paths.

    ``reference`` is the model's Hugging Face image processor (``processor.image_processor``);
    its settings are read once. Assign the instance to ``processor.image_processor`` to use it
    through the processor. ``workers`` threads process the images of a call (1: in the
    caller's thread).
    """

    family = "a Qwen2/2.5/3-VL image processor"
    required_attributes = (
        *ImagePixels.required_attributes,
        "patch_size",
        "merge_size",
        "temporal_patch_size",
    )

    def __init__(self, reference: Any, workers: int = 2) -> None:
        super().__init__(reference, workers)
        # The size rule of the reference's own module.
        smart_resize = getattr(sys.modules[type(reference).__module__], "smart_resize", None)
        if smart_resize is None or _leading_parameters(smart_resize) != _SIZE_RULE_PARAMETERS:
            self.close()
            raise ValueError(
                f"reference: expected {self.family}, whose module defines "
                f"smart_resize{_SIZE_RULE_PARAMETERS}; {type(reference).__module__} does not"
            )
        self._smart_resize = smart_resize
        self.patch_size = reference.patch_size
        self.merge_size = reference.merge_size
        self.temporal_patch_size = reference.temporal_patch_size
        size = reference.size
        self.min_pixels = size["shortest_edge"]
        self.max_pixels = size["longest_edge"]
        self.resample = reference.resample

    def _layout(self, index: int, image: Image.Image) -> tuple[int, int]:
        factor = self.patch_size * self.merge_size
        try:
            height, width = self._smart_resize(
                image.height, image.width, factor, self.min_pixels, self.max_pixels
            )
        except ValueError as error:
            raise ValueError(f"images[{index}]: {error}") from None
        return height // self.patch_size, width // self.patch_size

    def _rows(self, layout: tuple[int, int]) -> int:
        return layout[0] * layout[1]

    def _row_shape(self) -> tuple[int, ...]:
        return (3 * self.temporal_patch_size * self.patch_size**2,)

    def _fill(self, image: Image.Image, layout: tuple[int, int], out: np.ndarray) -> None:
        """Convert ``image`` to RGB, resize it to ``layout`` patches and write its patch rows
        into ``out``."""
        patch, merge, frames = self.patch_size, self.merge_size, self.temporal_patch_size
        grid_h, grid_w = layout
        resized = self._rgb(image).resize((grid_w * patch, grid_h * patch), resample=self.resample)
        pixels = np.asarray(resized)  # H x W x 3 uint8
        windows = pixels.reshape(grid_h // merge, merge, patch, grid_w // merge, merge, patch, 3)
        # (windows down, windows across, row in window, column in window, C, P, P): the
        # reference's patch order.
        ordered = np.ascontiguousarray(windows.transpose(0, 3, 1, 4, 6, 2, 5))
        ordered = ordered.reshape(grid_h * grid_w, 3, patch * patch)
        rows = out.reshape(grid_h * grid_w, 3, frames, patch * patch)
        self._channel_values(ordered, [rows[:, :, frame] for frame in range(frames)])

    def _features(self, layouts: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
        grid_thw = torch.tensor([[1, h, w] for h, w in layouts], dtype=torch.int64)
        return {"image_grid_thw": grid_thw}
