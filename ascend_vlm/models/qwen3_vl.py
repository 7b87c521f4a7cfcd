"""Qwen3-VL: Qwen3 decoder (q/k RMSNorm, interleaved M-RoPE folded into cos/sin) + a LayerNorm
ViT with 2-D RoPE and varlen attention."""

from __future__ import annotations

from ascend_vlm.models._backbones import NO_FUSED_LAYER_NORM, NON_GATED_MLP
from ascend_vlm.models._qwen_vl import LAYOUT, qwen_vl_descriptor
from ascend_vlm.models.family_spec import LeaveAlone, ModelSpec, PartSpec, RmsNorm, Rope, SwigluMlp


def spec(config) -> ModelSpec:
    return ModelSpec(
        text=PartSpec(
            attention=("Qwen3VLTextAttention",),
            norms=(RmsNorm(("Qwen3VLTextRMSNorm",)),),
            mlps=(SwigluMlp(("Qwen3VLTextMLP",)),),
            ropes=(Rope(("Qwen3VLTextAttention",), "apply_rotary_pos_emb"),),
        ),
        vision=PartSpec(
            attention=("Qwen3VLVisionAttention",),
            ropes=(
                Rope(("Qwen3VLVisionAttention",), "apply_rotary_pos_emb_vision", style="vision"),
            ),
            left_alone=(
                LeaveAlone("norm", ("LayerNorm",), NO_FUSED_LAYER_NORM),
                LeaveAlone("mlp", ("Qwen3VLVisionMLP",), NON_GATED_MLP),
            ),
        ),
        vision_towers=LAYOUT.tower_paths(),
    )


DESCRIPTORS = {
    "qwen3_vl": qwen_vl_descriptor(
        spec, "interleaved_mrope", deepstack="vision_config.deepstack_visual_indexes"
    )
}
