"""Stand-in for ``torch_npu.npu_rms_norm`` (doc: ``（beta）torch_npu-npu_rms_norm.md``; npu_api.md
§1). Its first parameter is ``input``, the name torch_npu registers (its declaration says
``self``; torchnpugen renames it)."""

from __future__ import annotations

import torch

from ascend_vlm.ops.kernel_constraints import rms_norm_refusal
from ascend_vlm.testing._checks import bad, refuse


def npu_rms_norm(
    input: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-in for ``torch_npu.npu_rms_norm``: ``y = x / sqrt(mean(x^2) + eps) * gamma`` over
    the trailing ``gamma.dim()`` dims; returns ``(y in x.dtype, rstd in fp32)``. x has 2-8 dims;
    (x, gamma) dtypes follow the A2/A3 table (fp32 gamma allowed for fp16/bf16 x)."""
    refusal = rms_norm_refusal(input.dtype, gamma.dtype, input.dim())
    if refusal is not None:
        raise refuse("npu_rms_norm", refusal)
    if (
        gamma.dim() == 0
        or gamma.dim() > input.dim()
        or (tuple(gamma.shape) != tuple(input.shape[input.dim() - gamma.dim() :]))
    ):
        raise bad("gamma", "the trailing dims of input", f"shape {tuple(gamma.shape)}")
    reduce_dims = tuple(range(input.dim() - gamma.dim(), input.dim()))
    x = input.float()
    # UNVERIFIED: rstd keeps the normalised dims as size 1 (the doc only says it has the
    # leading dims of input).
    rstd = torch.rsqrt(x.pow(2).mean(dim=reduce_dims, keepdim=True) + epsilon)
    return (x * rstd * gamma.float()).to(input.dtype), rstd
