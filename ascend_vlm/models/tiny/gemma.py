"""Tiny PaliGemma and Gemma 3 (token type ids mark the image tokens)."""

from __future__ import annotations

import torch

from ascend_vlm.models.tiny.family import TinyFamily, fixed_count_images
from ascend_vlm.models.tiny.sizes import (
    IMAGE_TOKEN,
    TINY,
    VISION_END,
    VISION_START,
    ModelSize,
    siglip_config,
    text_config,
)


def image_token_types(input_ids: torch.Tensor, n_images: int) -> dict:
    """Gemma-style token type ids: 1 on image tokens (bidirectional attention among them)."""
    return {"token_type_ids": (input_ids == IMAGE_TOKEN).long()}


def _paligemma(size: ModelSize = TINY):
    from transformers import PaliGemmaConfig

    return PaliGemmaConfig(
        text_config={**text_config(size), "model_type": "gemma", "head_dim": size.head_dim},
        vision_config=siglip_config(size),
        image_token_id=IMAGE_TOKEN,
        projection_dim=size.hidden,
    )


def _gemma3(size: ModelSize = TINY):
    from transformers import Gemma3Config

    sliding = ["sliding_attention"] * (size.layers - 1)
    return Gemma3Config(
        text_config={
            **text_config(size),
            "model_type": "gemma3_text",
            "head_dim": size.head_dim,
            "sliding_window": 8 if size is TINY else 128,
            "layer_types": [*sliding, "full_attention"],
        },
        vision_config=siglip_config(size),
        image_token_id=IMAGE_TOKEN,
        boi_token_index=VISION_START,
        eoi_token_index=VISION_END,
        mm_tokens_per_image=(size.patches_per_side // 2) ** 2,
    )


TINY_FAMILIES = (
    TinyFamily(
        "paligemma",
        "PaliGemmaForConditionalGeneration",
        _paligemma,
        fixed_count_images(lambda c: c.text_config.num_image_tokens),
        token_inputs=image_token_types,
    ),
    TinyFamily(
        "gemma3",
        "Gemma3ForConditionalGeneration",
        _gemma3,
        fixed_count_images(lambda c: c.mm_tokens_per_image),
        token_inputs=image_token_types,
    ),
)
