"""Tiny Llama 4: a dense and an MoE decoder layer, a chunked RoPE layer and a NoPE layer with
attention temperature tuning, L2 q/k norm, and a pixel-shuffled ViT with 2-D complex RoPE."""

from __future__ import annotations

from ascend_vlm.models.tiny.family import TinyFamily, fixed_count_images
from ascend_vlm.models.tiny.sizes import (
    IMAGE_TOKEN,
    TINY,
    VISION_END,
    VISION_START,
    ModelSize,
    text_config,
    vit_config,
)

# Small enough that the tiny prompts (BOS, image tokens, 6 text tokens) cross chunk boundaries.
LLAMA4_ATTENTION_CHUNK = 4
_PIXEL_SHUFFLE_RATIO = 0.5


def _llama4_text(size: ModelSize) -> dict:
    """Layer i uses RoPE (and chunked attention) when i is even and is an MoE layer when i is
    odd: at two layers, a dense chunked RoPE layer and an MoE NoPE layer."""
    return {
        **text_config(size),
        "head_dim": size.head_dim,
        "intermediate_size_mlp": size.intermediate,
        "num_local_experts": 4,
        "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 2,
        "no_rope_layers": [int(i % 2 == 0) for i in range(size.layers)],
        "attention_chunk_size": LLAMA4_ATTENTION_CHUNK if size is TINY else 128,
        "use_qk_norm": True,
        "attn_temperature_tuning": True,
        # The NoPE layers' query scale steps every 2 tokens, so short prompts exercise it.
        "floor_scale": 2,
        "attn_scale": 0.5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
    }


def _llama4(size: ModelSize = TINY):
    from transformers import Llama4Config

    # The pixel-shuffle adapter reads intermediate_size as its input width: hidden / ratio^2.
    shuffled = int(size.vision_hidden / _PIXEL_SHUFFLE_RATIO**2)
    return Llama4Config(
        text_config=_llama4_text(size),
        vision_config={
            **vit_config(size),
            "intermediate_size": shuffled,
            "image_size": size.image,
            "patch_size": size.patch,
            "pixel_shuffle_ratio": _PIXEL_SHUFFLE_RATIO,
            "projector_input_dim": size.hidden,
            "projector_output_dim": size.hidden,
            "vision_output_dim": size.hidden,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
        },
        image_token_index=IMAGE_TOKEN,
        boi_token_index=VISION_START,
        eoi_token_index=VISION_END,
    )


def _llama4_tokens(config) -> int:
    vision = config.vision_config
    patches = (vision.image_size // vision.patch_size) ** 2
    return int(patches * vision.pixel_shuffle_ratio**2)


TINY_FAMILIES = (
    TinyFamily(
        "llama4",
        "Llama4ForConditionalGeneration",
        _llama4,
        fixed_count_images(_llama4_tokens),
    ),
)
