"""What the torch_npu fused kernels accept, shared by the ops that call them (one home each).

* ``NPU_DTYPES``: npu_fusion_attention, npu_rms_norm, npu_rotary_mul and npu_swiglu all take
  fp16, bf16 and fp32 (Ascend/op-plugin docs/zh/custom_APIs/torch_npu/, one page per kernel;
  shared/reference/npu_api.md); float64 stays on the reference implementations.
* ``npu_fusion_attention`` geometry (doc "约束说明"): query heads 1..256, head dim 1..768, in
  BNSD/BSH (``ops.fused_attention``) and TND (``ops.varlen_attention``) layouts alike.
* ``A2_A3_SOC_PREFIXES``: the names ``torch_npu.npu.get_device_name()`` gives Atlas A2/A3 SoCs,
  the products npu_weight_quant_batchmatmul's per-group/int4 modes and the MoE kernels
  (``ops.moe_experts``) are documented for.
"""

from __future__ import annotations

import torch

NPU_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})
NPU_FUSION_ATTENTION_MAX_QUERY_HEADS = 256
NPU_FUSION_ATTENTION_MAX_HEAD_DIM = 768
A2_A3_SOC_PREFIXES = ("Ascend910B", "Ascend910_93")


def fits_npu_fusion_attention(dtype: torch.dtype, num_heads: int, head_dim: int) -> bool:
    """Whether npu_fusion_attention takes this dtype, query head count and head dim."""
    return (
        dtype in NPU_DTYPES
        and 1 <= num_heads <= NPU_FUSION_ATTENTION_MAX_QUERY_HEADS
        and 1 <= head_dim <= NPU_FUSION_ATTENTION_MAX_HEAD_DIM
    )
