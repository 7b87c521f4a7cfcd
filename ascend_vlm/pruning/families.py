"""Where token pruning hooks into a model, read from its family descriptor."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ascend_vlm.models import model_types_supporting, require_feature
from ascend_vlm.models.descriptor import attribute_at

# Derived from the family descriptors: decoder-only language models behind a vision tower whose
# prompt attends causally (`ascend_vlm.models` says why each other family is refused).
SUPPORTED_MODEL_TYPES = model_types_supporting("token_pruning")


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


def pruning_target(base: nn.Module) -> PruningTarget:
    """Locate the parts of ``base`` (a transformers VLM for generation) its family descriptor
    names. ValueError naming the model type and the supported ones when the family does not
    support token pruning or SnapKV (with the family's reason), or when its layout is not the
    one declared (the attribute that is missing is named)."""
    descriptor = require_feature(base, "token_pruning")
    require_feature(base, "kv_compression")
    config = base.config
    multimodal = getattr(base, "model", None)
    layers = attribute_at(multimodal, descriptor.layout.decoder_layers)
    if not isinstance(multimodal, nn.Module) or not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"model: expected {type(base).__name__}.model.{descriptor.layout.decoder_layers} "
            f"(the language model's decoder layers), not found"
        )
    ids = descriptor.token_ids(config)
    if not ids:
        raise ValueError(
            f"model: its config names no visual token id (one of "
            f"{', '.join(descriptor.visual_token_ids)})"
        )
    return PruningTarget(
        config.model_type, multimodal, layers, ids, descriptor.deepstack_layers(config)
    )
