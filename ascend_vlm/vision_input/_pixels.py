"""What every fast image preprocessor here shares: reading the reference's settings, the
rescale-and-normalize table, the worker threads, input checks and the one output buffer.

Rescale and normalize map each 8-bit value v of channel c to one float32 number, so they are
one table ``lut[c, v]`` computed with Hugging Face's own float arithmetic (``float64(v) *
rescale_factor`` cast to float32, then ``(x - mean_c) / std_c`` in float32): looked up, the
values equal the reference's bit for bit. The geometric steps (RGB conversion, resize, crop,
padding) are the reference's own calls on uint8 images, so they match too. Every image of a
call is written into its rows of one float32 buffer for the whole batch (optionally a
:class:`~ascend_vlm.vision_input.staging.StagingPool` slot), which the returned
``pixel_values`` shares. PIL and NumPy release the GIL, so a pool of ``workers`` threads
decodes (a file path, or a PIL image opened lazily) and then processes the images of a call.
Paths load as Hugging Face's ``load_image`` loads them (EXIF orientation applied, RGB); PIL
images and arrays are used as they are, as by Hugging Face. With a ``pixel_cache`` (a
:class:`~ascend_vlm.vision_input.content_cache.ContentCache`), an image whose pixels were
processed before under the same settings gets its kept rows copied instead of being processed
again. Its rows are a deterministic function of the image and the reference's settings, so
they are keyed by both: :func:`~ascend_vlm.data.content_keys.processor_settings_key`, and the
content key vouched for the image (:mod:`ascend_vlm.data.content_keys`: the server's hash of
the bytes it decoded) or, for an image without one, its pixels' hash
(:func:`~ascend_vlm.vision_input.content_cache.image_key`: same mode, size, palette,
transparency and pixels).
"""

from __future__ import annotations

import abc
import os
import struct
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from PIL import Image, ImageOps

from ascend_vlm.data.content_keys import processed_content_key, processor_settings_key
from ascend_vlm.data.images import ACCEPTED_IMAGES, check_image_size, is_remote, load_image
from ascend_vlm.vision_input.content_cache import ContentCache, image_key

if TYPE_CHECKING:
    from ascend_vlm.vision_input.staging import StagingPool

# EXIF tag of the orientation a path's image is turned upright by, as Hugging Face's
# load_image does (PIL images passed in are used as they are, as by Hugging Face).
EXIF_ORIENTATION = 0x0112
# Marks, in a PIL image's info, an image this class opened from a path.
_FROM_PATH = "ascend_vlm_from_path"
# The steps every preprocessor here performs; a reference with one turned off is refused.
REQUIRED_STEPS = ("do_convert_rgb", "do_resize", "do_rescale", "do_normalize")


def _reference_only(image: Any) -> bool:
    """Whether ``image`` is an input only the reference processor reads: a 3-D torch tensor or
    non-uint8 array (any other shape is refused by `ImagePixels._prepared`)."""
    if isinstance(image, torch.Tensor):
        return image.dim() == 3
    return isinstance(image, np.ndarray) and image.dtype != np.uint8 and image.ndim == 3


def _flat_images(images: Any) -> list[Any]:
    """The images of a call as one list, as Hugging Face flattens them: one image, a list, a
    list of per-sample lists, or a 4-D array of images."""
    if isinstance(images, np.ndarray) and images.ndim == 4:
        return list(images)
    if not isinstance(images, (list, tuple)):
        return [images]
    flat: list[Any] = []
    for item in images:
        flat.extend(item if isinstance(item, (list, tuple)) else [item])
    return flat


def _rows_key(image: Image.Image, settings: bytes | None) -> bytes | tuple:
    """The pixel cache's key of ``image``'s rows under the reference's ``settings`` (module
    docstring): derived from the key vouched for the image, else from its pixels' hash."""
    processed = processed_content_key(image, settings)
    return (settings, image_key(image)) if processed is None else processed


