"""Specs of the language models and vision towers that composite VLMs (LLaVA, PaliGemma, ...)
plug in, keyed by the sub-config's `model_type`."""

from __future__ import annotations

from ascend_vlm.models._moe_blocks import GLM4V_MOE_BLOCKS
from ascend_vlm.models.descriptor import Layout
from ascend_vlm.models.family_spec import LeaveAlone, ModelSpec, PartSpec, RmsNorm, Rope, SwigluMlp

NO_FUSED_LAYER_NORM = "ascend_vlm.ops has no fused LayerNorm; nn.LayerNorm is kept"
NON_GATED_MLP = "fc1 -> act -> fc2 MLP is not gated; ops.swiglu does not apply"
GLM_MERGER = (
    "its forward runs proj -> LayerNorm -> GELU before the gated MLP, which the MLP adapter "
    "would skip"
)


def llama_like(prefix: str, *, norm_offset: float = 0.0, mlp: str | None = None) -> PartSpec:
    """A decoder whose classes are named `<prefix>Attention/RMSNorm/MLP` and that applies RoPE
    through the module-level `apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`."""
    return PartSpec(
        attention=(f"{prefix}Attention",),
        norms=(RmsNorm((f"{prefix}RMSNorm",), offset=norm_offset),),
        mlps=(SwigluMlp((mlp or f"{prefix}MLP",)),),
        ropes=(Rope((f"{prefix}Attention",), "apply_rotary_pos_emb"),),
    )


def _glm4v_text() -> PartSpec:
    """GLM-4V's decoder: a fused gate_up_proj MLP and M-RoPE on GPT-J pairs of a partial
    rotary dimension (`apply_rotary_pos_emb` with `rotate_half_llm`)."""
    return PartSpec(
        attention=("Glm4vTextAttention",),
        norms=(RmsNorm(("Glm4vRMSNorm",)),),
        mlps=(SwigluMlp(("Glm4vTextMLP",), fused=True),),
        ropes=(Rope(("Glm4vTextAttention",), "apply_rotary_pos_emb", style="text-interleaved"),),
    )


TEXT_BACKBONES: dict[str, PartSpec] = {
    "llama": llama_like("Llama"),
    "mistral": llama_like("Mistral"),
    "qwen2": llama_like("Qwen2"),
    "qwen3": llama_like("Qwen3"),
    "gemma": llama_like("Gemma", norm_offset=1.0),
    "gemma2": llama_like("Gemma2", norm_offset=1.0),
    "gemma3_text": llama_like("Gemma3", norm_offset=1.0),
    "glm4v_text": _glm4v_text(),
    "glm4v_moe_text": llama_like("Glm4vMoeText") + PartSpec(moes=(GLM4V_MOE_BLOCKS,)),
}


def layer_norm_vit(attention: str, mlp: str, *, rope: str | None = None) -> PartSpec:
    """A pre-LayerNorm ViT with a non-gated MLP: its attention goes to the fused op and, when
    its attention calls the module-level vision RoPE function `rope` (q/k [T, N, D], cos/sin
    [T, D]), that goes to the RoPE op."""
    ropes = () if rope is None else (Rope((attention,), rope, style="vision"),)
    return PartSpec(
        attention=(attention,),
        ropes=ropes,
        left_alone=(
            LeaveAlone("norm", ("LayerNorm",), NO_FUSED_LAYER_NORM),
            LeaveAlone("mlp", (mlp,), NON_GATED_MLP),
        ),
    )


def _glm4v_vision(prefix: str, mlp: str) -> PartSpec:
    """GLM-4V's ViT (classes `<prefix>Vision...`, norms `<prefix>RMSNorm`, gated MLP `mlp`):
    2-D RoPE through `apply_rotary_pos_emb_vision`, varlen attention; the patch merger (the
    projector) is left alone."""
    attention = f"{prefix}VisionAttention"
    return PartSpec(
        attention=(attention,),
        norms=(RmsNorm((f"{prefix}RMSNorm",)),),
        mlps=(SwigluMlp((mlp,)),),
        ropes=(Rope((attention,), "apply_rotary_pos_emb_vision", style="vision"),),
        left_alone=(
            LeaveAlone("norm", ("LayerNorm",), NO_FUSED_LAYER_NORM),
            LeaveAlone("mlp", (f"{prefix}VisionPatchMerger",), GLM_MERGER),
        ),
    )


VISION_BACKBONES: dict[str, PartSpec] = {
    "clip_vision_model": layer_norm_vit("CLIPAttention", "CLIPMLP"),
    "siglip_vision_model": layer_norm_vit("SiglipAttention", "SiglipMLP")
    + PartSpec(
        left_alone=(
            LeaveAlone(
                "attention-vision",
                ("SiglipMultiheadAttentionPoolingHead",),
                "pooling head uses nn.MultiheadAttention, outside the attention interface",
            ),
        )
    ),
    "idefics3_vision": layer_norm_vit("Idefics3VisionAttention", "Idefics3VisionMLP"),
    "smolvlm_vision": layer_norm_vit("SmolVLMVisionAttention", "SmolVLMVisionMLP"),
    "internvl_vision": layer_norm_vit("InternVLVisionAttention", "InternVLVisionMLP")
    + PartSpec(norms=(RmsNorm(("InternVLVisionRMSNorm",)),)),
    "glm4v_vision": _glm4v_vision("Glm4v", "Glm4VisionMlp"),
    # transformers spells this MLP class without the "V" of "Vision"
    "glm4v_moe_vision": _glm4v_vision("Glm4vMoe", "Glm4vMoeisionMlp"),
    # RMSNorm ViT with a gated MLP; its 2-D RoPE is folded into [S, D] cos/sin tables.
    "pixtral": llama_like("Pixtral"),
}


def _lookup(table: dict[str, PartSpec], model_type: str, what: str) -> PartSpec:
    spec = table.get(model_type)
    if spec is not None:
        return spec
    return PartSpec(
        left_alone=(
            LeaveAlone(
                what, (model_type,), f"{what} backbone {model_type!r} is not known to ascend_vlm"
            ),
        )
    )


def text_backbone(config) -> PartSpec:
    """Spec of the language model described by `config` (a text sub-config)."""
    return _lookup(TEXT_BACKBONES, config.model_type, "attention-text")


def vision_backbone(config) -> PartSpec:
    """Spec of the vision tower described by `config` (a vision sub-config)."""
    return _lookup(VISION_BACKBONES, config.model_type, "attention-vision")


def composite_spec(config, layout: Layout) -> ModelSpec:
    """The spec of a VLM assembled from sub-configs: the backbones its ``text_config`` and
    ``vision_config`` name, the vision tower where `layout` puts it."""
    return ModelSpec(
        text=text_backbone(config.text_config),
        vision=vision_backbone(config.vision_config),
        vision_towers=layout.tower_paths(),
    )
