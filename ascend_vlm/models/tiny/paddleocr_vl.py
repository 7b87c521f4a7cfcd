"""Tiny PaddleOCR-VL (Qwen-VL-like grids: [patches, 3, P, P] pixels, image_grid_thw)."""

from __future__ import annotations

import torch

from ascend_vlm.models.tiny.family import TinyFamily
from ascend_vlm.models.tiny.qwen import qwen_token_ids, qwen_token_inputs
from ascend_vlm.models.tiny.sizes import (
    TINY,
    ModelSize,
    generator,
    mrope_parameters,
    text_config,
    vit_config,
)


def _paddleocr_vl(size: ModelSize = TINY):
    from transformers import PaddleOCRVLConfig

    return PaddleOCRVLConfig(
        text_config={
            **text_config(size),
            "head_dim": size.head_dim,
            "rope_parameters": mrope_parameters(size),
        },
        vision_config={
            **vit_config(size),
            "image_size": size.image,
            "patch_size": size.patch,
            "spatial_merge_size": 2,
        },
        **qwen_token_ids(),
    )


def paddleocr_images(model, count: int) -> tuple[dict, list[int]]:
    """`count` square images of the vision config's size, as [patches, 3, P, P] rows with their
    grids."""
    vision = model.config.vision_config
    side = vision.image_size // vision.patch_size
    grid = torch.tensor([[1, side, side]] * count)
    pixels = torch.randn(
        count * side * side, 3, vision.patch_size, vision.patch_size, generator=generator(count)
    )
    return {"pixel_values": pixels, "image_grid_thw": grid}, [
        side * side // vision.spatial_merge_size**2
    ] * count


TINY_FAMILIES = (
    TinyFamily(
        "paddleocr_vl",
        "PaddleOCRVLForConditionalGeneration",
        _paddleocr_vl,
        paddleocr_images,
        token_inputs=qwen_token_inputs,
    ),
)
