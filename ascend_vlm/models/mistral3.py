"""Mistral 3 (Mistral Small 3.1/3.2): a Pixtral vision tower (RMSNorm ViT, gated SiLU MLP,
2-D RoPE) + an RMSNorm / patch-merger projector + a Mistral decoder, laid out as LLaVA."""

from __future__ import annotations

from ascend_vlm.models._backbones import text_backbone, vision_backbone
from ascend_vlm.models.family_spec import ModelSpec, PartSpec, RmsNorm
from ascend_vlm.models.llava import LAYOUT, llava_descriptor, sized_image_features


def spec(config) -> ModelSpec:
    return ModelSpec(
        # the projector normalises the vision features with its own RMSNorm
        text=text_backbone(config.text_config) + PartSpec(norms=(RmsNorm(("Mistral3RMSNorm",)),)),
        vision=vision_backbone(config.vision_config),
        vision_towers=LAYOUT.tower_paths(),
    )


_LAYOUT = (
    "its processor keeps each image's own size (so its token count varies) and its projector "
    "merges 2x2 patches"
)
DESCRIPTORS = {"mistral3": llava_descriptor(sized_image_features(_LAYOUT), patch=spec)}
