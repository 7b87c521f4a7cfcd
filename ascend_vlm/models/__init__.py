"""One small module per model family, chosen by `config.model_type`.

Each family module exports `spec(config) -> ModelSpec` (a short list of "this module class ->
that op", see `ascend_vlm.models.family_spec`) and `DESCRIPTORS`: one
:class:`~ascend_vlm.models.descriptor.FamilyDescriptor` per model_type it covers, declaring
what every feature needs (where the parts are, visual token ids, position scheme, deepstack
layers, which features run and why the others do not). `ascend_vlm.patching` applies the
specs; every feature asks :func:`require_feature` instead of keeping a family list.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from ascend_vlm.models import (
    deepseek_ocr2,
    gemma4,
    glm4v,
    idefics3,
    llama4,
    llava,
    mistral3,
    mllama,
    paddleocr_vl,
    qwen2_5_vl,
    qwen2_vl,
    qwen3_5,
    qwen3_5_moe,
    qwen3_vl,
    qwen3_vl_moe,
)
from ascend_vlm.models._backbones import TEXT_BACKBONES, VISION_BACKBONES
from ascend_vlm.models.descriptor import (
    FEATURE_LABELS,
    FEATURES,
    FamilyDescriptor,
    Refused,
)
from ascend_vlm.models.family_spec import KINDS, ModelSpec, PartSpec, Rope

__all__ = [
    "FAMILIES",
    "FEATURES",
    "KINDS",
    "REGISTRY",
    "TEXT_BACKBONES",
    "VISION_BACKBONES",
    "FamilyDescriptor",
    "ModelSpec",
    "PartSpec",
    "Rope",
    "descriptor_for",
    "model_types_supporting",
    "require_feature",
    "spec_for",
    "supported_model_types",
]

FAMILIES: tuple[ModuleType, ...] = (
    qwen2_vl,
    qwen2_5_vl,
    qwen3_vl,
    qwen3_vl_moe,
    llava,
    idefics3,
    gemma4,
    glm4v,
    qwen3_5,
    qwen3_5_moe,
    llama4,
    mllama,
    mistral3,
    paddleocr_vl,
    deepseek_ocr2,
)

# model_type -> its descriptor, in FAMILIES order (error messages list model types this way).
REGISTRY: dict[str, FamilyDescriptor] = {
    model_type: descriptor
    for family in FAMILIES
    for model_type, descriptor in family.DESCRIPTORS.items()
}


def supported_model_types() -> list[str]:
    """The `config.model_type` values `ascend_vlm.patch` recognises, sorted."""
    return sorted(REGISTRY)


def descriptor_for(config: Any) -> FamilyDescriptor | None:
    """The descriptor of `config`'s model_type, or None when no family describes it."""
    return REGISTRY.get(getattr(config, "model_type", None))


def spec_for(config: Any) -> ModelSpec | None:
    """The family spec for `config`, or None when its model_type is not supported."""
    descriptor = descriptor_for(config)
    return None if descriptor is None else descriptor.patch(config)


def _check_feature(feature: str) -> None:
    if feature not in FEATURES:
        raise ValueError(f"feature: expected one of {', '.join(FEATURES)}, got {feature!r}")


def model_types_supporting(feature: str) -> tuple[str, ...]:
    """The model types whose descriptor supports `feature` (one of `FEATURES`), in registry
    order. ValueError for an unknown feature."""
    _check_feature(feature)
    return tuple(
        model_type
        for model_type, descriptor in REGISTRY.items()
        if not isinstance(getattr(descriptor.features, feature), Refused)
    )


def require_feature(owner: Any, feature: str, *, argument: str = "model") -> FamilyDescriptor:
    """The descriptor of `owner` (a model, anything else with a ``config``, or a config) when
    its family supports `feature`.

    Raises ValueError naming `argument`, the feature, the model types that support it and the
    model_type that came, followed by the family's reason when it refuses the feature, or by
    the class of `owner` when no family describes its model_type.
    """
    _check_feature(feature)
    config = getattr(owner, "config", owner)
    model_type = getattr(config, "model_type", None)
    descriptor = REGISTRY.get(model_type)
    answer = None if descriptor is None else getattr(descriptor.features, feature)
    if descriptor is not None and not isinstance(answer, Refused):
        return descriptor
    supported = ", ".join(model_types_supporting(feature))
    why = (
        f": {answer.reason}"
        if isinstance(answer, Refused)
        else f" from {type(owner).__name__}, which no family in ascend_vlm.models describes"
    )
    raise ValueError(
        f"{argument}: {FEATURE_LABELS[feature]} supports model_type {supported}, "
        f"got {model_type!r}{why}"
    )
