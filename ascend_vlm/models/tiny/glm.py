"""Tiny GLM-4.1V (``glm4v``, dense), GLM-4.6V (``glm46v``) and GLM-4.5V (``glm4v_moe``, MoE):
Qwen-VL style inputs (patch rows with their grids, multimodal token types) on GLM's own parts."""

from __future__ import annotations

from ascend_vlm.models.tiny.family import TinyFamily
from ascend_vlm.models.tiny.qwen import (
    qwen_images,
    qwen_token_ids,
    qwen_token_inputs,
    qwen_vision_config,
)
from ascend_vlm.models.tiny.sizes import TINY, ModelSize, text_config

# GLM's ids of the start and end of a video (the other special ids are Qwen-VL's).
_VIDEO_START, _VIDEO_END = 124, 125


def _text_config(size: ModelSize, **family) -> dict:
    """A GLM decoder at `size` with half as many heads (twice the head dim, so the partial
    rotary half of it still holds four frequencies at tiny size): M-RoPE over the rotary
    pairs, half of them temporal, a quarter each height and width."""
    heads = size.heads // 2
    pairs = size.hidden // heads // 4  # partial_rotary_factor 0.5 of head_dim, two dims a pair
    return {
        **text_config(size),
        "num_attention_heads": heads,
        "num_key_value_heads": heads // 2,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1e4,
            "partial_rotary_factor": 0.5,
            "mrope_section": [pairs // 2, pairs // 4, pairs // 4],
        },
        **family,
    }


def _vision_config(size: ModelSize) -> dict:
    """GLM's ViT: learned position embeddings for one image of `size.image` pixels, a 2x2
    downsampling convolution to the text width, a merger of width `vision_intermediate`."""
    return qwen_vision_config(
        size,
        image_size=size.image,
        out_hidden_size=size.hidden,
        intermediate_size=size.vision_intermediate,
    )


def _token_ids() -> dict:
    return {
        **qwen_token_ids(),
        "image_start_token_id": qwen_token_ids()["vision_start_token_id"],
        "image_end_token_id": qwen_token_ids()["vision_end_token_id"],
        "video_start_token_id": _VIDEO_START,
        "video_end_token_id": _VIDEO_END,
    }


def _glm4v(size: ModelSize = TINY):
    from transformers import Glm4vConfig

    return Glm4vConfig(
        text_config=_text_config(size), vision_config=_vision_config(size), **_token_ids()
    )


def _glm46v(size: ModelSize = TINY):
    from transformers import Glm46VConfig

    return Glm46VConfig(
        text_config={**_text_config(size), "model_type": "glm4v_text"},
        vision_config={**_vision_config(size), "model_type": "glm4v_vision"},
        **_token_ids(),
    )


def _glm4v_moe(size: ModelSize = TINY):
    from transformers import Glm4vMoeConfig

    moe = {
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": size.intermediate // 2,
        "first_k_dense_replace": 1,  # layer 0 dense, the others sparse
    }
    return Glm4vMoeConfig(
        text_config=_text_config(size, **moe), vision_config=_vision_config(size), **_token_ids()
    )


TINY_FAMILIES = tuple(
    TinyFamily(name, model_class, config, qwen_images, token_inputs=qwen_token_inputs)
    for name, model_class, config in (
        ("glm4v", "Glm4vForConditionalGeneration", _glm4v),
        ("glm46v", "Glm46VForConditionalGeneration", _glm46v),
        ("glm4v_moe", "Glm4vMoeForConditionalGeneration", _glm4v_moe),
    )
)
