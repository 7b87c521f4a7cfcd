"""Stand-in for ``torch_npu.npu_grouped_matmul`` (doc: the ``_op_plugin_docs.py`` of the torch-npu
wheels), in the one scenario the mock models: the non-quantized "单单单" call (group_type 0, one
x, one 3-D weight, one output) with a group_list tensor, as MoE experts use it. The other
scenarios (lists of tensors, group_type -1/1/2, quantization, bias) raise
``NotImplementedError`` naming what was asked."""

from __future__ import annotations

import torch

from ascend_vlm.ops.kernel_constraints import (
    GROUPED_MATMUL_MAX_GROUPS,
    NPU_DTYPES,
    grouped_matmul_refusal,
)
from ascend_vlm.testing._checks import bad, check_dtype, refuse


def _rows_per_group(
    group_list: torch.Tensor, group_list_type: int, groups: int, m: int
) -> list[int]:
    """The rows of x each group owns: group_list holds cumulative ends (type 0, non-decreasing,
    the last equal to M) or counts (type 1, summing to M), one per weight group."""
    check_dtype("group_list", group_list, (torch.int64,))
    if group_list.shape != (groups,) or groups > GROUPED_MATMUL_MAX_GROUPS:
        raise bad(
            "group_list",
            f"1-D of length {groups} (the weight's groups) <= {GROUPED_MATMUL_MAX_GROUPS}",
            tuple(group_list.shape),
        )
    values = [int(v) for v in group_list]
    if group_list_type == 0:
        counts = [b - a for a, b in zip([0, *values[:-1]], values, strict=True)]
        ends_ok = min(counts) >= 0 and values[-1] == m
        if not ends_ok:
            raise bad(
                "group_list",
                f"non-decreasing non-negative cumulative ends, the last M={m} (group_list_type 0)",
                values,
            )
        return counts
    if group_list_type == 1:
        if groups == 1 or min(values) < 0 or sum(values) != m:
            raise bad(
                "group_list",
                f"non-negative counts summing to M={m}, length != 1 (group_list_type 1)",
                values,
            )
        return values
    raise bad("group_list_type", "0 (cumsum) or 1 (counts)", group_list_type)


def npu_grouped_matmul(
    x: list[torch.Tensor],
    weight: list[torch.Tensor],
    *,
    bias: list[torch.Tensor] | None = None,
    scale: list[torch.Tensor] | None = None,
    offset: list[torch.Tensor] | None = None,
    antiquant_scale: list[torch.Tensor] | None = None,
    antiquant_offset: list[torch.Tensor] | None = None,
    per_token_scale: list[torch.Tensor] | None = None,
    group_list: torch.Tensor | None = None,
    activation_input: list[torch.Tensor] | None = None,
    activation_quant_scale: list[torch.Tensor] | None = None,
    activation_quant_offset: list[torch.Tensor] | None = None,
    split_item: int | None = 0,
    group_type: int | None = None,
    group_list_type: int | None = 0,
    act_type: int | None = 0,
    tuning_config: list[int] | None = None,
    output_dtype: int | None = None,
    x_dtype: int | None = None,
    weight_dtype: int | None = None,
    scale_dtype: int | None = None,
    per_token_scale_dtype: int | None = None,
) -> list[torch.Tensor]:
    """Stand-in for ``torch_npu.npu_grouped_matmul``, non-quantized "单单单" scenario:
    ``y[rows of group g] = x[rows of group g] @ weight[0][g]`` for x ``[(M, K)]`` and weight
    ``[(G, K, N)]`` (a transposed view of (G, N, K) allowed; x not transposed), group_list a
    tensor (``group_list_type`` 0: cumulative ends, 1: counts), ``group_type=0``,
    ``split_item`` 2 or 3; fp16/bf16/fp32 with weight in x's dtype; K and N below 65536; at most
    1024 groups. Returns ``[y (M, N)]`` in x's dtype, computed in fp32 here (the kernel's
    internal precision is UNVERIFIED). ``act_type`` other than 0 is documented for per-token
    quantization only and raises; ``tuning_config`` is a performance hint and is ignored."""
    unsupported = {
        "bias": bias,
        "scale": scale,
        "offset": offset,
        "antiquant_scale": antiquant_scale,
        "antiquant_offset": antiquant_offset,
        "per_token_scale": per_token_scale,
        "activation_input": activation_input,
        "activation_quant_scale": activation_quant_scale,
        "activation_quant_offset": activation_quant_offset,
        "output_dtype": output_dtype,
        "x_dtype": x_dtype,
        "weight_dtype": weight_dtype,
        "scale_dtype": scale_dtype,
        "per_token_scale_dtype": per_token_scale_dtype,
    }
    given = sorted(name for name, value in unsupported.items() if value is not None)
    if given:
        raise NotImplementedError(f"mock npu_grouped_matmul: {given} are not implemented")
    if (
        group_type != 0
        or len(x) != 1
        or len(weight) != 1
        or not isinstance(group_list, torch.Tensor)
    ):
        raise NotImplementedError(
            "mock npu_grouped_matmul: only group_type=0 with one x, one weight and a group_list "
            f"tensor is implemented, got group_type={group_type}, {len(x)} x, {len(weight)} "
            f"weights, group_list {type(group_list).__name__}"
        )
    if split_item not in (2, 3):
        raise bad("split_item", "2 or 3 (one output) for group_type 0", split_item)
    if act_type != 0:
        raise bad(
            "act_type", "0 (activation is documented for per-token quantization only)", act_type
        )
    (rows,), (weights,) = x, weight
    check_dtype("x", rows, NPU_DTYPES)
    if rows.dim() != 2 or not rows.is_contiguous():
        raise bad(
            "x",
            "one contiguous 2-D (M, K) tensor (x is not transposed)",
            f"shape {tuple(rows.shape)} strides {rows.stride()}",
        )
    if weights.dtype != rows.dtype:
        raise bad("weight", f"dtype {rows.dtype} like x", weights.dtype)
    (m, k), groups = rows.shape, weights.shape[0] if weights.dim() == 3 else 0
    if weights.dim() != 3 or weights.shape[1] != k:
        raise bad(
            "weight",
            f"one 3-D (G, K={k}, N) tensor for group_type 0",
            f"shape {tuple(weights.shape)}",
        )
    n = weights.shape[2]
    refusal = grouped_matmul_refusal(groups, k, n)
    if refusal is not None:
        raise refuse("npu_grouped_matmul", refusal)
    counts = _rows_per_group(group_list, group_list_type, groups, m)
    pieces = [
        part.float() @ weights[g].float() for g, part in enumerate(rows.split(counts)) if counts[g]
    ]
    y = torch.cat(pieces) if pieces else rows.new_zeros((0, n), dtype=torch.float32)
    return [y.to(rows.dtype)]
