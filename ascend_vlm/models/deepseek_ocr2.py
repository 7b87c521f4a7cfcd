"""DeepSeek-OCR 2: a SAM ViT-B (windowed attention with decomposed relative positions) whose
patches, with 144 or 256 learned queries, go through a Qwen2-like encoder (bidirectional over
the patches, causal over the queries; 1-D RoPE) + a linear projector + a DeepSeek MoE decoder
(multi-head attention, dense first layers, routed and shared experts), laid out as LLaVA."""

from __future__ import annotations

from ascend_vlm.models._backbones import NO_FUSED_LAYER_NORM, NON_GATED_MLP, llama_like
from ascend_vlm.models._moe_blocks import DEEPSEEK_OCR2_MOE_BLOCKS
from ascend_vlm.models.descriptor import SUPPORTED, FeatureSupport, Refused
from ascend_vlm.models.family_spec import LeaveAlone, ModelSpec, PartSpec
from ascend_vlm.models.llava import LAYOUT, llava_descriptor

_SAM = PartSpec(
    left_alone=(
        LeaveAlone(
            "attention-vision",
            ("DeepseekOcr2SamVisionAttention", "DeepseekOcr2SamVisionSdpaAttention"),
            "SAM attention adds decomposed relative-position terms to its logits inside its own "
            "forward, outside the attention interface",
        ),
        LeaveAlone("norm", ("LayerNorm", "DeepseekOcr2SamLayerNorm"), NO_FUSED_LAYER_NORM),
        LeaveAlone("mlp", ("DeepseekOcr2SamMLPBlock",), NON_GATED_MLP),
    )
)


def spec(config) -> ModelSpec:
    return ModelSpec(
        text=llama_like("DeepseekOcr2Text") + PartSpec(moes=(DEEPSEEK_OCR2_MOE_BLOCKS,)),
        vision=llama_like("DeepseekOcr2Vision") + _SAM,
        vision_towers=LAYOUT.tower_paths(),
    )


_VIEWS = (
    "its processor adds a varying number of local crops per image (pixel_values_local, "
    "num_local_patches) to the global view"
)
DESCRIPTORS = {
    "deepseek_ocr2": llava_descriptor(
        FeatureSupport(
            token_pruning=SUPPORTED,
            kv_compression=SUPPORTED,
            vision_cache=Refused(f"{_VIEWS}, which the cache does not split per image"),
            chat_sessions=Refused(f"{_VIEWS}, which ChatSession cannot split per image"),
            batching=SUPPORTED,
            quantization=SUPPORTED,
            adapters=SUPPORTED,
            tracing=SUPPORTED,
            attention_overlay=Refused(
                "its image tokens are learned queries read out by a causal encoder, so no token "
                "stands for an image region the overlay could draw"
            ),
            vision_input=Refused(f"{_VIEWS}, which neither fast preprocessor reproduces"),
        ),
        patch=spec,
    )
}
