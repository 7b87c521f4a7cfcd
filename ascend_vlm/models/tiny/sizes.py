"""Model sizes, special token ids and the sub-config pieces every tiny family shares.

The "tiny" size is the smallest that still exercises every code path: 2 decoder layers of width
32 with GQA, a 2-layer vision tower, 4-16 image tokens per image. The "small" size (benchmarks
only) makes compute matter: 4 decoder layers of width 512, a 2-layer vision tower of width 512
and one 224x224 image (16x16-pixel patches) per image.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

VOCAB = 128
IMAGE_TOKEN = 120  # the special ids sit above the ids used for random text (< TEXT_VOCAB)
VISION_START, VISION_END, VIDEO_TOKEN, BOS, PAD = 121, 122, 123, 1, 0
TEXT_VOCAB = 100


@dataclass(frozen=True)
class ModelSize:
    """Widths and depths of one model size; `image` and `patch` are edge lengths in pixels."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vision_hidden: int
    vision_intermediate: int
    vision_layers: int
    vision_heads: int
    image: int
    patch: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def patches_per_side(self) -> int:
        return self.image // self.patch


SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize(32, 64, 2, 4, 2, 32, 64, 2, 4, 16, 4),
    "small": ModelSize(512, 1408, 4, 8, 2, 512, 2048, 2, 8, 224, 16),
}
TINY = SIZES["tiny"]


def generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with `seed` (inputs are reproducible per call site)."""
    return torch.Generator().manual_seed(seed)


def widths(hidden: int, intermediate: int, layers: int, heads: int) -> dict:
    """The four size keys text and vision configs share."""
    return {
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
    }


def text_config(size: ModelSize) -> dict:
    """A decoder sub-config at `size` with the tiny vocabulary and special ids."""
    return {
        **widths(size.hidden, size.intermediate, size.layers, size.heads),
        "num_key_value_heads": size.kv_heads,
        "vocab_size": VOCAB,
        "max_position_embeddings": 512,
        "pad_token_id": PAD,
        "bos_token_id": BOS,
        "eos_token_id": 2,
    }


TINY_TEXT_CONFIG = text_config(TINY)


def vit_config(size: ModelSize) -> dict:
    """The widths of a ViT sub-config at `size`."""
    return widths(
        size.vision_hidden, size.vision_intermediate, size.vision_layers, size.vision_heads
    )


def clip_config(size: ModelSize) -> dict:
    return {
        "model_type": "clip_vision_model",
        **vit_config(size),
        "image_size": size.image,
        "patch_size": size.patch,
        "projection_dim": size.hidden,
    }


def siglip_config(size: ModelSize) -> dict:
    return {**clip_config(size), "model_type": "siglip_vision_model"}


def mrope_parameters(size: ModelSize, **extra) -> dict:
    """Multimodal RoPE over the head dim: half of the rotary pairs temporal, a quarter each
    height and width (tiny: [2, 1, 1])."""
    quarter = size.head_dim // 8
    return {
        "rope_type": "default",
        "rope_theta": 1e4,
        "mrope_section": [2 * quarter, quarter, quarter],
        **extra,
    }