class ImagePixels(abc.ABC):
    """Base of the fast preprocessors: ``pixels(images)`` returns what
    ``reference(images=images, return_tensors="pt")`` returns, equal value for value.

    Subclasses say what they need of the reference (``family``, ``required_attributes``) and
    implement :meth:`_layout` (an image's output shape), :meth:`_fill` (write one image) and
    :meth:`_features` (the returned tensors besides ``pixel_values``).
    """

    family = "a Hugging Face image processor"
    required_attributes: tuple[str, ...] = ("size", "image_mean", "image_std", "rescale_factor")
    # Each processed image's rows by settings and content (module docstring); None: every image
    # processed.
    pixel_cache: ContentCache | None = None

    def __init__(self, reference: Any, workers: int = 2) -> None:
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
            raise ValueError(f"workers: expected an int >= 1, got {workers!r}")
        missing = [
            name for name in self.required_attributes if getattr(reference, name, None) is None
        ]
        if missing:
            raise ValueError(
                f"reference: expected {self.family}, got {type(reference).__name__} without "
                f"{missing}"
            )
        if getattr(reference, "backend", "pil") != "pil":
            raise ValueError(
                f"reference: expected the PIL backend of {self.family} (its resize is the one "
                f"reproduced here), got {type(reference).__name__} with backend "
                f"{reference.backend!r}; use the model's ...ImageProcessorPil class"
            )
        disabled = [step for step in REQUIRED_STEPS if not getattr(reference, step, False)]
        if disabled:
            raise ValueError(
                f"reference: expected RGB conversion, resize, rescale and normalize all enabled "
                f"(the model's defaults), got {disabled} off"
            )
        self.reference = reference
        self.workers = workers
        values = np.arange(256, dtype=np.float64)
        rescaled = (values * reference.rescale_factor).astype(np.float32)
        mean = np.array(reference.image_mean, dtype=np.float32)
        std = np.array(reference.image_std, dtype=np.float32)
        self._lut = ((rescaled[None, :] - mean[:, None]) / std[:, None]).astype(np.float32)
        # Two adjacent bytes read as one uint16 index two values at once (8 bytes): half the
        # lookups. The byte order of the index is the machine's, like the view that reads it.
        halves = np.arange(65536, dtype=np.uint16).view(np.uint8).reshape(65536, 2)
        pair = np.stack([self._lut[:, halves[:, 0]], self._lut[:, halves[:, 1]]], axis=-1)
        self._pair_lut = np.ascontiguousarray(pair).view(np.int64).reshape(3, 65536)
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

    @abc.abstractmethod
    def _layout(self, index: int, image: Image.Image) -> Any:
        """What :meth:`_rows` and :meth:`_fill` need of ``image``'s output geometry."""

    @abc.abstractmethod
    def _rows(self, layout: Any) -> int:
        """Rows of the output the image with ``layout`` takes."""

    @abc.abstractmethod
    def _row_shape(self) -> tuple[int, ...]:
        """Shape of one output row (``pixel_values`` is ``[rows, *row_shape]``)."""

    @abc.abstractmethod
    def _fill(self, image: Image.Image, layout: Any, out: np.ndarray) -> None:
        """Write ``image``'s values into ``out`` (its rows of the batch)."""

    def _features(self, layouts: list[Any]) -> dict[str, torch.Tensor]:
        """Tensors returned beside ``pixel_values`` (e.g. ``image_grid_thw``)."""
        return {}

    def _map(self, function: Callable[..., Any], jobs: list[tuple[Any, ...]]) -> list[Any]:
        """``[function(*job) for job in jobs]``, run by the workers."""
        if self._pool is None:
            return [function(*job) for job in jobs]
        return list(self._pool.map(lambda job: function(*job), jobs))

    def _channel_values(self, channels: np.ndarray, outs: Sequence[np.ndarray]) -> None:
        """``out[..., c, :] = lut[c, channels[..., c, :]]`` for every ``out`` of ``outs``:
        rescale and normalize of uint8 values laid out with the channel on axis -2 (the last
        axis contiguous in each array)."""
        if channels.shape[-1] % 2 == 0:
            pairs = channels.view(np.uint16)
            targets = [out.view(np.int64) for out in outs]
            for channel in range(3):
                values = self._pair_lut[channel][pairs[..., channel, :]]
                for target in targets:
                    target[..., channel, :] = values
            return
        for channel in range(3):
            values = self._lut[channel][channels[..., channel, :]]
            for out in outs:
                out[..., channel, :] = values

    def _rgb(self, image: Image.Image) -> Image.Image:
        """``image`` converted to RGB by the reference's own conversion (transparency onto
        white in current versions), or ``image`` itself when it is RGB already."""
        if image.mode == "RGB" and image.info.get("transparency") is None:
            return image
        # A PIL image or an HxWx3 array depending on the transformers version.
        converted = self.reference.convert_to_rgb(image)
        return Image.fromarray(converted) if isinstance(converted, np.ndarray) else converted

    def _prepared(self, index: int, image: Any) -> Image.Image:
        """``image`` as a PIL image; its pixels are decoded later, in a worker
        (:meth:`_decoded`). A path opens the file (its header only) and is marked to be loaded
        as Hugging Face loads paths: EXIF orientation applied, converted to RGB. An http(s) or
        data: URL is fetched and decoded here (`ascend_vlm.data.images.load_image`)."""
        name = f"images[{index}]"
        if is_remote(image):
            return load_image(image, name=name)
        if isinstance(image, (str, os.PathLike)):
            path = os.fspath(image)
            if not os.path.isfile(path):
                raise ValueError(f"{name}: expected {ACCEPTED_IMAGES}, got {path!r} (no such file)")
            try:
                opened = Image.open(path)
            except (OSError, SyntaxError, struct.error) as error:
                raise ValueError(f"{name}: cannot open {path!r}: {error}") from None
            opened.info[_FROM_PATH] = True
            return opened
        if isinstance(image, (np.ndarray, torch.Tensor)):
            channels = (1, 3, 4)
            if image.ndim != 3 or not (image.shape[0] in channels or image.shape[-1] in channels):
                raise ValueError(
                    f"{name}: expected an array of shape HxWxC or CxHxW with C in {channels}, "
                    f"got shape {image.shape}"
                )
            if 0 in image.shape:
                raise ValueError(f"{name}: expected a non-empty image, got shape {image.shape}")
            return image  # converted to RGB in a worker, by the reference's array rule
        if not isinstance(image, Image.Image):
            raise ValueError(f"{name}: expected {ACCEPTED_IMAGES}, got {type(image).__name__}")
        check_image_size(image, name)
        return image

    def _decoded(self, index: int, image: Image.Image | np.ndarray) -> Image.Image:
        """``image``'s pixels read (a path's image upright and RGB, an array in RGB by the
        reference's own conversion); a truncated or corrupt file raises ``ValueError`` naming
        it."""
        if isinstance(image, np.ndarray):
            from transformers.image_utils import ChannelDimension, infer_channel_dimension_format

            # As the reference: its conversion infers the channel axis (the first one when
            # ambiguous) and keeps it; the result's axis is inferred again.
            try:
                rgb = np.asarray(self.reference.convert_to_rgb(image))
                first = ChannelDimension.FIRST
                if infer_channel_dimension_format(rgb, num_channels=(3,)) == first:
                    rgb = np.moveaxis(rgb, 0, -1)
            except ValueError as error:  # older references convert fewer channel layouts
                raise ValueError(
                    f"images[{index}]: the reference cannot convert an array of shape "
                    f"{image.shape} to RGB: {error}"
                ) from None
            return Image.fromarray(np.ascontiguousarray(rgb))
        try:
            image.load()
            check_image_size(image, f"images[{index}]")
            if image.info.get(_FROM_PATH):
                image = ImageOps.exif_transpose(image).convert("RGB")
        except (OSError, SyntaxError, struct.error) as error:  # PIL reads the data only now
            raise ValueError(f"images[{index}]: cannot read the image: {error}") from None
        return image

    def __call__(
        self, images: Any = None, *, staging: StagingPool | None = None, **kwargs: Any
    ) -> Any:
        """``pixel_values`` (and the family's other image tensors) of ``images`` (one image or
        a list) as a ``BatchFeature`` of torch tensors. Other keyword arguments are refused
        unless they ask for what this class does (``return_tensors="pt"``).

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
        listed = _flat_images(images)
        if not listed:
            raise ValueError("images: expected at least one image, got none")
        if any(_reference_only(image) for image in listed):
            return self._by_reference(images, staging)
        opened = [self._prepared(i, image) for i, image in enumerate(listed)]
        # Decoding first (in the workers), so sizes are the loaded images' (a path's EXIF
        # rotation applied), then one buffer for the batch, then the pixels (in the workers).
        prepared = self._map(self._decoded, list(enumerate(opened)))
        layouts = [self._layout(i, image) for i, image in enumerate(prepared)]
        counts = [self._rows(layout) for layout in layouts]
        shape = (sum(counts), *self._row_shape())
        if staging is None:
            pixel_values = torch.empty(shape, dtype=torch.float32)
        else:
            pixel_values = staging.tensor(shape, torch.float32)
        starts = np.cumsum([0, *counts])
        values = pixel_values.numpy()
        jobs = [
            (image, layout, values[start:end])
            for image, layout, start, end in zip(
                prepared, layouts, starts[:-1], starts[1:], strict=True
            )
        ]
        self._fill_all(jobs)
        return BatchFeature(data={"pixel_values": pixel_values, **self._features(layouts)})

    def _fill_all(self, jobs: list[tuple[Image.Image, Any, np.ndarray]]) -> None:
        """Run every ``(image, layout, out)`` job of :meth:`_fill`, the ones the
        ``pixel_cache`` holds by copying their kept rows."""
        cache = self.pixel_cache
        if cache is None:
            self._map(self._fill, jobs)
            return
        settings = processor_settings_key(self.reference)
        keys = [_rows_key(image, settings) for image, _, _ in jobs]
        missed = []
        for key, job in zip(keys, jobs, strict=True):
            kept = cache.get(key)
            if kept is None:
                missed.append((key, job))
            else:
                job[2][...] = kept
        self._map(self._fill, [job for _, job in missed])
        for key, (_, _, out) in missed:
            cache.put(key, out.copy())

    preprocess = __call__

    def _by_reference(self, images: Any, staging: StagingPool | None) -> Any:
        """The reference processor's result for inputs the fast path does not read itself
        (tensors, float arrays: the reference's own rescaling rules apply to them), its
        ``pixel_values`` copied into a ``staging`` slot when one is given."""
        features = self.reference(images, return_tensors="pt")
        if staging is not None:
            pixel_values = features["pixel_values"]
            slot = staging.tensor(tuple(pixel_values.shape), pixel_values.dtype)
            features["pixel_values"] = slot.copy_(pixel_values)
        return features
