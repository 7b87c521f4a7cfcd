"""Shared by the benchmark scripts: a Qwen2-VL-shaped model with the embedded default model's
tokenizer and chat template at a CPU-friendly size where the vision tower is a realistic share
of prefill (a 4-layer vision tower of width 256, a ``layers``-deep language model of width 256 unless told otherwise),
random weights saved and loaded with ``from_pretrained``; its processor at a fixed image size;
random images."""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image

from ascend_vlm.default_model import default_model_path, load_processor, token_ids


def width_problem(width: int) -> str | None:
    """Why ``width`` cannot be the benchmark model's language width (its heads are 64 wide),
    or None."""
    if width < 64 or width % 64:
        return f"expected a multiple of 64 (64-wide heads), got {width}"
    return None


def load_bench_model(folder: Path, layers: int = 8, width: int = 256):
    """The benchmark model, saved to ``folder`` and loaded back as users do; ``width`` (see
    :func:`width_problem`) is the language model's hidden size: ``width / 64`` heads sharing
    key-value heads in pairs (each its own when their count is odd), an MLP 2.75x wider, as
    Qwen2-VL's."""
    if (problem := width_problem(width)) is not None:
        raise ValueError(f"width: {problem}")
    heads = width // 64
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    reference = Qwen2VLConfig.from_pretrained(default_model_path())
    text = reference.text_config.to_dict()
    text.pop("layer_types", None)
    text.update(
        hidden_size=width,
        intermediate_size=width * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2 if heads % 2 == 0 else heads,
        max_position_embeddings=8192,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [8, 12, 12],
        },
    )
    vision = reference.vision_config.to_dict()
    vision.update(depth=4, embed_dim=256, hidden_size=width, num_heads=4, mlp_ratio=4)
    config = Qwen2VLConfig(text_config=text, vision_config=vision, **token_ids(reference))
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(config).save_pretrained(folder)
    model = Qwen2VLForConditionalGeneration.from_pretrained(folder, attn_implementation="sdpa")
    return model.eval()


def bench_processor(image_side: int):
    """The default model's processor, its images kept at ``image_side`` x ``image_side``."""
    processor = load_processor(default_model_path())
    pixels = image_side * image_side
    processor.image_processor.size = {"shortest_edge": pixels, "longest_edge": pixels}
    return processor


def random_images(count: int, side: int, seed: int) -> list[Image.Image]:
    """``count`` images of random pixels, ``side`` x ``side``."""
    generator = torch.Generator().manual_seed(seed)
    return [
        Image.fromarray(
            torch.randint(0, 256, (side, side, 3), generator=generator, dtype=torch.uint8).numpy()
        )
        for _ in range(count)
    ]
