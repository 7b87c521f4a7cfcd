"""Tiny InternVL (RMSNorm ViT, pixel-shuffle downsampling)."""

from __future__ import annotations

from ascend_vlm.models.tiny.family import TinyFamily, fixed_count_images
from ascend_vlm.models.tiny.sizes import IMAGE_TOKEN, TINY, ModelSize, text_config, vit_config


def _internvl(size: ModelSize = TINY):
    from transformers import InternVLConfig

    return InternVLConfig(
        text_config={**text_config(size), "model_type": "qwen2"},
        vision_config={
            **vit_config(size),
            "image_size": [size.image, size.image],
            "patch_size": [size.patch, size.patch],
            "norm_type": "rms_norm",
        },
        image_token_id=IMAGE_TOKEN,
        downsample_ratio=0.5,
    )


def _internvl_tokens(config) -> int:
    vision = config.vision_config
    side = vision.image_size[0] // vision.patch_size[0]
    return int(side * side * config.downsample_ratio**2)


TINY_FAMILIES = (
    TinyFamily(
        "internvl",
        "InternVLForConditionalGeneration",
        _internvl,
        fixed_count_images(_internvl_tokens),
    ),
)
