"""Where a model's decoder layers and visual tokens are, read from its family descriptor: what
token pruning hooks and the attention maps read."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ascend_vlm.models import require_feature
from ascend_vlm.models.descriptor import attribute_at


@dataclass(frozen=True)
class DecoderParts:
    """The multimodal model whose forward receives the prompt ids (``multimodal``), the
    language model's decoder ``layers``, the token ids that stand for image or video features,
    and the number of early layers a Qwen3-VL model adds vision features to after the fact
    (``deepstack_layers``)."""

    model_type: str
    multimodal: nn.Module
    layers: nn.ModuleList
    visual_token_ids: tuple[int, ...]
    deepstack_layers: int


def decoder_parts(base: nn.Module, feature: str) -> DecoderParts:
    """Locate the parts of ``base`` (a transformers VLM for generation) its family descriptor
    names, for ``feature`` (a field of ``FeatureSupport``). ValueError naming the model type
    and the supported ones when the family does not support ``feature`` (with the family's
    reason), or when its layout is not the one declared (the missing attribute is named)."""
    descriptor = require_feature(base, feature)
    config = base.config
    layout = descriptor.layout
    multimodal = layout.multimodal_model(base)
    layers = attribute_at(multimodal, layout.decoder_layers)
    if not isinstance(multimodal, nn.Module) or not isinstance(layers, nn.ModuleList):
        path = ".".join(
            p for p in (type(base).__name__, layout.multimodal, layout.decoder_layers) if p
        )
        raise ValueError(f"model: expected {path} (the language model's decoder layers), not found")
    ids = descriptor.token_ids(config)
    if not ids:
        raise ValueError(
            f"model: its config names no visual token id (one of "
            f"{', '.join(descriptor.visual_token_ids)})"
        )
    return DecoderParts(
        config.model_type, multimodal, layers, ids, descriptor.deepstack_layers(config)
    )
