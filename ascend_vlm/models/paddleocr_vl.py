"""PaddleOCR-VL: a SigLIP-style LayerNorm ViT with 2-D RoPE and varlen attention + a LayerNorm /
2x2-merge projector + an ERNIE-4.5 decoder (Llama-like, M-RoPE folded into cos/sin), laid out
as Qwen2-VL."""

from __future__ import annotations

import dataclasses

from ascend_vlm.models._backbones import NO_FUSED_LAYER_NORM, layer_norm_vit, llama_like
from ascend_vlm.models._qwen_vl import ALL_FEATURES
from ascend_vlm.models.descriptor import Encoder, FamilyDescriptor, Layout, Refused
from ascend_vlm.models.family_spec import LeaveAlone, ModelSpec, PartSpec

LAYOUT = Layout(vision_tower="visual", projector="projector", language_model="language_model")


def spec(config) -> ModelSpec:
    return ModelSpec(
        text=llama_like("PaddleOCR")
        # the projector's pre-norm
        + PartSpec(left_alone=(LeaveAlone("norm", ("LayerNorm",), NO_FUSED_LAYER_NORM),)),
        vision=layer_norm_vit(
            "PaddleOCRVisionAttention", "PaddleOCRVisionMLP", rope="apply_rotary_pos_emb_vision"
        ),
        vision_towers=LAYOUT.tower_paths(),
    )


DESCRIPTORS = {
    "paddleocr_vl": FamilyDescriptor(
        patch=spec,
        layout=LAYOUT,
        visual_token_ids=("image_token_id",),
        position_scheme="mrope",
        encoders=(Encoder("get_image_features", grid="image_grid_thw"),),
        # its processor lays images out on Qwen-VL's merged grids
        features=dataclasses.replace(
            ALL_FEATURES,
            vision_input=Refused(
                "its image processor returns pixels as [patches, 3, 14, 14] blocks of one frame, "
                "a layout neither fast preprocessor reproduces"
            ),
        ),
    )
}
