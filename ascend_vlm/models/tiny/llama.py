"""Tiny Llama 4 (a dense and an MoE decoder layer, a chunked RoPE layer and a NoPE layer with
attention temperature tuning, L2 q/k norm, a pixel-shuffled ViT with 2-D complex RoPE) and
Llama 3.2 Vision (mllama: a self-attention and a cross-attention decoder layer, a tiled ViT)."""

from __future__ import annotations

import torch

from ascend_vlm.models.tiny.family import TinyFamily, fixed_count_images
from ascend_vlm.models.tiny.sizes import (
    IMAGE_TOKEN,
    TINY,
    VISION_END,
    VISION_START,
    ModelSize,
    generator,
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


_MLLAMA_TILES = 2  # every tiny image is cut into two tiles side by side (aspect ratio [1, 2])
_MLLAMA_ASPECT_RATIOS = [[1, 1], [1, 2], [2, 1]]


def _mllama(size: ModelSize = TINY):
    from transformers import MllamaConfig

    vision = vit_config(size)
    return MllamaConfig(
        text_config={
            **text_config(size),
            # the last decoder layer cross-attends to the image tiles
            "cross_attention_layers": [size.layers - 1],
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
        },
        vision_config={
            "hidden_size": vision["hidden_size"],
            "intermediate_size": vision["intermediate_size"],
            "num_hidden_layers": vision["num_hidden_layers"],
            "num_global_layers": 1,
            "attention_heads": vision["num_attention_heads"],
            "image_size": size.image,
            "patch_size": size.patch,
            "max_num_tiles": _MLLAMA_TILES,
            "intermediate_layers_indices": [0],
            "vision_output_dim": 2 * vision["hidden_size"],
            "supported_aspect_ratios": _MLLAMA_ASPECT_RATIOS,
        },
        image_token_index=IMAGE_TOKEN,
    )


def _mllama_images(model, count: int) -> tuple[dict, list[int]]:
    """``count`` images of two tiles each, one image token per image (the decoder reads the
    tiles through cross-attention, not as tokens)."""
    vision = model.config.vision_config
    shape = (count, _MLLAMA_TILES, 3, vision.image_size, vision.image_size)
    pixels = torch.randn(*shape, generator=generator(count))
    ratio_id = _MLLAMA_ASPECT_RATIOS.index([1, _MLLAMA_TILES]) + 1
    return {
        "pixel_values": pixels,
        "aspect_ratio_ids": torch.full((1, count), ratio_id),
        "aspect_ratio_mask": torch.ones(1, count, _MLLAMA_TILES, dtype=torch.long),
    }, [1] * count


def _mllama_cross_attention_mask(input_ids: torch.Tensor, n_images: int) -> dict:
    """As Mllama's processor: each text token attends to every tile of the images whose token
    precedes it."""
    if not n_images:
        return {}
    is_image = (input_ids == IMAGE_TOKEN).long()
    seen = is_image.cumsum(dim=1)  # [B, S]: images up to each token
    images = torch.arange(1, n_images + 1)
    mask = (seen[:, :, None] >= images).long()  # [B, S, n_images]
    return {"cross_attention_mask": mask[..., None].expand(-1, -1, -1, _MLLAMA_TILES)}


TINY_FAMILIES = (
    TinyFamily(
        "llama4",
        "Llama4ForConditionalGeneration",
        _llama4,
        fixed_count_images(_llama4_tokens),
    ),
    TinyFamily(
        "mllama",
        "MllamaForConditionalGeneration",
        _mllama,
        _mllama_images,
        image_batch_axis=True,
        token_inputs=_mllama_cross_attention_mask,
    ),
)
