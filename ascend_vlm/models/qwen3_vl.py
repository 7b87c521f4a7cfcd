"""Qwen3-VL: Qwen3 decoder (q/k RMSNorm, interleaved M-RoPE folded into cos/sin) + a LayerNorm
ViT with 2-D RoPE and varlen attention."""

from __future__ import annotations

from ascend_vlm.models._backbones import NO_FUSED_LAYER_NORM, NON_GATED_MLP
from ascend_vlm.models._qwen_vl import LAYOUT, qwen_vl_descriptor
from ascend_vlm.models.family_spec import LeaveAlone, ModelSpec, PartSpec, RmsNorm, Rope, SwigluMlp

# Qwen3-VL's deepstack layers, and its M-RoPE flavour (Qwen3-VL-MoE's too).
DEEPSTACK = "vision_config.deepstack_visual_indexes"
POSITION_SCHEME = "interleaved_mrope"


def qwen3_vl_spec(prefix: str) -> ModelSpec:
    """Qwen3-VL's swaps for the classes named `<prefix>TextAttention`, `<prefix>VisionAttention`,
    ... (prefix "Qwen3VL", or "Qwen3VLMoe" whose dense layers and tower are the same)."""
    return ModelSpec(
        text=PartSpec(
            attention=(f"{prefix}TextAttention",),
            norms=(RmsNorm((f"{prefix}TextRMSNorm",)),),
            mlps=(SwigluMlp((f"{prefix}TextMLP",)),),
            ropes=(Rope((f"{prefix}TextAttention",), "apply_rotary_pos_emb"),),
        ),
        vision=PartSpec(
            attention=(f"{prefix}VisionAttention",),
            ropes=(
                Rope((f"{prefix}VisionAttention",), "apply_rotary_pos_emb_vision", style="vision"),
            ),
            left_alone=(
                LeaveAlone("norm", ("LayerNorm",), NO_FUSED_LAYER_NORM),
                LeaveAlone("mlp", (f"{prefix}VisionMLP",), NON_GATED_MLP),
            ),
        ),
        vision_towers=LAYOUT.tower_paths(),
    )


def spec(config) -> ModelSpec:
    return qwen3_vl_spec("Qwen3VL")


DESCRIPTORS = {"qwen3_vl": qwen_vl_descriptor(spec, POSITION_SCHEME, deepstack=DEEPSTACK)}
