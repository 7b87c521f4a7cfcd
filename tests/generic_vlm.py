"""A tiny VLM of a type no family describes, for the tests of the generic path (`patch(model,
strict=False)`) and of what runs on it."""

from __future__ import annotations

import torch
import transformers

from ascend_vlm.models.tiny import TINY_TEXT_CONFIG
from ascend_vlm.models.tiny.sizes import IMAGE_TOKEN, TEXT_VOCAB


def aya_vision() -> transformers.AyaVisionForConditionalGeneration:
    """A tiny AyaVision (SigLIP tower, Cohere2 decoder): a VLM type no family describes."""
    torch.manual_seed(0)
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    config = transformers.AyaVisionConfig(
        vision_config={
            "model_type": "siglip_vision_model",
            **vision,
            "num_attention_heads": 4,
            "image_size": 16,
            "patch_size": 4,
        },
        text_config={
            "model_type": "cohere2",
            **TINY_TEXT_CONFIG,
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 4,
        },
        image_token_index=IMAGE_TOKEN,
        downsample_factor=2,
        attn_implementation="eager",
    )
    return transformers.AyaVisionForConditionalGeneration(config).eval()


def aya_inputs() -> dict:
    """One row: text, the 4 image tokens a 16x16 image makes, text."""
    generator = torch.Generator().manual_seed(0)
    text = torch.randint(3, TEXT_VOCAB, (1, 10), generator=generator)
    input_ids = torch.cat((text[:, :3], torch.full((1, 4), IMAGE_TOKEN), text[:, 3:]), dim=1)
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "pixel_values": torch.randn(1, 3, 16, 16, generator=generator),
    }
