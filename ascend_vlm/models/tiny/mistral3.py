"""Tiny Mistral 3 (Pixtral vision tower, image_sizes per image, 2x2 patch merger)."""

from __future__ import annotations

import torch

from ascend_vlm.models.tiny.family import TinyFamily, feature_counted_images
from ascend_vlm.models.tiny.sizes import IMAGE_TOKEN, TINY, ModelSize, text_config, vit_config


def _mistral3(size: ModelSize = TINY):
    from transformers import Mistral3Config

    return Mistral3Config(
        text_config={
            **text_config(size),
            "model_type": "mistral",
            "head_dim": size.head_dim,
            "sliding_window": None,  # as Mistral Small 3.1's decoder: full attention only
        },
        vision_config={
            **vit_config(size),
            "model_type": "pixtral",
            "image_size": size.image,
            "patch_size": size.patch,
            "hidden_act": "silu",  # Mistral Small 3.1's tower: gated SiLU, so ops.swiglu applies
        },
        image_token_id=IMAGE_TOKEN,
        spatial_merge_size=2,
    )


def _image_sizes(config):
    def sizes(count: int) -> dict:
        side = config.vision_config.image_size
        return {"image_sizes": torch.tensor([[side, side]] * count)}

    return sizes


def _mistral3_images(model, count: int) -> tuple[dict, list[int]]:
    return feature_counted_images(model, count, _image_sizes(model.config))


TINY_FAMILIES = (
    TinyFamily("mistral3", "Mistral3ForConditionalGeneration", _mistral3, _mistral3_images),
)
