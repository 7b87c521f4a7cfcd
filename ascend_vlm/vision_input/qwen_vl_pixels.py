"""Qwen2/2.5-VL image preprocessing equal to Hugging Face's, in two passes over the pixels.

Hugging Face's ``Qwen2VLImageProcessorPil`` turns each image into patches in five steps:
convert to RGB (its ``convert_to_rgb``, which this class calls too), resize with PIL to the
``smart_resize`` size (both sides multiples of ``patch_size * merge_size``, area within the
configured pixel range), rescale (``float64(v) * rescale_factor`` cast to float32), normalize
(``(x - mean_c) / std_c`` in float32), and patchify: rows of ``C * T * P * P`` values, one
per ``P x P`` patch, in merge-window order, each patch repeated over ``T`` =
``temporal_patch_size`` frames.

Rescale and normalize map each 8-bit value v of channel c to one float32 number, so here they
are one table ``lut[c, v]`` computed with that very float arithmetic: the values equal
Hugging Face's bit for bit. The uint8 image is rearranged into patch order first (1 byte per
value), then looked up into its rows of one float32 output for the whole batch, which the
returned ``pixel_values`` tensor shares (no concatenation, no copy). Conversion and resizing
are the same PIL calls as Hugging Face's; PIL and NumPy release the GIL in them, so images
are processed by a pool of ``workers`` threads.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from PIL import Image

if TYPE_CHECKING:
    from ascend_vlm.vision_input.staging import StagingPool


class QwenVLPixels:
    """The image part of a Qwen2/2.5-VL processor: ``pixels(images)`` returns what
    ``reference(images=images, return_tensors="pt")`` returns (``pixel_values`` float32
    ``[sum of patches, C*T*P*P]`` and ``image_grid_thw`` int64 ``[images, 3]``), equal value
    for value, for PIL images and uint8 HWC arrays.

    ``reference`` is the model's Hugging Face image processor (``processor.image_processor``);
    its settings are read once. Assign the instance to ``processor.image_processor`` to use it
    through the processor. ``workers`` threads process the images of a call (1: in the
    caller's thread).
    """

    def __init__(self, reference: Any, workers: int = 2) -> None:
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers: expected an int >= 1, got {workers!r}")
        missing = [
            name
            for name in ("patch_size", "merge_size", "temporal_patch_size", "size", "image_mean")
            if getattr(reference, name, None) is None
        ]
        if missing:
            raise ValueError(
                f"reference: expected a Qwen2/2.5-VL image processor, got "
                f"{type(reference).__name__} without {missing}"
            )
        steps = ("do_convert_rgb", "do_resize", "do_rescale", "do_normalize")
        disabled = [step for step in steps if not getattr(reference, step, False)]
        if disabled:
            raise ValueError(
                f"reference: expected RGB conversion, resize, rescale and normalize all enabled "
                f"(the model's defaults), got {disabled} off"
            )
        # The size rule of the reference's own module, whichever backend it is.
        smart_resize = getattr(sys.modules[type(reference).__module__], "smart_resize", None)
        if smart_resize is None:
            raise ValueError(
                f"reference: expected a Qwen2/2.5-VL image processor, whose module defines "
                f"smart_resize; {type(reference).__module__} does not"
            )
        self.reference = reference
        self.workers = workers
        self._smart_resize = smart_resize
        self.patch_size = reference.patch_size
        self.merge_size = reference.merge_size
        self.temporal_patch_size = reference.temporal_patch_size
        size = reference.size
        self.min_pixels = size["shortest_edge"]
        self.max_pixels = size["longest_edge"]
        self.resample = reference.resample
        values = np.arange(256, dtype=np.float64)
        rescaled = (values * reference.rescale_factor).astype(np.float32)
        mean = np.array(reference.image_mean, dtype=np.float32)
        std = np.array(reference.image_std, dtype=np.float32)
        self._lut = ((rescaled[None, :] - mean[:, None]) / std[:, None]).astype(np.float32)
        self._pool = ThreadPoolExecutor(workers) if workers > 1 else None

    def close(self) -> None:
        """Stop the worker threads (also when the instance is garbage-collected)."""
        pool = self.__dict__.pop("_pool", None)
        if pool is not None:
            pool.shutdown(wait=True)
        self.__dict__["_pool"] = None

    def __del__(self) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:
        # Everything else (model_input_names, get_number_of_image_patches ...) is the
        # reference's, so the processor around it keeps working.
        if name.startswith("_") or "reference" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["reference"], name)

    def _prepared(self, index: int, image: Any) -> Image.Image:
        if isinstance(image, np.ndarray):
            if image.dtype != np.uint8 or image.ndim not in (2, 3):
                raise ValueError(
                    f"images[{index}]: expected a PIL image or a uint8 HxW or HxWxC array, got "
                    f"a {image.dtype} array of shape {image.shape}"
                )
            image = Image.fromarray(image)
        if not isinstance(image, Image.Image):
            raise ValueError(
                f"images[{index}]: expected a PIL image or a uint8 array, got {type(image).__name__}"
            )
        try:
            image.load()  # a truncated or corrupt file fails here, not in a worker thread
        except (OSError, struct.error) as error:  # PIL reads the file's data only now
            raise ValueError(f"images[{index}]: cannot read the image: {error}") from None
        return image

    def _grid(self, index: int, image: Image.Image) -> tuple[int, int]:
        factor = self.patch_size * self.merge_size
        try:
            height, width = self._smart_resize(
                image.height, image.width, factor, self.min_pixels, self.max_pixels
            )
        except ValueError as error:
            raise ValueError(f"images[{index}]: {error}") from None
        return height // self.patch_size, width // self.patch_size

    def _fill(self, image: Image.Image, grid: tuple[int, int], rows: np.ndarray) -> None:
        """Convert ``image`` to RGB, resize it to ``grid`` patches and write its patch rows
        into ``rows``."""
        patch, merge, frames = self.patch_size, self.merge_size, self.temporal_patch_size
        grid_h, grid_w = grid
        # The reference's own conversion (transparency onto white in current versions); it
        # returns a PIL image or an HxWx3 array depending on the transformers version.
        image = self.reference.convert_to_rgb(image)
        if isinstance(image, np.ndarray):
            image = Image.fromarray(image)
        resized = image.resize((grid_w * patch, grid_h * patch), resample=self.resample)
        pixels = np.asarray(resized)  # H x W x 3 uint8
        windows = pixels.reshape(grid_h // merge, merge, patch, grid_w // merge, merge, patch, 3)
        # (windows down, windows across, row in window, column in window, C, P, P): the
        # reference's patch order.
        ordered = np.ascontiguousarray(windows.transpose(0, 3, 1, 4, 6, 2, 5))
        ordered = ordered.reshape(grid_h * grid_w, 3, patch * patch)
        out = rows.reshape(grid_h * grid_w, 3, frames, patch * patch)
        for channel in range(3):
            np.take(self._lut[channel], ordered[:, channel], out=out[:, channel, 0])
        out[:, :, 1:] = out[:, :, :1]

    def __call__(
        self, images: Any = None, *, staging: StagingPool | None = None, **kwargs: Any
    ) -> Any:
        """``pixel_values`` and ``image_grid_thw`` of ``images`` (one image or a list) as a
        ``BatchFeature`` of torch tensors. Other keyword arguments are refused unless they
        ask for what this class does (``return_tensors="pt"``).

        With ``staging``, ``pixel_values`` is written into (and shares) one of its page-locked
        slots, which stays taken while the tensor or any view of it lives.
        """
        from transformers import BatchFeature

        unknown = {k: v for k, v in kwargs.items() if not (k == "return_tensors" and v == "pt")}
        if unknown:
            raise ValueError(
                f"kwargs: expected none but return_tensors='pt' (the reference's settings apply), "
                f"got {unknown}"
            )
        if images is None:
            raise ValueError("images: expected one image or a list of images, got None")
        listed: Sequence[Any] = images if isinstance(images, (list, tuple)) else [images]
        prepared = [self._prepared(i, image) for i, image in enumerate(listed)]
        grids = [self._grid(i, image) for i, image in enumerate(prepared)]
        counts = [h * w for h, w in grids]
        width = 3 * self.temporal_patch_size * self.patch_size**2
        shape = (sum(counts), width)
        if staging is None:
            pixel_values = np.empty(shape, dtype=np.float32)
        else:
            slot = staging.acquire(4 * shape[0] * shape[1])
            pixel_values = slot.view(np.float32).reshape(shape)
        starts = np.cumsum([0, *counts])
        jobs = [
            (image, grid, pixel_values[start:end])
            for image, grid, start, end in zip(
                prepared, grids, starts[:-1], starts[1:], strict=True
            )
        ]
        if self._pool is None:
            for job in jobs:
                self._fill(*job)
        else:
            list(self._pool.map(lambda job: self._fill(*job), jobs))
        grid_thw = torch.tensor([[1, h, w] for h, w in grids], dtype=torch.int64)
        return BatchFeature(
            data={"pixel_values": torch.from_numpy(pixel_values), "image_grid_thw": grid_thw}
        )

    preprocess = __call__
