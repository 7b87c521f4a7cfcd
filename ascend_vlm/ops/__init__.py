"""Fused ops as ``torch.library`` custom ops in the ``ascend_vlm`` namespace.

Each op (``torch.ops.ascend_vlm.<name>``) has a plain-torch CPU reference, an NPU implementation
calling torch_npu's fused kernel (used when :func:`ascend_vlm.kernel_backend.active_backend` is
"npu" for NPU tensors, or "mock"), a fake implementation for ``torch.compile`` /
``torch.export`` and autograd.
Each op's interface is declared once in ``op_plugins/<name>/spec.json``.
"""

from ascend_vlm.ops.fused_attention import fused_attention
from ascend_vlm.ops.rms_norm import rms_norm
from ascend_vlm.ops.rotary_embedding import rotary_embedding, rotary_embedding_pair
from ascend_vlm.ops.swiglu import swiglu
from ascend_vlm.ops.varlen_attention import varlen_attention

__all__ = [
    "fused_attention",
    "rms_norm",
    "rotary_embedding",
    "rotary_embedding_pair",
    "swiglu",
    "varlen_attention",
]
