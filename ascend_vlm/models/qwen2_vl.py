"""Qwen2-VL: Qwen2 decoder with multimodal RoPE + a LayerNorm ViT with 2-D RoPE and varlen attention."""

from __future__ import annotations

from ascend_vlm.models._backbones import NO_FUSED_LAYER_NORM, NON_GATED_MLP
from ascend_vlm.models._qwen_vl import LAYOUT, qwen_vl_descriptor
from ascend_vlm.models.family_spec import LeaveAlone, ModelSpec, PartSpec, RmsNorm, Rope, SwigluMlp


def spec(config) -> ModelSpec:
    return ModelSpec(
        text=PartSpec(
            attention=("Qwen2VLAttention",),
            norms=(RmsNorm(("Qwen2VLRMSNorm",)),),
            mlps=(SwigluMlp(("Qwen2MLP",)),),
            ropes=(Rope(("Qwen2VLAttention",), "apply_rotary_pos_emb"),),
        ),
        vision=PartSpec(
            attention=("VisionAttention",),
            ropes=(Rope(("VisionAttention",), "apply_rotary_pos_emb_vision", style="vision"),),
            left_alone=(
                LeaveAlone("norm", ("LayerNorm",), NO_FUSED_LAYER_NORM),
                LeaveAlone("mlp", ("VisionMlp",), NON_GATED_MLP),
            ),
        ),
        vision_towers=LAYOUT.tower_paths(),
    )


DESCRIPTORS = {"qwen2_vl": qwen_vl_descriptor(spec, "mrope")}
