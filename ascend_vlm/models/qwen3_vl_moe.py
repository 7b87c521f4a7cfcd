"""Qwen3-VL-MoE: Qwen3-VL (same attention, norms, RoPE and vision tower) whose decoder layers
carry sparse MoE blocks (softmax top-k router, no shared expert); layers listed in
``mlp_only_layers`` keep a dense gated MLP."""

from __future__ import annotations

from dataclasses import replace

from ascend_vlm.models._moe_blocks import QWEN3_VL_MOE_BLOCKS
from ascend_vlm.models._qwen_vl import qwen_vl_descriptor
from ascend_vlm.models.family_spec import ModelSpec, PartSpec
from ascend_vlm.models.qwen3_vl import DEEPSTACK, POSITION_SCHEME, qwen3_vl_spec


def spec(config) -> ModelSpec:
    dense = qwen3_vl_spec("Qwen3VLMoe")
    return replace(dense, text=dense.text + PartSpec(moes=(QWEN3_VL_MOE_BLOCKS,)))


DESCRIPTORS = {"qwen3_vl_moe": qwen_vl_descriptor(spec, POSITION_SCHEME, deepstack=DEEPSTACK)}
