"""Tiny Idefics3 and SmolVLM (pixels grouped per sample)."""

from __future__ import annotations

from ascend_vlm.models.tiny.family import TinyFamily, fixed_count_images
from ascend_vlm.models.tiny.sizes import IMAGE_TOKEN, TINY, ModelSize, text_config, vit_config


def _idefics3_config(model_type: str):
    def build(size: ModelSize = TINY):
        from transformers import AutoConfig

        return AutoConfig.for_model(
            model_type,
            text_config={**text_config(size), "model_type": "llama"},
            vision_config={**vit_config(size), "image_size": size.image, "patch_size": size.patch},
            image_token_id=IMAGE_TOKEN,
            scale_factor=2,
        )

    return build


def _idefics3_tokens(config) -> int:
    vision = config.vision_config
    return (vision.image_size // vision.patch_size) ** 2 // config.scale_factor**2


def _idefics3_family(name: str, model_class: str) -> TinyFamily:
    images = fixed_count_images(_idefics3_tokens)
    return TinyFamily(name, model_class, _idefics3_config(name), images, image_batch_axis=True)


TINY_FAMILIES = (
    _idefics3_family("idefics3", "Idefics3ForConditionalGeneration"),
    _idefics3_family("smolvlm", "SmolVLMForConditionalGeneration"),
)
