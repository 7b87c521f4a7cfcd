"""Fused ops as ``torch.library`` custom ops in the ``ascend_vlm`` namespace.

Each op (``torch.ops.ascend_vlm.<name>``) has a plain-torch CPU reference, an NPU implementation
calling torch_npu's fused kernel (used when :func:`ascend_vlm.kernel_backend.active_backend` is
"npu" for NPU tensors, or "mock"), a fake implementation for ``torch.compile`` /
``torch.export`` and autograd.
Each op's interface is declared once in ``op_plugins/<name>/spec.json``.

Beside the ops, plain functions composed of them give the semantics model code expects:
``rms_norm_promoting`` (transformers' RMSNorm output dtypes), ``rotary_embedding_pair_vision``
(packed vision RoPE in fp32), ``rotary_embedding_pair_complex`` (Llama 4's complex RoPE),
``packed_attention`` (varlen attention in transformers' layout), ``paged_attention`` (a decode
step over KV kept in blocks) and ``swiglu_projections`` (a
gated MLP's core on top of its projections); and ``attention_probabilities``, the weights an
attention call applies, for the few query rows a caller needs (fused kernels never materialise
them). Beside ``weight_quant_matmul`` (weight-only quantized linear), ``dequantize_weight`` is
its dequantization math and ``prepack_int4_for_npu`` the one-time conversion of int4 weights to
the NPU kernel's packing, which ``npu_int4_kernel_takes`` says a call can use.
"""

from ascend_vlm.ops.attention_probabilities import attention_probabilities
from ascend_vlm.ops.causal_conv1d import causal_conv1d
from ascend_vlm.ops.chunk_gated_delta_rule import chunk_gated_delta_rule
from ascend_vlm.ops.fused_attention import fused_attention
from ascend_vlm.ops.moe_experts import moe_experts
from ascend_vlm.ops.paged_attention import (
    PAGED_KV_KWARG,
    PagedKV,
    gather_blocks,
    paged_attention,
)
from ascend_vlm.ops.recurrent_gated_delta_rule import recurrent_gated_delta_rule
from ascend_vlm.ops.rms_norm import rms_norm, rms_norm_promoting
from ascend_vlm.ops.rotary_embedding import (
    rotary_embedding,
    rotary_embedding_pair,
    rotary_embedding_pair_complex,
    rotary_embedding_pair_vision,
)
from ascend_vlm.ops.swiglu import swiglu, swiglu_projections
from ascend_vlm.ops.varlen_attention import packed_attention, varlen_attention
from ascend_vlm.ops.weight_quant_matmul import (
    dequantize_weight,
    npu_int4_kernel_takes,
    prepack_int4_for_npu,
    weight_quant_matmul,
)

# The torch.library ops (``torch.ops.ascend_vlm.<name>``, one spec.json each); the other public
# names are plain functions composed of them.
OPS = (
    "causal_conv1d",
    "chunk_gated_delta_rule",
    "fused_attention",
    "moe_experts",
    "recurrent_gated_delta_rule",
    "rms_norm",
    "rotary_embedding",
    "rotary_embedding_pair",
    "swiglu",
    "varlen_attention",
    "weight_quant_matmul",
)

__all__ = [
    "OPS",
    "PAGED_KV_KWARG",
    "PagedKV",
    "attention_probabilities",
    "causal_conv1d",
    "chunk_gated_delta_rule",
    "dequantize_weight",
    "fused_attention",
    "gather_blocks",
    "moe_experts",
    "npu_int4_kernel_takes",
    "packed_attention",
    "paged_attention",
    "prepack_int4_for_npu",
    "recurrent_gated_delta_rule",
    "rms_norm",
    "rms_norm_promoting",
    "rotary_embedding",
    "rotary_embedding_pair",
    "rotary_embedding_pair_complex",
    "rotary_embedding_pair_vision",
    "swiglu",
    "swiglu_projections",
    "varlen_attention",
    "weight_quant_matmul",
]
