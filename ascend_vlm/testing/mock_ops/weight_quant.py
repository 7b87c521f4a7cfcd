"""Stand-ins for ``torch_npu.npu_weight_quant_batchmatmul`` and
``torch_npu.npu_convert_weight_to_int4pack`` (docs: ``torch_npu-npu_weight_quant_batchmatmul.md``,
``torch_npu-npu_convert_weight_to_int4pack.md``; npu_api.md §1), sharing the mock's int4 packing
order (Atlas A2/A3 contract)."""

from __future__ import annotations

import torch

from ascend_vlm.ops.kernel_constraints import (
    INT4_PER_INT32,
    WEIGHT_QUANT_GROUP_STEP,
    WEIGHT_QUANT_X_DTYPES,
    convert_weight_to_int4pack_refusal,
    weight_quant_batchmatmul_refusal,
)
from ascend_vlm.testing._checks import bad, check_dtype, refuse


def _pack_int4_words(values: torch.Tensor) -> torch.Tensor:
    """int32 ``(R, C)`` in [-8, 7] -> int32 ``(R, C/8)``: value ``8j + i`` of a row in bits
    ``4i..4i+3`` of word ``j`` (two's-complement nibbles). UNVERIFIED: the doc only says "8 int4
    per int32, interleaved"; this order is the mock's own, and :func:`_unpack_int4_words` (what
    the mock matmul reads) is its exact inverse."""
    nibbles = (values.to(torch.int64) & 0xF).reshape(values.shape[0], -1, INT4_PER_INT32)
    shifts = torch.arange(0, 4 * INT4_PER_INT32, 4, dtype=torch.int64)
    words = (nibbles << shifts).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _unpack_int4_words(words: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_pack_int4_words`: int32 ``(R, C/8)`` -> int64 ``(R, C)`` in [-8, 7]."""
    shifts = torch.arange(0, 4 * INT4_PER_INT32, 4, dtype=torch.int64)
    nibbles = ((words.to(torch.int64) & 0xFFFFFFFF)[..., None] >> shifts) & 0xF
    return (nibbles - ((nibbles & 0x8) << 1)).reshape(words.shape[0], -1)


def npu_convert_weight_to_int4pack(weight: torch.Tensor, inner_k_tiles: int = 0) -> torch.Tensor:
    """Stand-in for ``torch_npu.npu_convert_weight_to_int4pack``: a contiguous 2-D int32 weight
    ``(k, n)`` or ``(n, k)`` of int4 values in [-8, 7], last dim a multiple of 8, packed into
    int32 ``(k, n/8)`` / ``(n, k/8)``, 8 values per int32 (order: :func:`_pack_int4_words`,
    UNVERIFIED). ``inner_k_tiles`` is reserved (ignored, as documented)."""
    check_dtype("weight", weight, (torch.int32,))
    if weight.dim() != 2:
        raise bad("weight", "a 2-D (k, n) or (n, k) tensor", f"shape {tuple(weight.shape)}")
    if not weight.is_contiguous():
        raise bad("weight", "a contiguous tensor", f"strides {weight.stride()}")
    refusal = convert_weight_to_int4pack_refusal(weight.shape[1])
    if refusal is not None:
        raise refuse("npu_convert_weight_to_int4pack", refusal)
    if weight.numel() and (weight.min() < -8 or weight.max() > 7):
        raise bad(
            "weight",
            "int4 values in [-8, 7]",
            f"values in [{int(weight.min())}, {int(weight.max())}]",
        )
    return _pack_int4_words(weight)


def _transposed(tensor: torch.Tensor) -> bool:
    """A transposed view of a contiguous matrix (op-plugin's is_transpose_last_two_dims; a 1x1
    matrix counts as not transposed)."""
    return tensor.stride() == (1, tensor.shape[0]) and tensor.numel() > 1


def _quant_weight_kn(weight: torch.Tensor) -> torch.Tensor:
    """The (K, N) int values of an int8 or int4-packed int32 weight. An int32 weight packs 8
    values per element along its storage's last dim: K = 8 * rows when passed transposed
    ((n, k/8) storage), else N = 8 * columns ((k, n/8) storage)."""
    if weight.dtype == torch.int8:
        return weight.to(torch.int64)
    if _transposed(weight):
        return _unpack_int4_words(weight.t()).t()
    return _unpack_int4_words(weight)


def _check_antiquant_tables(
    antiquant_scale: torch.Tensor,
    antiquant_offset: torch.Tensor | None,
    x_dtype: torch.dtype,
    k: int,
    n: int,
    group: int,
) -> None:
    """Scale/offset per tensor, per channel or per group, in x's dtype."""
    if antiquant_scale.dtype != x_dtype:
        raise bad("antiquant_scale", f"dtype {x_dtype} like x", antiquant_scale.dtype)
    shape = tuple(antiquant_scale.shape)
    allowed = [(-(-k // group), n)] if group else [(1,), (1, 1), (1, n), (n,)]
    if shape not in allowed:
        raise bad("antiquant_scale", f"a shape in {allowed} (group size {group})", shape)
    if antiquant_offset is None:
        return
    if antiquant_offset.dtype != antiquant_scale.dtype:
        raise bad(
            "antiquant_offset",
            f"dtype {antiquant_scale.dtype} like antiquant_scale",
            antiquant_offset.dtype,
        )
    if tuple(antiquant_offset.shape) != shape:
        raise bad("antiquant_offset", f"shape {shape} like antiquant_scale", antiquant_offset.shape)


def _check_bias(bias: torch.Tensor, x_dtype: torch.dtype, n: int) -> None:
    """Bias (N,) or (1, N), contiguous, fp32 for bf16 x and fp16 for fp16 x."""
    bias_dtype = torch.float32 if x_dtype == torch.bfloat16 else torch.float16
    if bias.dtype != bias_dtype:
        raise bad("bias", f"dtype {bias_dtype} for x of dtype {x_dtype}", bias.dtype)
    if tuple(bias.shape) not in ((n,), (1, n)):
        raise bad("bias", f"shape ({n},) or (1, {n})", tuple(bias.shape))
    if not bias.is_contiguous():
        raise bad("bias", "a contiguous tensor", f"strides {bias.stride()}")


def _dequantized_weight(
    w: torch.Tensor,
    antiquant_scale: torch.Tensor,
    antiquant_offset: torch.Tensor | None,
    group: int,
) -> torch.Tensor:
    """``(w + offset) * scale`` in fp32 as (K, N), each table repeated over its group's rows."""
    k, n = w.shape

    def per_row_of_k(table: torch.Tensor) -> torch.Tensor:
        """A scale/offset table as (K, N) (or broadcastable), in fp32."""
        table = table.float().reshape(-1, n) if table.numel() > 1 else table.float().reshape(1, 1)
        return table.repeat_interleave(group, dim=0)[:k] if group else table

    dequantized = w.float()
    if antiquant_offset is not None:
        dequantized = dequantized + per_row_of_k(antiquant_offset)
    return dequantized * per_row_of_k(antiquant_scale)


def npu_weight_quant_batchmatmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    antiquant_scale: torch.Tensor,
    antiquant_offset: torch.Tensor | None = None,
    quant_scale: torch.Tensor | None = None,
    quant_offset: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    antiquant_group_size: int = 0,
    inner_precise: int = 0,
    weight_dtype: int | None = None,
) -> torch.Tensor:
    """Stand-in for ``torch_npu.npu_weight_quant_batchmatmul`` (Atlas A2/A3 contract):
    ``y = x @ ((weight + antiquant_offset) * antiquant_scale) + bias`` in x's dtype; the offset
    is ADDED. x (M, K) fp16/bf16; weight (K, N) int8, or int32 carrying int4 (from
    :func:`npu_convert_weight_to_int4pack`; passed transposed, K = 8 * rows); K, N in
    [1, 65535]; scale/offset per tensor (1,)/(1, 1), per channel (1, N)/(N,) or per group
    (ceil(K/G), N), in x's dtype; group size 0 or a multiple of 32 in [32, K-1]; bias (N,) or
    (1, N), contiguous, fp32 for bf16 x and fp16 for fp16 x. The dequantized weight and the
    product are computed in fp32 here (the kernel's internal precision is UNVERIFIED). Output
    quantization (``quant_scale``), int64 scales and ``weight_dtype`` (undocumented; the mock
    reads int4 from the int32 packing) raise ``NotImplementedError``."""
    if quant_scale is not None or quant_offset is not None:
        raise NotImplementedError(
            "mock npu_weight_quant_batchmatmul: quant_scale/quant_offset are not implemented"
        )
    if weight_dtype is not None:
        raise NotImplementedError(
            f"mock npu_weight_quant_batchmatmul: weight_dtype={weight_dtype} is not implemented"
        )
    check_dtype("x", x, WEIGHT_QUANT_X_DTYPES)
    if x.dim() != 2:
        raise bad("x", "2-D (M, K)", f"shape {tuple(x.shape)}")
    if antiquant_scale.dtype == torch.int64:
        raise NotImplementedError("mock npu_weight_quant_batchmatmul: int64 scales")
    check_dtype("weight", weight, (torch.int8, torch.int32))
    if weight.dim() != 2:
        raise bad("weight", "2-D (K, N)", f"shape {tuple(weight.shape)}")
    if weight.dtype == torch.int32 and _transposed(weight) and weight.shape == (1, 8):
        raise bad("weight", "not an int4 (1, 8) weight passed transposed", "that case")
    w = _quant_weight_kn(weight)
    (m, k), n = x.shape, w.shape[1]
    if w.shape[0] != k:
        raise bad("weight", f"K={k} rows like x (M, K) (int4: 8 per int32 row)", tuple(w.shape))
    if m == 0:
        raise bad("x/weight", "M >= 1 rows", (m, k, n))
    refusal = weight_quant_batchmatmul_refusal(x.dtype, k, n)
    if refusal is not None:
        raise refuse("npu_weight_quant_batchmatmul", refusal)
    group = antiquant_group_size
    step = WEIGHT_QUANT_GROUP_STEP
    if not isinstance(inner_precise, int) or inner_precise not in (0, 1):
        raise bad("inner_precise", "0 or 1", inner_precise)
    if group != 0 and not (step <= group <= k - 1 and group % step == 0):
        raise bad(
            "antiquant_group_size", f"0 or a multiple of {step} in [{step}, K-1={k - 1}]", group
        )
    _check_antiquant_tables(antiquant_scale, antiquant_offset, x.dtype, k, n, group)
    if bias is not None:
        _check_bias(bias, x.dtype, n)
    y = x.float() @ _dequantized_weight(w, antiquant_scale, antiquant_offset, group)
    if bias is not None:
        y = y + bias.float().reshape(1, n)
    return y.to(x.dtype)
