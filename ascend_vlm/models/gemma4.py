"""Gemma 4: a Gemma decoder (sliding and full layers with their own head dims and RoPE, q/k/v
RMSNorm, key/value sharing between layers, per-layer input embeddings) and a ViT with RMSNorms
and axial 2-D RoPE, joined by an RMSNorm + linear embedder.

What the attention op is handed stays exact on every layer: queries are pre-scaled (scaling 1),
the sliding window and the bidirectional image blocks arrive in the masks, a layer that reuses
an earlier layer's keys and values (``num_kv_shared_layers``) or whose values are its keys
(``attention_k_eq_v``) hands the op those tensors, and no Gemma 4 attention soft-caps its logits
(``final_logit_softcapping`` caps the output logits, outside attention). Full-attention layers'
"proportional" RoPE rotates the whole head dim with zero frequencies on its unrotated part
(cos 1, sin 0), which `ops.rotary_embedding` computes as it is.
"""

from __future__ import annotations

from ascend_vlm.models.descriptor import (
    SUPPORTED,
    Encoder,
    FamilyDescriptor,
    FeatureSupport,
    Layout,
    Refused,
)
from ascend_vlm.models.family_spec import LeaveAlone, ModelSpec, PartSpec, RmsNorm, Rope, SwigluMlp
from ascend_vlm.models.llava import SLIDING_CACHES_UNBATCHED

LAYOUT = Layout(
    vision_tower="vision_tower", projector="embed_vision", language_model="language_model"
)
# y = x * rsqrt(mean(x^2) + eps) * weight in fp32, rounded once (no Gemma 1-3 "1 + weight");
# v_norm, the router's and the embedders' norms have no weight (with_scale=False).
_NORMS = (RmsNorm(("Gemma4RMSNorm",), rounds_once=True, scale_switch="with_scale"),)
_CLIPPED_GELU_MLP = (
    "its projections are Gemma4ClippableLinear (inputs and outputs optionally clamped) and its "
    "gate is GELU-tanh; ops.swiglu computes silu(gate) * up on plain projections"
)
_MOE = (
    "its experts gate with GELU-tanh and its router scales the top-k weights per expert; "
    "ops.moe_experts computes SiLU-gated experts"
)
_AUDIO_ATTENTION = (
    "the audio tower's chunked local attention adds a relative-position bias and soft-caps its "
    "logits in its own eager code, outside the attention interface"
)


def spec(config) -> ModelSpec:
    return ModelSpec(
        text=PartSpec(
            attention=("Gemma4TextAttention",),
            norms=_NORMS,
            mlps=(SwigluMlp(("Gemma4TextMLP",)),),
            ropes=(Rope(("Gemma4TextAttention",), "apply_rotary_pos_emb", style="text-single"),),
            left_alone=(
                LeaveAlone("moe", ("Gemma4TextExperts", "Gemma4TextRouter"), _MOE),
                LeaveAlone("attention-text", ("Gemma4AudioAttention",), _AUDIO_ATTENTION),
            ),
        ),
        vision=PartSpec(
            attention=("Gemma4VisionAttention",),
            norms=_NORMS,
            ropes=(Rope(("Gemma4VisionAttention",), "apply_multidimensional_rope", style="axial"),),
            left_alone=(LeaveAlone("mlp", ("Gemma4VisionMLP",), _CLIPPED_GELU_MLP),),
        ),
        vision_towers=LAYOUT.tower_paths(),
    )


_PRUNING = (
    "its image tokens attend to each other bidirectionally in sliding layers, its layers "
    "alternate sliding-window caches and its last layers reuse earlier layers' keys and values"
)
DESCRIPTORS = {
    "gemma4": FamilyDescriptor(
        patch=spec,
        layout=LAYOUT,
        visual_token_ids=("image_token_id", "video_token_id"),
        position_scheme="rope",
        encoders=(Encoder("get_image_features"), Encoder("get_video_features")),
        features=FeatureSupport(
            token_pruning=Refused(_PRUNING),
            kv_compression=Refused(_PRUNING),
            vision_cache=Refused(
                "its get_image_features takes image_position_ids beside pixel_values, which "
                "the cache does not split per image"
            ),
            chat_sessions=Refused(
                "its sliding-window cache layers cannot be cropped back once their window is "
                "full, and its last layers read earlier layers' keys and values, not a cache"
            ),
            batching=Refused(SLIDING_CACHES_UNBATCHED),
            quantization=SUPPORTED,
            adapters=SUPPORTED,
            tracing=SUPPORTED,
            attention_overlay=Refused(
                "its pooler averages patches by their (x, y) positions into image tokens and "
                "drops padding patches, a geometry the overlay does not invert"
            ),
            vision_input=Refused(
                "its image processor patchifies aspect-preserving resizes with positions and "
                "padding patches, which neither fast preprocessor reproduces"
            ),
        ),
    )
}
