"""Which part of a VLM a module belongs to, from its dotted name: the vision tower, the
projector between tower and language model, the output head, or the language model.

Markers are matched against whole name parts; a projector nested in the tower (Qwen2-VL's
``visual.merger``) counts as projector.
"""

from __future__ import annotations

VISION_MARKERS = ("visual", "vision_tower", "vision_model", "vision_encoder")
PROJECTOR_MARKERS = (
    "merger",
    "multi_modal_projector",
    "connector",
    "mm_projector",
    "embed_vision",
    "projector",
)
OUTPUT_HEADS = ("lm_head",)
# Attributes of a multimodal model that hold its language model (decoder layers and all).
LANGUAGE_MODEL_ATTRIBUTES = ("language_model", "text_model")
PARTS = ("language", "vision", "projector", "lm_head")


def model_part(module_name: str) -> str:
    """One of :data:`PARTS` for the module called ``module_name`` (PEFT prefixes ignored)."""
    parts = module_name.split(".")
    if any(marker in parts for marker in PROJECTOR_MARKERS):
        return "projector"
    if any(marker in parts for marker in VISION_MARKERS):
        return "vision"
    if parts[-1] in OUTPUT_HEADS:
        return "lm_head"
    return "language"
