"""Idefics3 and SmolVLM: a SigLIP-style LayerNorm ViT + pixel-shuffle connector + a known decoder."""

from __future__ import annotations

from ascend_vlm.models._backbones import text_backbone, vision_backbone
from ascend_vlm.models.family_spec import ModelSpec

MODEL_TYPES = ("idefics3", "smolvlm")


def spec(config) -> ModelSpec:
    return ModelSpec(
        text=text_backbone(config.text_config),
        vision=vision_backbone(config.vision_config),
        vision_towers=("model.vision_model", "vision_model"),
    )
