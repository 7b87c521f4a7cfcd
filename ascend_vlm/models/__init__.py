"""One small module per model family, chosen by `config.model_type`.

Each family module exports `MODEL_TYPES` and `spec(config) -> ModelSpec`: a short list of
"this module class -> that op" (see `ascend_vlm.models.family_spec`). `ascend_vlm.patching`
applies it, importing the vocabulary and the backbone tables from here.
"""

from __future__ import annotations

from types import ModuleType

from ascend_vlm.models import idefics3, llava, qwen2_5_vl, qwen2_vl, qwen3_vl
from ascend_vlm.models._backbones import TEXT_BACKBONES, VISION_BACKBONES
from ascend_vlm.models.family_spec import KINDS, ModelSpec, PartSpec, Rope

__all__ = [
    "FAMILIES",
    "KINDS",
    "REGISTRY",
    "TEXT_BACKBONES",
    "VISION_BACKBONES",
    "ModelSpec",
    "PartSpec",
    "Rope",
    "spec_for",
    "supported_model_types",
]

FAMILIES: tuple[ModuleType, ...] = (qwen2_vl, qwen2_5_vl, qwen3_vl, llava, idefics3)

REGISTRY: dict[str, ModuleType] = {
    model_type: family for family in FAMILIES for model_type in family.MODEL_TYPES
}


def supported_model_types() -> list[str]:
    """The `config.model_type` values `ascend_vlm.patch` recognises, sorted."""
    return sorted(REGISTRY)


def spec_for(config) -> ModelSpec | None:
    """The family spec for `config`, or None when its model_type is not supported."""
    family = REGISTRY.get(config.model_type)
    return None if family is None else family.spec(config)
