"""Llama 3.2 Vision (mllama): a Llama decoder with cross-attention layers that attend to the
image tiles' features (q/k RMSNorm), and a tiled LayerNorm ViT (local then gated global layers)
without RoPE. Images reach the decoder through cross-attention, not as tokens."""

from __future__ import annotations

from ascend_vlm.models._backbones import NO_FUSED_LAYER_NORM, NON_GATED_MLP
from ascend_vlm.models.descriptor import (
    SUPPORTED,
    Encoder,
    FamilyDescriptor,
    FeatureSupport,
    Layout,
    Refused,
)
from ascend_vlm.models.family_spec import LeaveAlone, ModelSpec, PartSpec, RmsNorm, Rope, SwigluMlp

LAYOUT = Layout(
    vision_tower="vision_model", projector="multi_modal_projector", language_model="language_model"
)


def spec(config) -> ModelSpec:
    return ModelSpec(
        text=PartSpec(
            attention=("MllamaTextSelfAttention", "MllamaTextCrossAttention"),
            norms=(RmsNorm(("MllamaTextRMSNorm",)),),
            mlps=(SwigluMlp(("MllamaTextMLP",)),),
            ropes=(Rope(("MllamaTextSelfAttention",), "apply_rotary_pos_emb"),),
        ),
        vision=PartSpec(
            attention=("MllamaVisionAttention",),
            left_alone=(
                LeaveAlone("norm", ("LayerNorm",), NO_FUSED_LAYER_NORM),
                LeaveAlone("mlp", ("MllamaVisionMLP",), NON_GATED_MLP),
            ),
        ),
        vision_towers=LAYOUT.tower_paths(),
    )


_CROSS = "its images reach the decoder through cross-attention layers, not as prompt tokens"
_TILED = (
    "its processor tiles each image by aspect ratio and returns aspect_ratio_ids, "
    "aspect_ratio_mask and cross_attention_mask beside pixel_values"
)

DESCRIPTORS = {
    "mllama": FamilyDescriptor(
        patch=spec,
        layout=LAYOUT,
        visual_token_ids=("image_token_id",),
        position_scheme="rope",
        # The multimodal model has no get_image_features: its vision model encodes the tiles.
        encoders=(Encoder("vision_model"),),
        features=FeatureSupport(
            token_pruning=Refused(f"{_CROSS}, so there are no visual tokens to prune"),
            kv_compression=Refused(
                f"{_CROSS}; their caches hold the image tiles' keys, which SnapKV does not select"
            ),
            vision_cache=Refused(f"{_TILED}, which the cache does not split per image"),
            chat_sessions=Refused(f"{_TILED}, which ChatSession cannot split per image"),
            batching=Refused(f"{_TILED}, which BatchGenerator does not batch per row"),
            quantization=SUPPORTED,
            adapters=SUPPORTED,
            tracing=SUPPORTED,
            attention_overlay=Refused(
                f"{_CROSS}, whose attention the overlay (text-to-image-token maps) does not read"
            ),
            vision_input=Refused(f"{_TILED}; neither fast preprocessor reproduces them"),
        ),
    )
}
