"""``swiglu``: ``silu(a) * b`` with ``a, b = x.chunk(2, dim)`` (the first half is gated).

NPU: ``torch_npu.npu_swiglu(x, dim)`` — same first-half convention, needs a contiguous input
(Ascend/op-plugin docs/zh/custom_APIs/torch_npu/（beta）torch_npu-npu_swiglu.md).
``swiglu_projections`` builds that input from a gated MLP's two projections (not an op itself).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ascend_vlm.kernel_backend import use_npu_kernels
from ascend_vlm.ops._checks import check_dtype, check_same_dtype, invalid
from ascend_vlm.ops._op_spec import load_spec
from ascend_vlm.ops._registration import define_op
from ascend_vlm.ops.kernel_constraints import swiglu_refusal

SPEC = load_spec("swiglu")
_X_DTYPES = SPEC.input_dtypes("x")


def _check(x: torch.Tensor, dim: int) -> int:
    """Validate and return the size of each half along ``dim``."""
    check_dtype("x", x, _X_DTYPES)
    if x.dim() == 0:
        raise invalid("x", "at least 1-D", "a 0-D tensor")
    if not -x.dim() <= dim < x.dim():
        raise invalid("dim", f"in [{-x.dim()}, {x.dim() - 1}] for x of shape {tuple(x.shape)}", dim)
    if x.shape[dim] % 2:
        raise invalid("x", f"an even size along dim {dim}", f"shape {tuple(x.shape)}")
    return x.shape[dim] // 2


def _reference(_half: int, x: torch.Tensor, dim: int) -> torch.Tensor:
    gate, up = x.chunk(2, dim)
    return F.silu(gate) * up


def _npu(half: int, x: torch.Tensor, dim: int) -> torch.Tensor:
    if swiglu_refusal(x.dtype, x.dim()) is not None:
        return _reference(half, x, dim)
    torch_npu = importlib.import_module("torch_npu")
    return torch_npu.npu_swiglu(x.contiguous(), dim=dim)


def _fake(half: int, x: torch.Tensor, dim: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = half
    return x.new_empty(shape)


swiglu = define_op(
    SPEC,
    check=_check,
    reference=_reference,
    npu=_npu,
    fake=_fake,
    doc="""SwiGLU: ``silu(a) * b`` where ``a, b = x.chunk(2, dim)``; the output halves ``dim``.

    Raises ``ValueError`` for an odd size along ``dim``, an out-of-range ``dim`` or an
    unsupported dtype.
    """,
)


def swiglu_projections(
    x: torch.Tensor,
    gate_proj: Callable[[torch.Tensor], torch.Tensor],
    up_proj: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """A gated MLP's core, ``silu(gate_proj(x)) * up_proj(x)``, on top of its two projections.

    When the fused kernel runs (:func:`ascend_vlm.kernel_backend.use_npu_kernels`) this is
    ``swiglu(cat(gate_proj(x), up_proj(x)))``. Otherwise the formula runs in transformers' order
    (gate, activation, up, product): no concatenation copy, and the gate's pre-activation is
    freed before ``up_proj`` runs, so peak memory is that of the unpatched MLP. Raises
    ``ValueError`` when the two projections disagree in shape or dtype or the dtype is
    unsupported.
    """
    if use_npu_kernels(x):
        gate, up = gate_proj(x), up_proj(x)
        _check_halves(gate, up)
        return swiglu(torch.cat((gate, up), dim=-1))
    gate = gate_proj(x)
    if gate.dtype not in _X_DTYPES:  # before silu, which would reject it less clearly
        check_dtype("gate_proj(x)", gate, _X_DTYPES)
    activated = F.silu(gate)
    del gate  # freed before up_proj runs
    up = up_proj(x)
    if up.dtype != activated.dtype or up.shape != activated.shape:
        _check_halves(activated, up)
    return activated * up


def _check_halves(gate: torch.Tensor, up: torch.Tensor) -> None:
    if up.shape != gate.shape:
        raise invalid(
            "up_proj(x)", f"shape {tuple(gate.shape)} like gate_proj(x)", f"shape {tuple(up.shape)}"
        )
    check_same_dtype("up_proj(x)", up, "gate_proj(x)", gate.dtype)
