"""``paged_attention``: one decode step of attention whose keys and values live in fixed-size
blocks, each row reading its own blocks through a block table (vLLM's PagedAttention layout).

NPU: ``torch_npu.npu_fused_infer_attention_score`` in its page-attention mode, as its docstring
(``torch_npu/_op_plugin_docs.py``) documents it: ``query`` in layout "BNSD" with one token per
row, ``key`` / ``value`` the block pools ``(blocknum, KV_N, blocksize, D)`` (the layout the docs
recommend for BNSD queries), ``block_table`` int32 ``[B, maxBlockNumPerSeq]``,
``actual_seq_lengths_kv`` (required with a block table), ``block_size``, ``num_heads`` and
``num_key_value_heads``; it returns ``(attention_out, softmax_lse)``. A call outside the
kernel's documented limits (:func:`~ascend_vlm.ops.kernel_constraints.paged_attention_refusal`:
float16/bfloat16 only, block sizes a multiple of 16 up to 512) runs the reference.

Reference: each row's blocks gathered into one ``[B, KV_N, blocks * block_size, D]`` tensor, the
keys past each row's length masked, then :func:`~ascend_vlm.ops.fused_attention`.

:class:`PagedKV` is what a model's decode forward hands its attention layers under the keyword
:data:`PAGED_KV_KWARG` (the patched attention function calls ``paged_attention`` with it).

A plain function composed of ops (like ``packed_attention``), not a ``torch.library`` op: it
serves inference only (no gradient is ever taken through a KV cache).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ascend_vlm.kernel_backend import use_npu_kernels
from ascend_vlm.ops._checks import invalid
from ascend_vlm.ops.fused_attention import fused_attention
from ascend_vlm.ops.kernel_constraints import paged_attention_refusal

# The keyword a decode forward passes its PagedKV under, down to the attention functions.
PAGED_KV_KWARG = "paged_kv"


@dataclass
class PagedKV:
    """The blocks one decode step attends over: per decoder layer (by ``layer_idx``) its
    ``key_blocks`` / ``value_blocks`` pools, already holding this step's token; the rows'
    ``block_table`` and ``lengths`` (see :func:`paged_attention`). ``layers_read`` collects the
    layers whose attention read them, so the caller can tell every layer did."""

    key_blocks: Sequence[torch.Tensor]
    value_blocks: Sequence[torch.Tensor]
    block_table: torch.Tensor
    lengths: list[int]
    layers_read: set[int] = field(default_factory=set)

    def attend(self, layer: int, query: torch.Tensor, scale: float | None) -> torch.Tensor:
        """:func:`paged_attention` of ``query`` [B, N, 1, D] over layer ``layer``'s blocks."""
        self.layers_read.add(layer)
        return paged_attention(
            query,
            self.key_blocks[layer],
            self.value_blocks[layer],
            self.block_table,
            self.lengths,
            scale=scale,
        )


def paged_attention(
    query: torch.Tensor,
    key_blocks: torch.Tensor,
    value_blocks: torch.Tensor,
    block_table: torch.Tensor,
    lengths: Sequence[int],
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """``softmax(q k^T * scale) v`` of one query token per row over that row's cached keys.

    ``query`` [B, N, 1, D]; ``key_blocks`` / ``value_blocks`` [num_blocks, N_kv, block_size, D]
    (N a multiple of N_kv: grouped-query attention); ``block_table`` int32 [B, max_blocks],
    row ``b`` holding its keys ``0 .. lengths[b] - 1`` in blocks ``block_table[b, 0]``,
    ``block_table[b, 1]`` ... in order (entries past its last block are ignored but must be
    valid block ids); ``lengths`` (B ints, each in [1, max_blocks * block_size]) the keys per
    row, the query token's own included. ``scale`` defaults to ``D ** -0.5``.
    Returns [B, N, 1, D] in ``query``'s dtype. ValueError naming the argument otherwise.
    """
    _check(query, key_blocks, value_blocks, block_table, lengths)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    batch, heads, _, head_dim = query.shape
    kv_heads, block_size = key_blocks.shape[1], key_blocks.shape[2]
    if use_npu_kernels(query) and (
        paged_attention_refusal(query.dtype, batch, heads, kv_heads, head_dim, block_size) is None
    ):
        torch_npu = importlib.import_module("torch_npu")
        output, _ = torch_npu.npu_fused_infer_attention_score(
            query.contiguous(),
            key_blocks,
            value_blocks,
            actual_seq_lengths_kv=[int(length) for length in lengths],
            block_table=block_table,
            num_heads=heads,
            scale=scale,
            input_layout="BNSD",
            num_key_value_heads=kv_heads,
            block_size=block_size,
        )
        return output
    return _reference(query, key_blocks, value_blocks, block_table, lengths, scale)


def gather_blocks(blocks: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """``blocks`` [num_blocks, N, block_size, D] read through ``block_table`` [B, max_blocks]:
    [B, N, max_blocks * block_size, D], row ``b``'s blocks in table order (a copy)."""
    gathered = blocks[block_table.long()]  # [B, max_blocks, N, block_size, D]
    batch, count, heads, block_size, dim = gathered.shape
    return gathered.transpose(1, 2).reshape(batch, heads, count * block_size, dim)


def _reference(
    query: torch.Tensor,
    key_blocks: torch.Tensor,
    value_blocks: torch.Tensor,
    block_table: torch.Tensor,
    lengths: Sequence[int],
    scale: float,
) -> torch.Tensor:
    keys = gather_blocks(key_blocks, block_table)
    values = gather_blocks(value_blocks, block_table)
    columns = torch.arange(keys.shape[2], device=query.device)
    limits = torch.tensor([int(length) for length in lengths], device=query.device)
    keep = (columns[None, :] < limits[:, None])[:, None, None, :]
    return fused_attention(
        query, keys, values, layout="BNSD", attention_mask=keep, causal=False, scale=scale
    )


def _check(
    query: torch.Tensor,
    key_blocks: torch.Tensor,
    value_blocks: torch.Tensor,
    block_table: torch.Tensor,
    lengths: Sequence[int],
) -> None:
    if query.dim() != 4 or query.shape[2] != 1:
        raise invalid("query", "[B, N, 1, D] (one token per row)", f"shape {tuple(query.shape)}")
    batch, heads, _, head_dim = query.shape
    if key_blocks.dim() != 4 or key_blocks.shape[-1] != head_dim:
        raise invalid(
            "key_blocks",
            f"[num_blocks, N_kv, block_size, {head_dim}]",
            f"shape {tuple(key_blocks.shape)}",
        )
    if value_blocks.shape != key_blocks.shape:
        raise invalid(
            "value_blocks", f"shape {tuple(key_blocks.shape)}", f"{tuple(value_blocks.shape)}"
        )
    if heads % key_blocks.shape[1]:
        raise invalid("key_blocks", f"a head count dividing {heads}", key_blocks.shape[1])
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or len(block_table) != batch:
        raise invalid(
            "block_table",
            f"int32 [{batch}, max_blocks]",
            f"{block_table.dtype} {tuple(block_table.shape)}",
        )
    capacity = block_table.shape[1] * key_blocks.shape[2]
    if len(lengths) != batch or any(not 1 <= int(n) <= capacity for n in lengths):
        raise invalid("lengths", f"{batch} ints in [1, {capacity}]", list(lengths))
