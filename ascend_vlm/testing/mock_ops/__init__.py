"""The stand-in torch_npu kernels of the mock NPU, one module per kernel (as in ``ops/``).

Each re-implements the documented contract of the real kernel on CPU tensors, independently of
:mod:`ascend_vlm.ops`, with torch_npu's registered signature (``testing/torch_npu_schemas.json``):
argument validation (``ValueError`` naming the argument, expected and got), layouts, dtype
support and the return structure. A call outside a kernel's documented limits (head dims, head
counts, sequence lengths, ranks: :mod:`ascend_vlm.ops.kernel_constraints`, the one table the
ops' NPU paths read too) raises ``testing._checks.KernelRefused``, a RuntimeError in torch_npu's
message style (and a ValueError). What the docs leave open is marked UNVERIFIED and chosen to be
conservative; what the mock does not model raises ``NotImplementedError`` naming it.
"""

from ascend_vlm.testing.mock_ops.fused_causal_conv1d import npu_fused_causal_conv1d
from ascend_vlm.testing.mock_ops.fused_infer_attention import npu_fused_infer_attention_score
from ascend_vlm.testing.mock_ops.fusion_attention import npu_fusion_attention
from ascend_vlm.testing.mock_ops.gated_delta_rule import (
    npu_chunk_gated_delta_rule,
    npu_recurrent_gated_delta_rule,
)
from ascend_vlm.testing.mock_ops.grouped_matmul import npu_grouped_matmul
from ascend_vlm.testing.mock_ops.moe_token_permute import (
    npu_moe_token_permute,
    npu_moe_token_unpermute,
)
from ascend_vlm.testing.mock_ops.rms_norm import npu_rms_norm
from ascend_vlm.testing.mock_ops.rotary_mul import npu_rotary_mul
from ascend_vlm.testing.mock_ops.swiglu import npu_swiglu
from ascend_vlm.testing.mock_ops.weight_quant import (
    npu_convert_weight_to_int4pack,
    npu_weight_quant_batchmatmul,
)

# What the mock torch_npu module carries, by the name torch_npu gives each.
MOCK_OPS = {
    op.__name__: op
    for op in (
        npu_chunk_gated_delta_rule,
        npu_convert_weight_to_int4pack,
        npu_fused_causal_conv1d,
        npu_fused_infer_attention_score,
        npu_fusion_attention,
        npu_grouped_matmul,
        npu_moe_token_permute,
        npu_moe_token_unpermute,
        npu_recurrent_gated_delta_rule,
        npu_rms_norm,
        npu_rotary_mul,
        npu_swiglu,
        npu_weight_quant_batchmatmul,
    )
}

__all__ = [
    "MOCK_OPS",
    "npu_chunk_gated_delta_rule",
    "npu_convert_weight_to_int4pack",
    "npu_fused_causal_conv1d",
    "npu_fused_infer_attention_score",
    "npu_fusion_attention",
    "npu_grouped_matmul",
    "npu_moe_token_permute",
    "npu_moe_token_unpermute",
    "npu_recurrent_gated_delta_rule",
    "npu_rms_norm",
    "npu_rotary_mul",
    "npu_swiglu",
    "npu_weight_quant_batchmatmul",
]
