"""Where each visual token of a prompt sits in the original image.

:func:`visual_token_cells` inverts an image processor's geometry: for every visual placeholder
token the processor put into ``input_ids`` it gives the pixel box of the *original* image that
the token sees. :func:`cell_pixel_map` paints per-token values (e.g. attention weights) back onto
the original image's pixels.

Geometry per family (read from transformers 5.x):

* Qwen-VL (``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl``): the whole image is resized, without crop
  or pad, to ``(grid_h * patch, grid_w * patch)`` pixels, ``image_grid_thw[i] = (1, grid_h,
  grid_w)``. The language model sees one token per ``merge x merge`` block of patches, in raster
  order of the ``(grid_h / merge) x (grid_w / merge)`` block grid (Qwen2.5-VL's window attention
  reorders blocks inside the vision tower and restores their order before returning). Token
  ``(r, c)`` of a ``rows x cols`` grid therefore covers ``x in [c W / cols, (c + 1) W / cols)``,
  ``y in [r H / rows, (r + 1) H / rows)`` of the original ``W x H`` image.
* LLaVA (``llava``) with a CLIP-, SigLIP- or LLaVA-style image processor: optionally pad to a
  centred square (LLaVA processor, ``do_pad``), resize (``shortest_edge``: the short side becomes
  ``s`` and the long side ``int(s * long / short)``; ``height``/``width``: that exact size),
  optionally center-crop, optionally pad bottom/right (other processors' ``do_pad``). The vision
  tower cuts the final ``H' x W'`` image into ``patch x patch`` patches, raster order. A patch's
  box is mapped back by undoing each step; boxes are clipped to the image, so a patch that sees
  only padding has an empty box and pixels cropped away lie in no box.

The geometry comes from the image processor's attributes; arguments passed to a single processor
call that override them (``size=...``) are not visible here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import PIL.Image

from ascend_vlm.models import require_feature

# Vision towers LLaVA is built on, and whether their output starts with a CLS token.
_TOWER_HAS_CLS = {"clip_vision_model": True, "siglip_vision_model": False}


@dataclass(frozen=True, eq=False)
class ImageCells:
    """The visual tokens of one image: token k (in prompt order, 0-based within this image)
    covers original-image pixel box boxes[k] = (x0, y0, x1, y1) (floats, x1/y1 exclusive),
    laid out as a rows x cols raster (token k at row k // cols, col k % cols).

    Boxes are clipped to the image; a token that sees only padding has an empty box
    (x0 == x1 or y0 == y1).
    """

    image_index: int
    rows: int
    cols: int
    boxes: np.ndarray  # float64 [rows*cols, 4]
    image_size: tuple[int, int]  # (width, height) of the original image

    def __post_init__(self) -> None:
        if self.rows < 1 or self.cols < 1:
            raise ValueError(f"rows, cols: expected >= 1, got {self.rows}, {self.cols}")
        expected = (self.rows * self.cols, 4)
        if self.boxes.shape != expected:
            raise ValueError(f"boxes: expected shape {expected}, got {self.boxes.shape}")

    @property
    def num_tokens(self) -> int:
        """rows * cols, the number of visual tokens of this image."""
        return self.rows * self.cols


def visual_token_cells(
    config: Any,
    image_processor: Any,
    images: Sequence[PIL.Image.Image],
    inputs: Mapping[str, Any],
) -> list[ImageCells]:
    """One ImageCells per image, in prompt order. `config` is the model config (model_type
    tells the family), `image_processor` the processor's image part, `inputs` the processor's
    output for these images (e.g. holds image_grid_thw for Qwen). The total token count equals
    the number of visual placeholder tokens the processor put into input_ids.

    Raises ValueError for a model_type whose family descriptor refuses the attention overlay
    (with the family's reason), a LLaVA configuration whose visual tokens
    are not a patch raster (CLIP's CLS token kept, or a SigLIP patch dropped), and inputs that
    do not match the images.
    """
    descriptor = require_feature(config, "attention_overlay", argument="config")
    sizes = [_image_size(image, index) for index, image in enumerate(images)]
    # Images encoded with a grid (image_grid_thw) are Qwen-VL's merged grids.
    if descriptor.encoders[0].grid is not None:
        return _qwen_cells(config, image_processor, sizes, inputs)
    return _llava_cells(config, image_processor, sizes, inputs)


def cell_pixel_map(cells: ImageCells, weights: Any) -> np.ndarray:
    """float64 [height, width] over the ORIGINAL image: each pixel gets the weight of the token
    whose box holds the pixel centre (pixels outside every box, e.g. cropped away by a center
    crop, get NaN). `weights` is a 1-D tensor/array of length rows*cols.

    Pixel (x, y) has centre (x + 0.5, y + 0.5); box (x0, y0, x1, y1) holds it when
    x0 <= x + 0.5 < x1 and y0 <= y + 0.5 < y1.
    """
    values = _as_float_array(weights)
    if values.shape != (cells.num_tokens,):
        raise ValueError(
            f"weights: expected a 1-D array of {cells.num_tokens} values "
            f"({cells.rows} x {cells.cols} tokens), got shape {values.shape}"
        )
    if not np.isfinite(values).all():
        raise ValueError("weights: expected finite values, got NaN or infinity")
    width, height = cells.image_size
    pixel_map = np.full((height, width), np.nan)
    # First pixel index whose centre is >= an edge: ceil(edge - 0.5). Neighbouring boxes share
    # the same float edge, so every pixel lands in at most one box.
    first = np.ceil(cells.boxes - 0.5).astype(np.int64)
    first[:, [0, 2]] = first[:, [0, 2]].clip(0, width)
    first[:, [1, 3]] = first[:, [1, 3]].clip(0, height)
    for (x_start, y_start, x_stop, y_stop), value in zip(first, values, strict=True):
        pixel_map[y_start:y_stop, x_start:x_stop] = value
    return pixel_map


def _image_size(image: Any, index: int) -> tuple[int, int]:
    if not isinstance(image, PIL.Image.Image):
        raise ValueError(f"images[{index}]: expected a PIL.Image.Image, got {type(image).__name__}")
    return image.size


def _as_float_array(value: Any) -> np.ndarray:
    """A float64 numpy copy of a tensor (any device or dtype, bfloat16 included) or array."""
    if hasattr(value, "detach"):
        value = value.detach().to("cpu").double().numpy()
    return np.asarray(value, dtype=np.float64)


def _as_int_array(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):
        value = value.detach().to("cpu").numpy()
    return np.asarray(value, dtype=np.int64)


def _raster_boxes(
    rows: int, cols: int, x_edges: np.ndarray, y_edges: np.ndarray, width: int, height: int
) -> np.ndarray:
    """[rows*cols, 4] boxes of a raster whose cell (r, c) spans x_edges[c:c+2], y_edges[r:r+2],
    clipped to the width x height image."""
    x_edges = np.clip(x_edges, 0.0, width)
    y_edges = np.clip(y_edges, 0.0, height)
    r, c = np.divmod(np.arange(rows * cols), cols)
    return np.stack([x_edges[c], y_edges[r], x_edges[c + 1], y_edges[r + 1]], axis=1)


def _qwen_cells(
    config: Any, image_processor: Any, sizes: list[tuple[int, int]], inputs: Mapping[str, Any]
) -> list[ImageCells]:
    if "image_grid_thw" not in inputs:
        raise ValueError(
            f"inputs: expected the processor's output holding image_grid_thw, got keys {sorted(inputs)}"
        )
    grids = _as_int_array(inputs["image_grid_thw"])
    if grids.ndim != 2 or grids.shape[1] != 3 or len(grids) != len(sizes):
        raise ValueError(
            f"inputs['image_grid_thw']: expected shape ({len(sizes)}, 3), one row per image, "
            f"got {tuple(grids.shape)}"
        )
    merge = _qwen_merge_size(config, image_processor)
    cells = []
    for index, ((width, height), (frames, grid_h, grid_w)) in enumerate(
        zip(sizes, grids.tolist(), strict=True)
    ):
        if frames != 1 or grid_h % merge or grid_w % merge:
            raise ValueError(
                f"inputs['image_grid_thw'][{index}]: expected (1, h, w) with h and w multiples "
                f"of the merge size {merge}, got {(frames, grid_h, grid_w)}"
            )
        rows, cols = grid_h // merge, grid_w // merge
        # The whole image is resized onto the grid, so token edges split it evenly.
        x_edges = np.arange(cols + 1) * (width / cols)
        y_edges = np.arange(rows + 1) * (height / rows)
        boxes = _raster_boxes(rows, cols, x_edges, y_edges, width, height)
        cells.append(ImageCells(index, rows, cols, boxes, (width, height)))
    return cells


def _qwen_merge_size(config: Any, image_processor: Any) -> int:
    """The processor's merge_size (it sets the token count); must agree with the model's."""
    from_processor = getattr(image_processor, "merge_size", None)
    vision_config = getattr(config, "vision_config", None)
    from_model = getattr(vision_config, "spatial_merge_size", None)
    if from_processor is not None and from_model is not None and from_processor != from_model:
        raise ValueError(
            f"image_processor: expected merge_size equal to config.vision_config."
            f"spatial_merge_size ({from_model}), got {from_processor}"
        )
    merge = from_processor if from_processor is not None else from_model
    if merge is None:
        raise ValueError(
            "image_processor: expected a merge_size attribute (or config.vision_config."
            "spatial_merge_size), got neither"
        )
    return int(merge)


def _size_field(size: Any, key: str) -> int | None:
    """size[key] for a dict or transformers' SizeDict (None when absent)."""
    value = size.get(key) if isinstance(size, Mapping) else getattr(size, key, None)
    return None if value is None else int(value)


def _llava_cells(
    config: Any, image_processor: Any, sizes: list[tuple[int, int]], inputs: Mapping[str, Any]
) -> list[ImageCells]:
    _check_llava_tokens_are_patches(config)
    patch = int(config.vision_config.patch_size)
    if "pixel_values" not in inputs:
        raise ValueError(
            f"inputs: expected the processor's output holding pixel_values, got keys {sorted(inputs)}"
        )
    pixel_values = inputs["pixel_values"]
    if len(pixel_values) != len(sizes):
        raise ValueError(
            f"inputs['pixel_values']: expected one image per entry of images ({len(sizes)}), "
            f"got {len(pixel_values)}"
        )
    cells = []
    for index, ((width, height), pixels) in enumerate(zip(sizes, pixel_values, strict=True)):
        final_h, final_w = (int(n) for n in pixels.shape[-2:])
        rows, cols = final_h // patch, final_w // patch
        if rows < 1 or cols < 1:
            raise ValueError(
                f"inputs['pixel_values'][{index}]: expected at least one {patch} x {patch} patch, "
                f"got a {final_w} x {final_h} image"
            )
        x_map, y_map = _llava_inverse(image_processor, width, height, final_w, final_h, index)
        # Patch edges in the final image, mapped back to original pixels.
        x_edges = x_map(np.arange(cols + 1) * float(patch))
        y_edges = y_map(np.arange(rows + 1) * float(patch))
        boxes = _raster_boxes(rows, cols, x_edges, y_edges, width, height)
        cells.append(ImageCells(index, rows, cols, boxes, (width, height)))
    return cells


def _check_llava_tokens_are_patches(config: Any) -> None:
    """Refuse configurations whose visual tokens are not exactly the patch raster."""
    tower = getattr(config.vision_config, "model_type", None)
    if tower not in _TOWER_HAS_CLS:
        raise ValueError(
            f"config.vision_config: expected model_type in {', '.join(_TOWER_HAS_CLS)}, "
            f"got {tower!r}"
        )
    strategy = config.vision_feature_select_strategy
    if _TOWER_HAS_CLS[tower] and strategy != "default":
        raise ValueError(
            f"config.vision_feature_select_strategy: expected 'default' (the CLS token dropped) "
            f"for a CLIP tower, got {strategy!r}: the CLS token has no place in the image"
        )
    if not _TOWER_HAS_CLS[tower] and strategy != "full":
        raise ValueError(
            f"config.vision_feature_select_strategy: expected 'full' for a SigLIP tower (it has "
            f"no CLS token), got {strategy!r}, which drops the first image patch"
        )


def _llava_inverse(
    image_processor: Any, width: int, height: int, final_w: int, final_h: int, index: int
) -> tuple[Callable[[np.ndarray], np.ndarray], Callable[[np.ndarray], np.ndarray]]:
    """(x_map, y_map): functions taking final-image coordinates to original-image coordinates
    by undoing pad-to-square, resize and center crop (bottom/right padding moves nothing)."""
    pad_square = bool(getattr(image_processor, "do_pad", False)) and callable(
        getattr(image_processor, "pad_to_square", None)
    )
    # Step 1: LLaVA's pad_to_square centres the image on a max(W, H) square.
    side = max(width, height)
    pad_x, pad_y = ((side - width) // 2, (side - height) // 2) if pad_square else (0, 0)
    in_w, in_h = (side, side) if pad_square else (width, height)
    # Step 2: resize.
    out_w, out_h = in_w, in_h
    if getattr(image_processor, "do_resize", False):
        out_w, out_h = _resized_size(image_processor.size, in_w, in_h)
    # Step 3: center crop; the crop window starts at `start` in resized coordinates.
    start_x = start_y = 0
    content_w, content_h = out_w, out_h
    if getattr(image_processor, "do_center_crop", False):
        crop_w = _size_field(image_processor.crop_size, "width")
        crop_h = _size_field(image_processor.crop_size, "height")
        if crop_w is None or crop_h is None:
            raise ValueError(
                f"image_processor.crop_size: expected height and width, got {image_processor.crop_size}"
            )
        torchvision = getattr(image_processor, "backend", None) == "torchvision"
        start_x = _crop_start(out_w, crop_w, torchvision)
        start_y = _crop_start(out_h, crop_h, torchvision)
        content_w, content_h = crop_w, crop_h
    # Step 4: other processors' do_pad pads bottom/right only, so the final image may be larger.
    bottom_right_pad = bool(getattr(image_processor, "do_pad", False)) and not pad_square
    fits = (final_w, final_h) == (content_w, content_h) or (
        bottom_right_pad and final_w >= content_w and final_h >= content_h
    )
    if not fits:
        raise ValueError(
            f"inputs['pixel_values'][{index}]: expected a {content_w} x {content_h} image from "
            f"the image processor's settings for a {width} x {height} input, got "
            f"{final_w} x {final_h}"
        )
    scale_x, scale_y = in_w / out_w, in_h / out_h

    def x_map(x: np.ndarray) -> np.ndarray:
        return (x + start_x) * scale_x - pad_x

    def y_map(y: np.ndarray) -> np.ndarray:
        return (y + start_y) * scale_y - pad_y

    return x_map, y_map


def _resized_size(size: Any, width: int, height: int) -> tuple[int, int]:
    """(width, height) after the processor's resize, with transformers' rounding."""
    fixed_w, fixed_h = _size_field(size, "width"), _size_field(size, "height")
    shortest = _size_field(size, "shortest_edge")
    if fixed_w is not None and fixed_h is not None:
        return fixed_w, fixed_h
    if shortest is not None and _size_field(size, "longest_edge") is None:
        # The short side becomes `shortest`, the long side keeps the aspect ratio, truncated.
        if width <= height:
            return shortest, int(shortest * height / width)
        return int(shortest * width / height), shortest
    raise ValueError(
        f"image_processor.size: expected {{'shortest_edge'}} or {{'height', 'width'}}, got {size}"
    )


def _crop_start(length: int, crop: int, torchvision: bool) -> int:
    """Where a center crop of `crop` starts along a side of `length` (negative: the image is
    padded). The PIL backend floors (length - crop) / 2 either way; the torchvision backend
    first pads (crop - length) // 2 on the leading side when the crop is larger."""
    if torchvision and crop > length:
        return -((crop - length) // 2)
    return (length - crop) // 2
