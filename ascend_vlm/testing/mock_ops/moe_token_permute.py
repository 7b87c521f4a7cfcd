"""Stand-ins for ``torch_npu.npu_moe_token_permute`` and ``torch_npu.npu_moe_token_unpermute``
(docs: the ``_op_plugin_docs.py`` of the torch-npu wheels), a pair sharing one index contract:
``permuted[sorted_indices[i]] = tokens[i // topK]``.

The dtypes are those of torch-npu 2.14.0's docs (float16, bfloat16, float32); the docs of
2.6.0.post5, 2.8.0.post5 and 2.9.1 allow bfloat16 only, which ``ascend_vlm.ops.moe_experts``
keeps to. Sums are computed in fp32 here (the kernel's internal precision is UNVERIFIED).
"""

from __future__ import annotations

import torch

from ascend_vlm.ops.kernel_constraints import (
    MOE_PERMUTE_MAX_INDEX,
    moe_token_permute_refusal,
    moe_token_unpermute_refusal,
)
from ascend_vlm.testing._checks import bad, check_dtype, refuse

PERMUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def npu_moe_token_permute(
    tokens: torch.Tensor,
    indices: torch.Tensor,
    num_out_tokens: int | None = None,
    padded_mode: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-in for ``torch_npu.npu_moe_token_permute``: each token repeated for its topK expert
    indices, the rows stably sorted by expert index. tokens (num_tokens, hidden) fp16/bf16/fp32;
    indices (num_tokens, topK) or (num_tokens,) int32/int64 in [0, 16777215), fewer than 16777215
    of them, topK <= 512. Returns ``permuted_tokens`` (min(numel, num_out_tokens), hidden) in
    tokens' dtype (None or 0 keeps every row, a negative count slices from the end) and
    ``sorted_indices`` int32 (numel,) with ``permuted[sorted_indices[i]] = tokens[i // topK]``.
    ``padded_mode=True`` is not supported by the kernel and raises."""
    check_dtype("tokens", tokens, PERMUTE_DTYPES)
    if tokens.dim() != 2:
        raise bad("tokens", "2-D (num_tokens, hidden_size)", f"shape {tuple(tokens.shape)}")
    check_dtype("indices", indices, (torch.int32, torch.int64))
    top_k = indices.shape[1] if indices.dim() == 2 else 1
    if indices.dim() not in (1, 2) or indices.shape[0] != tokens.shape[0]:
        raise bad(
            "indices",
            f"(num_tokens={tokens.shape[0]}, topK) or (num_tokens,)",
            f"shape {tuple(indices.shape)}",
        )
    refusal = moe_token_permute_refusal(top_k, indices.numel())
    if refusal is not None:
        raise refuse("npu_moe_token_permute", refusal)
    flat = indices.reshape(-1).to(torch.int64)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= MOE_PERMUTE_MAX_INDEX):
        raise bad(
            "indices",
            f"values in [0, {MOE_PERMUTE_MAX_INDEX})",
            f"values in [{int(flat.min())}, {int(flat.max())}]",
        )
    if padded_mode:
        raise bad("padded_mode", "False (the only mode the kernel supports)", padded_mode)
    source = torch.argsort(flat, stable=True)
    out_rows = flat.numel()
    if num_out_tokens:
        out_rows = (
            min(num_out_tokens, out_rows) if num_out_tokens > 0 else out_rows + num_out_tokens
        )
    permuted = tokens[source[: max(out_rows, 0)] // top_k]
    return permuted.contiguous(), torch.argsort(source).to(torch.int32)


def npu_moe_token_unpermute(
    permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    probs: torch.Tensor | None = None,
    padded_mode: bool = False,
    restore_shape: list[int] | None = None,
) -> torch.Tensor:
    """Stand-in for ``torch_npu.npu_moe_token_unpermute``:
    ``out[t] = sum_k probs[t, k] * permuted_tokens[sorted_indices[t * topK + k]]`` (probs 1 when
    None, and then topK = 1). permuted_tokens (num_tokens * topK, hidden) fp16/bf16/fp32;
    sorted_indices int32 (num_tokens * topK,), a permutation of [0, num_tokens * topK); probs
    None or (num_tokens, topK) fp16/bf16/fp32, topK <= 512. Returns (num_tokens, hidden) in
    permuted_tokens' dtype. ``padded_mode=True`` and a ``restore_shape`` are not supported by the
    kernel and raise."""
    check_dtype("permuted_tokens", permuted_tokens, PERMUTE_DTYPES)
    if permuted_tokens.dim() != 2:
        raise bad(
            "permuted_tokens",
            "2-D (num_tokens * topK, hidden_size)",
            f"shape {tuple(permuted_tokens.shape)}",
        )
    check_dtype("sorted_indices", sorted_indices, (torch.int32,))
    rows = permuted_tokens.shape[0]
    if sorted_indices.shape != (rows,):
        raise bad(
            "sorted_indices",
            f"shape ({rows},) (num_tokens * topK)",
            f"shape {tuple(sorted_indices.shape)}",
        )
    top_k = 1
    if probs is not None:
        check_dtype("probs", probs, PERMUTE_DTYPES)
        top_k = probs.shape[1] if probs.dim() == 2 else 0
        if probs.dim() != 2 or top_k == 0 or probs.numel() != rows:
            raise bad(
                "probs",
                f"2-D (num_tokens, topK) with num_tokens * topK = {rows}",
                f"shape {tuple(probs.shape)}",
            )
    refusal = moe_token_unpermute_refusal(top_k)
    if refusal is not None:
        raise refuse("npu_moe_token_unpermute", refusal)
    if rows and not torch.equal(
        torch.sort(sorted_indices.to(torch.int64)).values, torch.arange(rows)
    ):
        raise bad(
            "sorted_indices",
            f"a permutation of [0, {rows - 1}] (no repeated index)",
            "other values",
        )
    if padded_mode or restore_shape is not None:
        raise bad(
            "padded_mode/restore_shape",
            "False/None (the only mode the kernel supports)",
            (padded_mode, restore_shape),
        )
    per_choice = permuted_tokens.float()[sorted_indices.long()].view(rows // top_k, top_k, -1)
    if probs is not None:
        per_choice = per_choice * probs.float().unsqueeze(-1)
    return per_choice.sum(dim=1).to(permuted_tokens.dtype)
