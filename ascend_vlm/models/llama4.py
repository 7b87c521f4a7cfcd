"""Llama 4: a decoder whose RoPE layers attend within fixed chunks (L2-normed q/k) and whose
NoPE layers attend fully with a query temperature, dense and MoE feed-forward layers, RoPE as
complex products of interleaved pairs; a LayerNorm ViT with 2-D complex RoPE and a
pixel-shuffle adapter. The generation model holds tower, projector and language model itself
(there is no ``model.model``)."""

from __future__ import annotations

from ascend_vlm.models._backbones import NO_FUSED_LAYER_NORM, NON_GATED_MLP
from ascend_vlm.models._moe_blocks import LLAMA4_MOE_BLOCKS
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
    vision_tower="vision_model",
    projector="multi_modal_projector",
    language_model="language_model.model",
    multimodal="",
)


def spec(config) -> ModelSpec:
    return ModelSpec(
        text=PartSpec(
            attention=("Llama4TextAttention",),
            norms=(RmsNorm(("Llama4TextRMSNorm",)),),
            mlps=(SwigluMlp(("Llama4TextMLP",)),),
            ropes=(Rope(("Llama4TextAttention",), "apply_rotary_emb", style="complex"),),
            left_alone=(
                LeaveAlone(
                    "norm",
                    # 5.17 names the class Llama4TextL2Norm.
                    ("Llama4TextWeightlessRMSNorm", "Llama4TextL2Norm"),
                    "weightless q/k norm (no weight for ops.rms_norm); kept stock",
                ),
            ),
            moes=(LLAMA4_MOE_BLOCKS,),
        ),
        vision=PartSpec(
            attention=("Llama4VisionAttention",),
            ropes=(
                Rope(("Llama4VisionAttention",), "vision_apply_rotary_emb", style="complex_vision"),
            ),
            left_alone=(
                LeaveAlone("norm", ("LayerNorm",), NO_FUSED_LAYER_NORM),
                LeaveAlone("mlp", ("Llama4VisionMLP", "Llama4VisionMLP2"), NON_GATED_MLP),
            ),
        ),
        vision_towers=LAYOUT.tower_paths(),
    )


_CHUNKED = (
    "its RoPE layers attend within fixed chunks of positions, whose boundaries move when tokens are"
)
_CHUNKED_CACHE = "its chunked-attention layers keep sliding-window caches"
_TILES = "its processor cuts each image into a varying number of tiles plus a global view"

DESCRIPTORS = {
    "llama4": FamilyDescriptor(
        patch=spec,
        layout=LAYOUT,
        visual_token_ids=("image_token_id",),
        position_scheme="rope",
        encoders=(Encoder("get_image_features"),),
        features=FeatureSupport(
            token_pruning=Refused(f"{_CHUNKED} dropped from the prompt"),
            kv_compression=Refused(f"{_CHUNKED} evicted from the cache"),
            vision_cache=Refused(
                f"{_TILES}, rows of pixel_values the cache does not split per image"
            ),
            chat_sessions=Refused(
                f"{_CHUNKED_CACHE}, which cannot be cropped back once their window is full"
            ),
            batching=Refused(
                f"{_CHUNKED_CACHE}, which BatchGenerator's KV blocks do not hold (its "
                "per-sequence fallback is not yet tested on this family)"
            ),
            quantization=SUPPORTED,
            adapters=SUPPORTED,
            tracing=SUPPORTED,
            attention_overlay=Refused(
                f"{_TILES} and its vision adapter pixel-shuffles the patches, a geometry the "
                f"overlay does not invert"
            ),
            vision_input=Refused(f"{_TILES}, which neither fast preprocessor reproduces"),
        ),
    )
}
