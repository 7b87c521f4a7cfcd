"""Qwen3.5: a hybrid decoder (Gated DeltaNet linear-attention layers between gated full
attention layers with q/k RMSNorm and partial interleaved M-RoPE; zero-centred RMSNorms,
``(1 + weight)``) + Qwen3-VL's LayerNorm ViT with 2-D RoPE and varlen attention, without
deepstack."""

from __future__ import annotations

from dataclasses import replace

from ascend_vlm.models._backbones import NO_FUSED_LAYER_NORM, NON_GATED_MLP
from ascend_vlm.models._qwen_vl import ALL_FEATURES, LAYOUT, qwen_vl_descriptor
from ascend_vlm.models.descriptor import Refused
from ascend_vlm.models.family_spec import (
    GatedDeltaNet,
    LeaveAlone,
    ModelSpec,
    PartSpec,
    RmsNorm,
    Rope,
    SparseMoe,
    SwigluMlp,
)

# Qwen3_5RMSNormGated (and the MoE family's): y = (w * rmsnorm(x)) * silu(gate) per value head.
GATED_NORM = (
    "norm then silu(gate) product: ops.rms_norm then ops.swiglu on cat(gate, normed) would add "
    "a copy of both [T, V] tensors per call for no fused kernel"
)


def hybrid_spec(prefix: str, moes: tuple[SparseMoe, ...] = ()) -> ModelSpec:
    """The spec of a Qwen3.5 family whose module classes start with `prefix` ("Qwen3_5",
    "Qwen3_5Moe"), with `moes` its sparse MoE blocks."""
    return ModelSpec(
        text=PartSpec(
            attention=(f"{prefix}Attention",),
            norms=(RmsNorm((f"{prefix}RMSNorm",), offset=1.0),),
            mlps=(SwigluMlp((f"{prefix}MLP",)),),
            ropes=(Rope((f"{prefix}Attention",), "apply_rotary_pos_emb"),),
            linear_attention=(GatedDeltaNet((f"{prefix}GatedDeltaNet",)),),
            moes=moes,
            left_alone=(LeaveAlone("norm", (f"{prefix}RMSNormGated",), GATED_NORM),),
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
    return hybrid_spec("Qwen3_5")


# What a Gated DeltaNet layer keeps between calls: one recurrent state and one conv state per
# sequence, summarising every token seen, with no per-token slots.
_RECURRENT = (
    "Qwen3.5's Gated DeltaNet layers keep a recurrent state per sequence, not a slot per token"
)
FEATURES = replace(
    ALL_FEATURES,
    token_pruning=Refused(
        f"pruning hands the layers after its scoring layer the kept tokens only and re-indexes "
        f"their attention caches; {_RECURRENT}, and its scoring taps self_attn, which they lack"
    ),
    kv_compression=Refused(
        f"SnapKV cuts each layer's prompt KV cache down to chosen token slots; {_RECURRENT}"
    ),
    chat_sessions=Refused(
        f"ChatSession crops the reused cache back to the conversation's common prefix; "
        f"{_RECURRENT}, which transformers cannot crop unless past recording was on"
    ),
    batching=Refused(
        f"BatchGenerator pages KV in blocks of token slots; {_RECURRENT} (its per-sequence "
        "fallback is not yet tested on this family)"
    ),
    attention_overlay=Refused(
        "the overlay averages attention probabilities over decoder layers; three in four of "
        "Qwen3.5's are Gated DeltaNet layers, which compute none"
    ),
)
DESCRIPTORS = {"qwen3_5": qwen_vl_descriptor(spec, "interleaved_mrope", features=FEATURES)}
