"""Tiny LLaVA (CLIP and SigLIP towers), LLaVA-NeXT and LLaVA-OneVision."""

from __future__ import annotations

from ascend_vlm.models.tiny.family import (
    TinyFamily,
    anyres_images,
    anyres_pinpoints,
    feature_counted_images,
)
from ascend_vlm.models.tiny.sizes import (
    IMAGE_TOKEN,
    TINY,
    VIDEO_TOKEN,
    ModelSize,
    clip_config,
    siglip_config,
    text_config,
)


def _llava(size: ModelSize = TINY):
    from transformers import LlavaConfig

    return LlavaConfig(
        text_config={**text_config(size), "model_type": "llama"},
        vision_config=clip_config(size),
        image_token_id=IMAGE_TOKEN,
        projector_hidden_act="gelu",
    )


def _llava_siglip(size: ModelSize = TINY):
    from transformers import LlavaConfig

    return LlavaConfig(
        text_config={**text_config(size), "model_type": "qwen2"},
        vision_config=siglip_config(size),
        image_token_id=IMAGE_TOKEN,
        vision_feature_select_strategy="full",
    )


def _llava_next(size: ModelSize = TINY):
    from transformers import LlavaNextConfig

    return LlavaNextConfig(
        text_config={**text_config(size), "model_type": "mistral"},
        vision_config=clip_config(size),
        image_token_id=IMAGE_TOKEN,
        image_grid_pinpoints=anyres_pinpoints(size),
    )


def _llava_onevision(size: ModelSize = TINY):
    from transformers import LlavaOnevisionConfig

    return LlavaOnevisionConfig(
        text_config={**text_config(size), "model_type": "qwen2"},
        vision_config=siglip_config(size),
        image_token_id=IMAGE_TOKEN,
        video_token_id=VIDEO_TOKEN,
        image_grid_pinpoints=anyres_pinpoints(size),
        vision_feature_layer=-1,
    )


TINY_FAMILIES = (
    TinyFamily("llava_clip", "LlavaForConditionalGeneration", _llava, feature_counted_images),
    TinyFamily(
        "llava_siglip", "LlavaForConditionalGeneration", _llava_siglip, feature_counted_images
    ),
    TinyFamily("llava_next", "LlavaNextForConditionalGeneration", _llava_next, anyres_images),
    TinyFamily(
        "llava_onevision", "LlavaOnevisionForConditionalGeneration", _llava_onevision, anyres_images
    ),
)
