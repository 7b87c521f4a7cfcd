"""Tiny PaliGemma, Gemma 3 and Gemma 4 (token type ids mark the image tokens)."""

from __future__ import annotations

import torch

from ascend_vlm.models.tiny.family import TinyFamily, fixed_count_images
from ascend_vlm.models.tiny.sizes import (
    IMAGE_TOKEN,
    TINY,
    VIDEO_TOKEN,
    VISION_END,
    VISION_START,
    VOCAB,
    ModelSize,
    generator,
    siglip_config,
    text_config,
    vit_config,
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


def multimodal_token_types(input_ids: torch.Tensor, n_images: int) -> dict:
    """Gemma 4's token type ids: 1 on image tokens (they attend to each other in sliding
    layers)."""
    return {"mm_token_type_ids": (input_ids == IMAGE_TOKEN).long()}


def _gemma4(size: ModelSize = TINY):
    """Twice the size's layers, sliding and full alternating, the second half reusing the first
    half's keys and values; full layers with twice the head dim, one key/value head whose values
    are its keys and proportional RoPE on a quarter of the head dim; per-layer inputs."""
    from transformers import Gemma4Config

    return Gemma4Config(
        text_config={
            **text_config(size),
            "model_type": "gemma4_text",
            "num_hidden_layers": 2 * size.layers,
            "layer_types": ["sliding_attention", "full_attention"] * size.layers,
            "num_kv_shared_layers": size.layers,
            "head_dim": size.head_dim,
            "global_head_dim": 2 * size.head_dim,
            "attention_k_eq_v": True,
            "num_global_key_value_heads": 1,
            "sliding_window": 8 if size is TINY else 128,
            "hidden_size_per_layer_input": size.head_dim,
            "vocab_size_per_layer_input": VOCAB,
            "use_bidirectional_attention": "vision",
            "final_logit_softcapping": 30.0,
        },
        vision_config={
            **vit_config(size),
            "model_type": "gemma4_vision",
            "num_key_value_heads": size.vision_heads,
            "head_dim": size.vision_hidden // size.vision_heads,
            "patch_size": size.patch,
            "pooling_kernel_size": 2,
            "position_embedding_size": size.patches_per_side,
        },
        image_token_id=IMAGE_TOKEN,
        video_token_id=VIDEO_TOKEN,
        boi_token_id=VISION_START,
        eoi_token_id=VISION_END,
    )


def patchified_images(model, count: int) -> tuple[dict, list[int]]:
    """Gemma 4's processor output for square images of the size's edge: each image as its rows
    of flattened patches ``[count, P, 3 * patch^2]`` with their (x, y) grid positions, pooled
    by ``pooling_kernel_size`` squared into image tokens."""
    vision = model.config.vision_config
    side = vision.position_embedding_size
    pixels = torch.rand(count, side * side, 3 * vision.patch_size**2, generator=generator(count))
    y, x = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    positions = torch.stack((x.flatten(), y.flatten()), dim=-1).expand(count, -1, -1)
    tokens = side * side // vision.pooling_kernel_size**2
    return {"pixel_values": pixels, "image_position_ids": positions.clone()}, [tokens] * count


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
    TinyFamily(
        "gemma4",
        "Gemma4ForConditionalGeneration",
        _gemma4,
        patchified_images,
        token_inputs=multimodal_token_types,
    ),
)
