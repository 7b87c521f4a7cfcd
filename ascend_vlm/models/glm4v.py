"""GLM-4.1V (``glm4v``, dense decoder), GLM-4.5V (``glm4v_moe``, MoE decoder) and GLM-4.6V
(``glm46v``): an RMSNorm ViT with 2-D RoPE and varlen attention, a patch merger, and a GLM
decoder with M-RoPE on a partial rotary dimension, each part taken from its sub-config's
model_type (GLM-4.6V builds whatever its sub-configs name; the others build their own)."""

from __future__ import annotations

from dataclasses import replace

from ascend_vlm.models._backbones import composite_spec
from ascend_vlm.models._qwen_vl import ALL_FEATURES
from ascend_vlm.models.descriptor import (
    Encoder,
    FamilyDescriptor,
    Layout,
    Refused,
)
from ascend_vlm.models.family_spec import ModelSpec

LAYOUT = Layout(vision_tower="visual", projector="visual.merger", language_model="language_model")


def spec(config) -> ModelSpec:
    return composite_spec(config, LAYOUT)


_FEATURES = replace(
    ALL_FEATURES,
    vision_input=Refused(
        "its image processor sizes images by GLM's own smart_resize (frame count first, other "
        "rounding), which neither fast preprocessor reproduces"
    ),
)


def _descriptor(position_scheme: str) -> FamilyDescriptor:
    return FamilyDescriptor(
        patch=spec,
        layout=LAYOUT,
        visual_token_ids=("image_token_id", "video_token_id"),
        position_scheme=position_scheme,
        encoders=(
            Encoder("get_image_features", grid="image_grid_thw"),
            Encoder("get_video_features", grid="video_grid_thw"),
        ),
        features=_FEATURES,
    )


# glm4v_moe's decoder rotates NeoX halves (Qwen2-VL's layout); glm4v's and glm46v's default
# decoder rotates adjacent pairs.
DESCRIPTORS = {
    "glm4v": _descriptor("pairwise_mrope"),
    "glm46v": _descriptor("pairwise_mrope"),
    "glm4v_moe": _descriptor("mrope"),
}
