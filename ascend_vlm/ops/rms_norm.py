"""``rms_norm``: ``y = x * rsqrt(mean(x^2, -1) + eps) * (offset + weight)`` in fp32, cast back.

NPU: ``torch_npu.npu_rms_norm(x, gamma, epsilon)`` returns ``(y, rstd)``; we take ``[0]``. gamma
may be fp32 for fp16/bf16 x (Ascend/op-plugin docs/zh/custom_APIs/torch_npu/
（beta）torch_npu-npu_rms_norm.md), which keeps ``offset + weight`` exact. The kernel takes 2-8
dims (:func:`~ascend_vlm.ops.kernel_constraints.rms_norm_refusal`): other ranks go to it as
``[rows, H]``; float64 runs the reference.
"""

from __future__ import annotations

import importlib

import torch

from ascend_vlm.ops._checks import check_dtype, check_rank, invalid
from ascend_vlm.ops._op_spec import load_spec
from ascend_vlm.ops._registration import define_op, empty_like_first_input
from ascend_vlm.ops.kernel_constraints import NPU_DTYPES, RMS_NORM_RANKS, rms_norm_refusal

SPEC = load_spec("rms_norm")
_X_DTYPES = SPEC.input_dtypes("x")
_WEIGHT_DTYPES = SPEC.input_dtypes("weight")
_COMPUTE_DTYPES = (torch.float32, torch.float64)  # promote_types(x.dtype, float32) keeps these


def _check(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> None:
    if (  # every rule below at once; the named checks only run to explain a failure
        x.dtype in _X_DTYPES
        and weight.dtype in _WEIGHT_DTYPES
        and x.dim()
        and weight.dim() == 1
        and weight.shape[0] == x.shape[-1]
        and eps >= 0
    ):
        return
    check_dtype("x", x, _X_DTYPES)
    check_dtype("weight", weight, _WEIGHT_DTYPES)
    if x.dim() == 0:
        raise invalid("x", "at least 1-D [..., H]", "a 0-D tensor")
    check_rank("weight", weight, 1, f"1-D [H={x.shape[-1]}]")
    if weight.shape[0] != x.shape[-1]:
        raise invalid(
            "weight", f"shape ({x.shape[-1]},) matching x's last dim", tuple(weight.shape)
        )
    if not eps >= 0:
        raise invalid("eps", "a float >= 0", eps)


def _reference(
    _checked: None, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
) -> torch.Tensor:
    dtype = x.dtype
    # Conversions only when needed: in fp32 models each no-op `.to` is a measurable share of a
    # small norm's time (scripts/bench_patch.py).
    compute_dtype = dtype if dtype in _COMPUTE_DTYPES else torch.float32
    gamma = weight if weight.dtype == compute_dtype else weight.to(compute_dtype)
    if offset:
        gamma = gamma + offset
    x_compute = x if dtype == compute_dtype else x.to(compute_dtype)
    # torch.rms_norm, not F.rms_norm: the functional form is a Python wrapper around it.
    y = torch.rms_norm(x_compute, (x.shape[-1],), gamma, eps)
    return y if y.dtype == dtype else y.to(dtype)


def _npu(
    _checked: None, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
) -> torch.Tensor:
    if weight.dtype not in NPU_DTYPES:
        return _reference(None, x, weight, eps, offset)
    gamma = weight if (not offset and weight.dtype == x.dtype) else weight.float() + offset
    # the norm is per row, so an x of another rank goes to the kernel as [rows, H]
    rank = x.dim() if RMS_NORM_RANKS[0] <= x.dim() <= RMS_NORM_RANKS[1] else 2
    if rms_norm_refusal(x.dtype, gamma.dtype, rank) is not None:
        return _reference(None, x, weight, eps, offset)
    torch_npu = importlib.import_module("torch_npu")
    if rank == x.dim():
        return torch_npu.npu_rms_norm(x, gamma, epsilon=eps)[0]
    rows = x.reshape(-1, x.shape[-1])
    return torch_npu.npu_rms_norm(rows, gamma, epsilon=eps)[0].reshape(x.shape)


rms_norm = define_op(
    SPEC,
    check=_check,
    reference=_reference,
    npu=_npu,
    fake=empty_like_first_input,
    doc="""RMSNorm over the last dim: ``x * rsqrt(mean(x^2) + eps) * (offset + weight)``.

    Computed in fp32 (fp64 for fp64 input) and returned in ``x.dtype``; ``offset=1.0`` is Gemma's
    ``(1 + weight)`` convention. ``weight`` is 1-D of size ``x.shape[-1]``. Bad inputs raise
    ``ValueError`` naming the argument.
    """,
)


def rms_norm_promoting(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, offset: float = 0.0
) -> torch.Tensor:
    """RMSNorm with the output dtype transformers' RMSNorm modules give, for any weight dtype.

    With ``x_norm = x * rsqrt(mean(x^2, -1) + eps)`` computed in fp32:

    * ``offset != 0`` (Gemma: ``(x_norm * (offset + weight)).to(x.dtype)``) or ``weight.dtype ==
      x.dtype``: exactly :func:`rms_norm`, output in ``x.dtype``. (Llama-style modules round
      ``x_norm`` to ``x.dtype`` before the product and round again after it; :func:`rms_norm`
      rounds once, so the two agree within one unit of the last place of ``x.dtype``.)
    * ``offset == 0`` and ``weight.dtype != x.dtype`` (Llama: ``weight * x_norm.to(x.dtype)``,
      e.g. fp32 weights on bf16 activations): ``weight * rms_norm(x, ones)``, output in
      ``torch.promote_types(weight.dtype, x.dtype)``.

    ``weight`` is 1-D of size ``x.shape[-1]``. Raises ValueError naming the argument for bad
    shapes or dtypes.
    """
    if offset or weight.dtype == x.dtype:
        return rms_norm(x, weight, eps, offset=offset)
    if not weight.is_floating_point():
        raise invalid("weight", "a floating-point dtype", weight.dtype)
    unit = torch.ones(weight.shape, dtype=x.dtype, device=x.device)  # shape checked by rms_norm
    return weight * rms_norm(x, unit, eps)
