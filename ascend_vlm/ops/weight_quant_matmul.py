"""``weight_quant_matmul``: a linear layer with weight-only quantized weights.

``y = x @ W^T + bias`` with ``W[n, k] = (q[n, k] + offset[k // G, n]) * scale[k // G, n]``: q are
the integer weight values (int8, or int4 packed two per byte in the layout of
:mod:`ascend_vlm.ops.int4_layout`), G the group size along K (``group_size``; 0 means one group
of all K columns, i.e. per-channel scales) and ``offset`` None for symmetric quantization. The
output has x's dtype. :func:`dequantize_weight` is the one home of the dequantization math.

NPU: ``torch_npu.npu_weight_quant_batchmatmul(x (M, K), weight (K, N), antiquant_scale,
antiquant_offset, bias=..., antiquant_group_size=G)`` computes ``x @ ((weight + offset) * scale)
+ bias`` (Ascend/op-plugin docs/zh/custom_APIs/torch_npu/torch_npu-npu_weight_quant_batchmatmul.md;
shared/reference/npu_api.md §1). Its documented limits, and where the op falls back to the
reference instead:

* x 2-D fp16/bf16 (the op flattens leading dims; fp32/fp64 run the reference), at least one row,
  K and N in [1, 65535]; the scale and offset in x's dtype, the bias fp32 for bf16 x and fp16 for
  fp16 x (the op casts these small tensors per call);
* the weight (K, N): the transposed view of our (N, K) int8 rows, which the doc allows;
* per-group scales (``antiquant_group_size`` a multiple of 32 in [32, K-1]) and int4 weights need
  an Atlas A2/A3 SoC (``torch_npu.npu.get_device_name()`` ``Ascend910B*``/``Ascend910_93*``, the
  rule ``ascend_vlm.runtime.capabilities`` uses); Atlas inference cards (``Ascend310P*``) take
  int8 per-channel with fp16 x; other SoCs run the reference. A group size >= K is one group:
  it is passed as per-channel (0).
* int4: the kernel takes ``torch_npu.npu_convert_weight_to_int4pack``'s int32 (N, K/8) packing
  (8 values per int32, order undocumented), transposed. :func:`prepack_int4_for_npu` makes it
  once, when weights are loaded; the op accepts such an int32 weight only on the NPU kernel path.
  Given the library's uint8 layout on the NPU path, the op runs the reference (dequantize and
  matmul on the device): converting per call would repack the whole weight on every token.

CPU: ``torch._weight_int8pack_mm`` (int8 weight (N, K), per-channel scales (N,), no offset, K a
multiple of 32) where it beats dequantize-and-matmul: bf16 activations (its fp32 and fp16 paths
do not; scripts/bench_quant.py measures the bf16 one) and no gradient needed (it has no
derivative). Everything else
dequantizes in x's dtype and runs one matmul: torch's CPU int4 kernel
(``_weight_int4pack_mm_for_cpu``) needs its own blocked packing of the weight, i.e. a repack per
call from the library layout.

Autograd: the gradient of x (and of the floating-point scale, offset and bias) is that of the
dequantize-and-matmul reference; the integer weight gets none. The NPU int32 packing has no
reference, so an int32 weight is forward only.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ascend_vlm._compat.torch_internals import int8_weight_matmul
from ascend_vlm.kernel_backend import active_backend, use_npu_kernels
from ascend_vlm.ops._checks import check_dtype, check_rank, invalid
from ascend_vlm.ops._op_spec import load_spec
from ascend_vlm.ops._registration import define_op
from ascend_vlm.ops.int4_layout import unpack_int4
from ascend_vlm.ops.kernel_constraints import (
    A2_A3_SOC_PREFIXES,
    INT4_PER_INT32,
    weight_quant_batchmatmul_refusal,
)

SPEC = load_spec("weight_quant_matmul")
_X_DTYPES = SPEC.input_dtypes("x")
_SCALE_DTYPES = SPEC.input_dtypes("scale")
_BIAS_DTYPES = SPEC.input_dtypes("bias")
GROUP_SIZE_STEP, GROUP_SIZE_MAX = 32, 256
_INFERENCE_CARD_SOC_PREFIX = "Ascend310P"
# torch._weight_int8pack_mm (CPU, bf16) reads K in blocks: on torch 2.13 a K that is not a
# multiple of 16 gives nan/inf or crashes; multiples of 32 (every model's hidden sizes) keep a
# margin. It also wants x contiguous along K.
_INT8PACK_K_MULTIPLE = 32


class Geometry(NamedTuple):
    """A call's sizes: ``in_features`` K, ``out_features`` N, ``groups`` (scale rows) and
    ``group`` (columns per group: K when there is one group)."""

    in_features: int
    out_features: int
    groups: int
    group: int


def _weight_description(in_features: int) -> str:
    k = in_features
    return (
        f"int8 (N, K={k}) 8-bit values, uint8 (N, ceil(K/2)={(k + 1) // 2}) packed 4-bit values "
        f"or int32 (N, K/8) NPU-prepacked 4-bit values"
    )


def _check_quantized(
    weight: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    group_size: int,
    in_features: int,
) -> Geometry:
    """Validate a quantized weight for ``in_features`` columns; ValueError naming the argument."""
    if group_size != 0 and (
        not GROUP_SIZE_STEP <= group_size <= GROUP_SIZE_MAX or group_size % GROUP_SIZE_STEP
    ):
        raise invalid(
            "group_size",
            f"0 (per channel) or a multiple of {GROUP_SIZE_STEP} in "
            f"[{GROUP_SIZE_STEP}, {GROUP_SIZE_MAX}]",
            group_size,
        )
    check_dtype("scale", scale, _SCALE_DTYPES)
    check_rank("scale", scale, 2, "2-D (ceil(K/group_size), N), or (1, N) per channel")
    groups = 1 if group_size == 0 else -(-in_features // group_size)
    out_features = scale.shape[1]
    if scale.shape[0] != groups or out_features == 0:
        rule = (
            "per channel (group_size=0)"
            if group_size == 0
            else f"ceil(K={in_features} / group_size={group_size}) = {groups} groups"
        )
        raise invalid("scale", f"shape ({groups}, N) with N >= 1, {rule}", tuple(scale.shape))
    if offset is not None and (offset.shape != scale.shape or offset.dtype != scale.dtype):
        raise invalid(
            "offset",
            f"None or the shape {tuple(scale.shape)} and dtype {scale.dtype} of scale",
            f"shape {tuple(offset.shape)} of dtype {offset.dtype}",
        )
    columns = {
        torch.int8: in_features,
        torch.uint8: (in_features + 1) // 2,
        torch.int32: in_features // INT4_PER_INT32,
    }.get(weight.dtype)
    if columns is None:
        raise invalid("weight", _weight_description(in_features), weight.dtype)
    if weight.shape != (out_features, columns) or (
        weight.dtype == torch.int32 and in_features % INT4_PER_INT32
    ):
        expected = f"shape ({out_features}, {columns}) for dtype {weight.dtype}: " + (
            _weight_description(in_features)
            if weight.dtype != torch.int32 or in_features % INT4_PER_INT32 == 0
            else f"an int32 NPU-prepacked weight needs K % 8 == 0 (K={in_features})"
        )
        raise invalid("weight", expected, f"shape {tuple(weight.shape)}")
    group = in_features if groups == 1 else group_size
    return Geometry(in_features, out_features, groups, group)


def _check(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    bias: torch.Tensor | None,
    group_size: int,
) -> Geometry:
    check_dtype("x", x, _X_DTYPES)
    if x.dim() == 0 or x.shape[-1] == 0:
        raise invalid("x", "at least 1-D (..., K) with K >= 1", f"shape {tuple(x.shape)}")
    geometry = _check_quantized(weight, scale, offset, group_size, x.shape[-1])
    if bias is not None:
        check_dtype("bias", bias, _BIAS_DTYPES)
        if bias.shape != (geometry.out_features,):
            raise invalid(
                "bias", f"None or shape ({geometry.out_features},) (N)", tuple(bias.shape)
            )
    return geometry


def dequantize_weight(
    weight: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    group_size: int,
    in_features: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The float weight ``W (N, K)`` of a quantized one, computed in ``dtype``:
    ``W[n, k] = (q[n, k] + offset[k // G, n]) * scale[k // G, n]`` (no offset when None).

    ``weight`` holds q as int8 ``(N, K)`` or packed int4 uint8 ``(N, ceil(K/2))``
    (:mod:`ascend_vlm.ops.int4_layout`); ``scale`` and ``offset`` are ``(ceil(K/G), N)``, or
    ``(1, N)`` for ``group_size`` 0 (per channel); K is ``in_features``. Differentiable in
    ``scale`` and ``offset``. Raises ValueError naming the argument for inconsistent inputs,
    including an int32 NPU-prepacked weight, whose packing has no reference.
    """
    geometry = _check_quantized(weight, scale, offset, group_size, in_features)
    if weight.dtype == torch.int32:
        raise invalid("weight", _reference_weight_rule(), "an int32 NPU-prepacked weight")
    values = unpack_int4(weight, in_features) if weight.dtype == torch.uint8 else weight
    out_features, groups, group = geometry.out_features, geometry.groups, geometry.group
    q = values.to(dtype)
    padding = groups * group - in_features  # the last group may be partial
    if padding:
        q = F.pad(q, (0, padding))
    q = q.view(out_features, groups, group)
    if offset is not None:
        q = q + offset.to(dtype).t().unsqueeze(-1)
    w = (q * scale.to(dtype).t().unsqueeze(-1)).view(out_features, groups * group)
    return w[:, :in_features] if padding else w


