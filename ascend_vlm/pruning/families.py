"""Which models token pruning runs on, and where their parts are."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ascend_vlm.models.parts import LANGUAGE_MODEL_ATTRIBUTES

# Decoder-only language models behind a vision tower whose prompt attends causally.
SUPPORTED_MODEL_TYPES = (
    "idefics3",
    "internvl",
    "llava",
    "llava_next",
    "llava_onevision",
    "qwen2_5_vl",
    "qwen2_vl",
    "qwen3_vl",
    "smolvlm",
)
REFUSED_MODEL_TYPES = {
    "gemma3": "its image tokens attend to each other bidirectionally and its layers alternate "
    "sliding-window caches",
    "paligemma": "its image and prefix tokens attend bidirectionally",
}
_VISUAL_TOKEN_ATTRIBUTES = ("image_token_id", "image_token_index", "video_token_id")


@dataclass(frozen=True)
class PruningTarget:
    """The parts of one model token pruning hooks into: the multimodal model whose forward
    receives the prompt ids (``multimodal``), the language model's decoder ``layers``, the token
    ids that stand for image or video features, and the number of early layers a Qwen3-VL model
    adds vision features to after the fact (``deepstack_layers``; pruning starts after them)."""

    model_type: str
    multimodal: nn.Module
    layers: nn.ModuleList
    visual_token_ids: tuple[int, ...]
    deepstack_layers: int


def _language_model(multimodal: nn.Module) -> nn.Module | None:
    for name in LANGUAGE_MODEL_ATTRIBUTES:
        module = getattr(multimodal, name, None)
        if isinstance(getattr(module, "layers", None), nn.ModuleList):
            return module
    return None


def pruning_target(base: nn.Module) -> PruningTarget:
    """Locate the parts of ``base`` (a transformers VLM for generation). ValueError naming the
    model type and the supported ones when the family is not supported or its layout is not the
    one expected (the attribute that is missing is named)."""
    config = getattr(base, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type in REFUSED_MODEL_TYPES:
        raise ValueError(
            f"model: token pruning does not support model_type {model_type!r}: "
            f"{REFUSED_MODEL_TYPES[model_type]}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model: token pruning supports model_type {', '.join(SUPPORTED_MODEL_TYPES)}; got "
            f"{type(base).__name__} with model_type {model_type!r}"
        )
    multimodal = getattr(base, "model", None)
    language = _language_model(multimodal) if isinstance(multimodal, nn.Module) else None
    if language is None:
        raise ValueError(
            f"model: expected {type(base).__name__}.model.{{{'|'.join(LANGUAGE_MODEL_ATTRIBUTES)}}}"
            f".layers (the language model's decoder layers), not found"
        )
    ids = tuple(
        value
        for value in dict.fromkeys(getattr(config, name, None) for name in _VISUAL_TOKEN_ATTRIBUTES)
        if isinstance(value, int)
    )
    if not ids:
        raise ValueError(
            f"model: its config names no visual token id (one of {', '.join(_VISUAL_TOKEN_ATTRIBUTES)})"
        )
    vision_config = getattr(config, "vision_config", None)
    deepstack = len(getattr(vision_config, "deepstack_visual_indexes", None) or ())
    return PruningTarget(model_type, multimodal, language.layers, ids, deepstack)
