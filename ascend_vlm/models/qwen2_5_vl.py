"""Qwen2.5-VL: Qwen2 decoder + an RMSNorm ViT with gated SiLU MLPs, 2-D RoPE, varlen attention."""

from __future__ import annotations

from ascend_vlm.models._qwen_vl import LAYOUT, qwen_vl_descriptor
from ascend_vlm.models.family_spec import ModelSpec, PartSpec, RmsNorm, Rope, SwigluMlp


def spec(config) -> ModelSpec:
    return ModelSpec(
        text=PartSpec(
            attention=("Qwen2_5_VLAttention",),
            norms=(RmsNorm(("Qwen2_5_VLRMSNorm",)),),
            mlps=(SwigluMlp(("Qwen2MLP",)),),
            ropes=(Rope(("Qwen2_5_VLAttention",), "apply_rotary_pos_emb"),),
        ),
        vision=PartSpec(
            attention=("Qwen2_5_VLVisionAttention",),
            norms=(RmsNorm(("Qwen2_5_VLRMSNorm",)),),
            mlps=(SwigluMlp(("Qwen2_5_VLMLP",)),),
            ropes=(
                Rope(("Qwen2_5_VLVisionAttention",), "apply_rotary_pos_emb_vision", style="vision"),
            ),
        ),
        vision_towers=LAYOUT.tower_paths(),
    )


DESCRIPTORS = {"qwen2_5_vl": qwen_vl_descriptor(spec, "mrope")}