def _reference_weight_rule() -> str:
    return (
        "int8 (N, K) or uint8 (N, ceil(K/2)) off the NPU kernel: int32 NPU-prepacked weights "
        "(prepack_int4_for_npu) only run on the NPU kernel, forward only; pass the uint8 "
        "layout instead"
    )


def _reference(
    geometry: Geometry,
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    bias: torch.Tensor | None,
    group_size: int,
) -> torch.Tensor:
    if weight.dtype == torch.int32:
        raise invalid(
            "weight",
            _reference_weight_rule(),
            f"int32 of shape {tuple(weight.shape)} with backend {active_backend()!r} on "
            f"{x.device}" + (" (backward)" if torch.is_grad_enabled() and x.requires_grad else ""),
        )
    if (
        x.dtype == torch.bfloat16
        and weight.dtype == torch.int8
        and geometry.groups == 1
        and offset is None
        and geometry.in_features % _INT8PACK_K_MULTIPLE == 0
        and weight.is_contiguous()
        and x.device.type == "cpu"
        and not (torch.is_grad_enabled() and _any_requires_grad(x, scale, bias))
    ):
        rows = int8_weight_matmul(
            x.reshape(-1, geometry.in_features).contiguous(),
            weight,
            scale[0].to(torch.bfloat16),
        )
        y = rows.reshape(*x.shape[:-1], geometry.out_features)
        return y if bias is None else y + bias.to(x.dtype)
    w = dequantize_weight(weight, scale, offset, group_size, geometry.in_features, x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


def _any_requires_grad(*tensors: torch.Tensor | None) -> bool:
    return any(t is not None and t.requires_grad for t in tensors)


@functools.lru_cache(maxsize=4)
def _soc_support(get_device_name: Callable[[], str]) -> str:
    """``"full"`` (Atlas A2/A3: int8 and int4, per-channel and per-group, fp16/bf16),
    ``"int8_fp16_per_channel"`` (Atlas inference cards) or ``"none"`` for the current device.

    Cached per function, not per call: the SoC does not change within a process, and a test
    replacing ``torch_npu.npu.get_device_name`` gets a fresh answer.
    """
    name = get_device_name()
    if name.startswith(A2_A3_SOC_PREFIXES):
        return "full"
    if name.startswith(_INFERENCE_CARD_SOC_PREFIX):
        return "int8_fp16_per_channel"
    return "none"


def _kernel_takes(geometry: Geometry, x: torch.Tensor, weight: torch.Tensor, torch_npu) -> bool:
    """Whether npu_weight_quant_batchmatmul takes this call (module docstring)."""
    if x.numel() == 0:
        return False
    refusal = weight_quant_batchmatmul_refusal(x.dtype, geometry.in_features, geometry.out_features)
    if refusal is not None:
        return False
    # The doc: an int4 weight of shape (1, 8) passed transposed is refused (K mismatch).
    if weight.dtype == torch.int32 and weight.shape == (INT4_PER_INT32, 1):
        return False
    support = _soc_support(torch_npu.npu.get_device_name)
    if support == "full":
        return True
    return (
        support == "int8_fp16_per_channel"
        and weight.dtype == torch.int8
        and geometry.groups == 1
        and x.dtype == torch.float16
    )


def _npu(
    geometry: Geometry,
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    bias: torch.Tensor | None,
    group_size: int,
) -> torch.Tensor:
    if weight.dtype == torch.uint8:  # the slow path: prepack_int4_for_npu for the kernel
        return _reference(geometry, x, weight, scale, offset, bias, group_size)
    torch_npu = importlib.import_module("torch_npu")
    if not _kernel_takes(geometry, x, weight, torch_npu):
        if weight.dtype == torch.int32:
            raise invalid(
                "x",
                "float16 or bfloat16 (..., K) with at least one row and K, N <= 65535 on an "
                "Atlas A2/A3 NPU for an int32 NPU-prepacked weight (the kernel is its only "
                "implementation)",
                f"{x.dtype} of shape {tuple(x.shape)} with N={geometry.out_features} on "
                f"{torch_npu.npu.get_device_name()}",
            )
        return _reference(geometry, x, weight, scale, offset, bias, group_size)
    dtype = x.dtype
    antiquant_scale = scale if scale.dtype == dtype else scale.to(dtype)
    antiquant_offset = offset if offset is None or offset.dtype == dtype else offset.to(dtype)
    if bias is not None:
        bias_dtype = torch.float32 if dtype == torch.bfloat16 else torch.float16
        bias = bias.to(bias_dtype).contiguous()
    y = torch_npu.npu_weight_quant_batchmatmul(
        x.reshape(-1, geometry.in_features),
        weight.t(),  # (K, N), or (K/8, N) int32: transposed views, as the doc allows
        antiquant_scale,
        antiquant_offset,
        bias=bias,
        antiquant_group_size=group_size if geometry.groups > 1 else 0,
    )
    return y.reshape(*x.shape[:-1], geometry.out_features)


def _fake(
    geometry: Geometry,
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    bias: torch.Tensor | None,
    group_size: int,
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], geometry.out_features))


