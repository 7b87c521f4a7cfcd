"""`TinyFamily` (how to build one family's tiny model and feed it images) and the image makers
families share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ascend_vlm.models.tiny.sizes import TINY, ModelSize, generator

ImageMaker = Callable[[torch.nn.Module, int], tuple[dict, list[int]]]


@dataclass(frozen=True)
class TinyFamily:
    """A tiny model of one family: how to build it and how to feed it images.

    config(size) -> the model config at that `ModelSize` (tiny by default). images(model, n) ->
    (model kwargs for n images, image tokens per image), one image per [3, H, W] entry; the
    kwargs are batch-agnostic pixel tensors, so `make_inputs` can lay the image tokens out in
    any batch. token_inputs(input_ids, n_images) -> further kwargs the family's forward needs
    that follow from the token ids (token type ids), or None.
    """

    name: str
    model_class: str
    config: Callable[..., object]
    images: ImageMaker
    image_batch_axis: bool = False  # pixel_values grouped per sample: [B, n_images, 3, H, W]
    token_inputs: Callable[[torch.Tensor, int], dict] | None = None


def feature_counted_images(
    model, count: int, extra: Callable[[int], dict] | None = None, *, side: int | None = None
):
    """Images for models whose tokens-per-image is whatever `get_image_features` returns:
    `side` pixels square (default: the vision config's image_size)."""
    side = model.config.vision_config.image_size if side is None else side
    pixels = torch.randn(count, 3, side, side, generator=generator(count))
    kwargs = {"pixel_values": pixels, **(extra(count) if extra else {})}
    with torch.no_grad():
        features = model.model.get_image_features(**kwargs)
    features = getattr(features, "pooler_output", features)
    return kwargs, [f.reshape(-1, f.shape[-1]).shape[0] for f in features]


def anyres_pinpoints(size: ModelSize) -> list[list[int]]:
    """The one grid pinpoint of anyres families: tiny a 2x2 grid of tiles (5 crops); small one
    tile (2 crops of 224x224) to bound compute."""
    tiles_per_side = 2 if size is TINY else 1
    return [[tiles_per_side * size.image, tiles_per_side * size.image]]


def anyres_images(model, count: int) -> tuple[dict, list[int]]:
    """One image at the first grid pinpoint: the base view plus one crop per tile."""
    size = model.config.vision_config.image_size
    height, width = model.config.image_grid_pinpoints[0]
    crops = 1 + (height // size) * (width // size)
    pixels = torch.randn(count, crops, 3, size, size, generator=generator(count))
    kwargs = {"pixel_values": pixels, "image_sizes": torch.tensor([[height, width]] * count)}
    with torch.no_grad():
        features = model.model.get_image_features(**kwargs)
    features = getattr(features, "pooler_output", features)
    return kwargs, [f.shape[0] for f in features]


def fixed_count_images(tokens: Callable[[object], int]) -> ImageMaker:
    """Square images at the vision config's size, each `tokens(config)` image tokens long."""

    def images(model, count: int) -> tuple[dict, list[int]]:
        size = model.config.vision_config.image_size
        size = size[0] if isinstance(size, (list, tuple)) else size
        pixels = torch.randn(count, 3, size, size, generator=generator(count))
        return {"pixel_values": pixels}, [tokens(model.config)] * count

    return images
