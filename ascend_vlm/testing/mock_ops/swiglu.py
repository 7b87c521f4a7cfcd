"""Stand-in for ``torch_npu.npu_swiglu`` (doc: ``（beta）torch_npu-npu_swiglu.md``; npu_api.md §1).
Its first parameter is ``input``, the name torch_npu registers (its declaration says ``self``;
torchnpugen renames it)."""

from __future__ import annotations

import torch

from ascend_vlm.ops.kernel_constraints import swiglu_refusal
from ascend_vlm.testing._checks import bad, refuse


def npu_swiglu(input: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Stand-in for ``torch_npu.npu_swiglu``: ``silu(A) * B`` with A the FIRST half of
    ``input`` along ``dim``; the input must be contiguous, 1-8 dims."""
    refusal = swiglu_refusal(input.dtype, input.dim())
    if refusal is not None:
        raise refuse("npu_swiglu", refusal)
    if not input.is_contiguous():
        raise bad("input", "a contiguous tensor", f"strides {input.stride()}")
    if not -input.dim() <= dim < input.dim() or input.shape[dim] % 2:
        raise bad("dim", f"a dim of {tuple(input.shape)} with an even size", dim)
    first, second = input.float().chunk(2, dim=dim)
    return (torch.nn.functional.silu(first) * second).to(input.dtype)
