"""LLaVA, LLaVA-NeXT, LLaVA-OneVision, InternVL, Gemma 3, PaliGemma: a known vision
tower (CLIP, SigLIP, InternViT) + a projector + a known decoder, each taken from the
sub-config's own model_type."""

from __future__ import annotations

from ascend_vlm.models._backbones import text_backbone, vision_backbone
from ascend_vlm.models.family_spec import ModelSpec

MODEL_TYPES = (
    "llava",
    "llava_next",
    "llava_onevision",
    "internvl",
    "gemma3",
    "paligemma",
)


def spec(config) -> ModelSpec:
    return ModelSpec(
        text=text_backbone(config.text_config),
        vision=vision_backbone(config.vision_config),
        vision_towers=("model.vision_tower", "vision_tower"),
    )
