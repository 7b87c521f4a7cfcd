"""Tiny DeepSeek-OCR 2 (SAM ViT + Qwen2-like query encoder, MoE decoder): 144 learned queries
and a view separator per image, whatever the image size."""

from __future__ import annotations

from ascend_vlm.models.tiny.family import TinyFamily, feature_counted_images
from ascend_vlm.models.tiny.sizes import IMAGE_TOKEN, TINY, ModelSize, text_config, widths


def _deepseek_ocr2(size: ModelSize = TINY):
    from transformers import DeepseekOcr2Config

    encoder_width = size.vision_hidden
    return DeepseekOcr2Config(
        text_config={
            **text_config(size),
            "mlp_layer_types": ["dense", *["sparse"] * (size.layers - 1)],
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "moe_intermediate_size": size.intermediate // 2,
        },
        vision_config={
            "sam_config": {
                **widths(size.vision_hidden, size.vision_intermediate, size.vision_layers, 2),
                "output_channels": size.vision_hidden,
                "image_size": 2 * size.image,
                "patch_size": size.patch,
                "window_size": 4,  # windowed first layer, global last
                "global_attn_indexes": [size.vision_layers - 1],
                "downsample_channels": [encoder_width, encoder_width],
            },
            "encoder_config": {
                **widths(
                    encoder_width, size.vision_intermediate, size.vision_layers, size.vision_heads
                ),
                "num_key_value_heads": size.vision_heads // 2,
            },
        },
        image_token_id=IMAGE_TOKEN,
    )


def _deepseek_ocr2_images(model, count: int) -> tuple[dict, list[int]]:
    side = model.config.vision_config.sam_config.image_size
    return feature_counted_images(model, count, side=side)


TINY_FAMILIES = (
    TinyFamily(
        "deepseek_ocr2",
        "DeepseekOcr2ForConditionalGeneration",
        _deepseek_ocr2,
        _deepseek_ocr2_images,
    ),
)