weight_quant_matmul = define_op(
    SPEC,
    check=_check,
    reference=_reference,
    npu=_npu,
    fake=_fake,
    doc="""Linear layer with quantized weights: ``y = x @ W^T + bias``, output in ``x.dtype``.

    ``W[n, k] = (q[n, k] + offset[k // G, n]) * scale[k // G, n]`` with ``G = group_size``
    (0: per channel, one group of all K columns). ``x`` is ``(..., K)``; ``weight`` holds q as
    int8 ``(N, K)``, as packed int4 uint8 ``(N, ceil(K/2))`` (:mod:`ascend_vlm.ops.int4_layout`)
    or, on the NPU kernel only, as the int32 ``(N, K/8)`` of :func:`prepack_int4_for_npu`;
    ``scale`` is ``(ceil(K/G), N)`` (``(1, N)`` per channel), ``offset`` None (symmetric) or like
    ``scale``, ``bias`` None or ``(N,)``. ``group_size`` is 0 or a multiple of 32 in [32, 256];
    K need not be a multiple of it (the last group is partial).

    Raises ``ValueError`` naming the argument for bad dtypes or shapes, a group size outside
    those rules, or an int32 NPU-prepacked weight off the NPU kernel.
    """,
)


def npu_int4_kernel_takes(x: torch.Tensor, out_features: int) -> bool:
    """Whether :func:`weight_quant_matmul` of activations ``x`` (..., K) with an int32
    NPU-prepacked int4 weight of ``out_features`` rows runs on the NPU kernel: the NPU kernels
    are in use for ``x``, K is a multiple of 8, the kernel takes x's dtype and sizes on this
    SoC, and no gradient of ``x`` is needed (the prepacked form is forward only). Where this is
    False, pass the uint8 layout instead."""
    in_features = x.shape[-1] if x.dim() else 0
    if (
        not use_npu_kernels(x)
        or in_features <= 0
        or in_features % INT4_PER_INT32
        or (torch.is_grad_enabled() and x.requires_grad)
    ):
        return False
    geometry = Geometry(in_features, out_features, 1, in_features)
    shape_only = torch.empty(
        (out_features, in_features // INT4_PER_INT32), dtype=torch.int32, device="meta"
    )
    return _kernel_takes(geometry, x, shape_only, importlib.import_module("torch_npu"))


def prepack_int4_for_npu(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """The int32 ``(N, in_features / 8)`` packing ``torch_npu.npu_convert_weight_to_int4pack``
    makes of a library-layout int4 weight (uint8 ``(N, ceil(K/2))``), which
    :func:`weight_quant_matmul` passes to the NPU kernel as is. Call it once, when the weights
    are loaded: the kernel reads int4 only in this form.

    Raises ValueError for a ``packed`` that is not such a weight or an ``in_features`` that is
    not a multiple of 8 (the converter's rule), RuntimeError when ``packed``'s device does not
    use the NPU kernels (:func:`ascend_vlm.kernel_backend.use_npu_kernels`), where the packing
    could not be used.
    """
    if in_features <= 0 or in_features % INT4_PER_INT32:
        raise invalid(
            "in_features",
            f"a positive multiple of {INT4_PER_INT32} (npu_convert_weight_to_int4pack packs "
            f"{INT4_PER_INT32} int4 values per int32)",
            in_features,
        )
    values = unpack_int4(packed, in_features)
    if not use_npu_kernels(packed):
        raise RuntimeError(
            f"prepack_int4_for_npu: expected a tensor whose device runs the NPU kernels, got "
            f"one on {packed.device} with backend {active_backend()!r}; keep the uint8 layout "
            f"there"
        )
    torch_npu = importlib.import_module("torch_npu")
    return torch_npu.npu_convert_weight_to_int4pack(values.to(torch.int32).contiguous())
