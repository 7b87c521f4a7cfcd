"""Stand-in for ``torch_npu.npu_swiglu`` (doc: ``（beta）torch_npu-npu_swiglu.md``; npu_api.md §1).
Its first parameter is ``input``, the name torch_npu registers (its declaration says ``self``;
torchnpugen renames it)."""

from __future__ import annotations

import torch

from ascend_vlm.testing._checks import bad, check_dtype

SWIGLU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def npu_swiglu(input: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Stand-in for ``torch_npu.npu_swiglu``: ``silu(A) * B`` with A the FIRST half of
    ``input`` along ``dim``; the input must be contiguous, 1-8 dims."""
    check_dtype("input", input, SWIGLU_DTYPES)
    if not 1 <= input.dim() <= 8:
        raise bad("input", "1 to 8 dims", f"shape {tuple(input.shape)}")
    if not input.is_contiguous():
        raise bad("input", "a contiguous tensor", f"strides {input.stride()}")
    if not -input.dim() <= dim < input.dim() or input.shape[dim] % 2:
        raise bad("dim", f"a dim of {tuple(input.shape)} with an even size", dim)
    first, second = input.float().chunk(2, dim=dim)
    return (torch.nn.functional.silu(first) * second).to(input.dtype)
