"""Qwen3.5-MoE: Qwen3.5's hybrid decoder and vision tower (:mod:`.qwen3_5`) with a sparse MoE
block in every decoder layer: a softmax top-k router (``Qwen3_5MoeTopKRouter``: softmax over all
experts in float32, top-k, the k weights renormalised to sum to 1), the routed experts
(``Qwen3_5MoeExperts``: stacked ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I], SiLU
gate) and a shared SwiGLU expert scaled by ``sigmoid(shared_expert_gate(x))``."""

from __future__ import annotations

from dataclasses import replace

from ascend_vlm.models._moe_blocks import QWEN3_5_MOE_BLOCKS
from ascend_vlm.models._qwen_vl import qwen_vl_descriptor
from ascend_vlm.models.descriptor import Refused
from ascend_vlm.models.family_spec import ModelSpec
from ascend_vlm.models.qwen3_5 import FEATURES, hybrid_spec


def spec(config) -> ModelSpec:
    return hybrid_spec("Qwen3_5Moe", moes=(QWEN3_5_MOE_BLOCKS,))


MOE_FEATURES = replace(
    FEATURES,
    adapters=Refused(
        "AdapterSet's mixed adapter rows need each adapted layer's input as [rows, tokens, "
        "features]; the sparse MoE block hands its shared expert the tokens flattened"
    ),
)
DESCRIPTORS = {"qwen3_5_moe": qwen_vl_descriptor(spec, "interleaved_mrope", features=MOE_FEATURES)}
