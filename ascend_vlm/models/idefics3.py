"""Idefics3 and SmolVLM: a SigLIP-style LayerNorm ViT + pixel-shuffle connector + a known decoder."""

from __future__ import annotations

from ascend_vlm.models._backbones import composite_spec
from ascend_vlm.models.descriptor import (
    SUPPORTED,
    Encoder,
    FamilyDescriptor,
    FeatureSupport,
    Layout,
    Refused,
)
from ascend_vlm.models.family_spec import ModelSpec

LAYOUT = Layout(vision_tower="vision_model", projector="connector", language_model="text_model")


def spec(config) -> ModelSpec:
    return composite_spec(config, LAYOUT)


_TILED = "its processor splits each image into a varying number of tiles plus a global view"
_DESCRIPTOR = FamilyDescriptor(
    patch=spec,
    layout=LAYOUT,
    visual_token_ids=("image_token_id",),
    position_scheme="rope",
    encoders=(Encoder("get_image_features"),),
    features=FeatureSupport(
        token_pruning=SUPPORTED,
        kv_compression=SUPPORTED,
        vision_cache=Refused(
            f"{_TILED}, batched as [batch, tiles, ...] pixels with a pixel_attention_mask, "
            f"which the cache does not split per image"
        ),
        chat_sessions=Refused(
            "its processor returns pixel_attention_mask, which ChatSession cannot split per image"
        ),
        batching=SUPPORTED,
        quantization=SUPPORTED,
        adapters=SUPPORTED,
        tracing=SUPPORTED,
        attention_overlay=Refused(
            f"{_TILED} and its connector pixel-shuffles the patches, a geometry the overlay "
            f"does not invert"
        ),
        vision_input=Refused(f"{_TILED}, which neither fast preprocessor reproduces"),
    ),
)
DESCRIPTORS = {"idefics3": _DESCRIPTOR, "smolvlm": _DESCRIPTOR}
