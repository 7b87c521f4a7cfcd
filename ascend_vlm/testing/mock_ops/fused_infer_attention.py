"""Stand-in for ``torch_npu.npu_fused_infer_attention_score`` in its page-attention decode mode
(doc: the wheels' ``torch_npu/_op_plugin_docs.py``, "当Q_S等于1时" and "page attention场景"):
``query`` "BNSD" with one token per row, ``key`` / ``value`` block pools
``(blocknum, KV_N, blocksize, D)``, ``block_table`` int32 ``[B, maxBlockNumPerSeq]`` and the
required ``actual_seq_lengths_kv``. Every other mode (prompt attention, masks, quantisation,
shared prefixes, MLA rope, left padding) raises NotImplementedError naming the argument."""

from __future__ import annotations

import math

import torch

from ascend_vlm.ops.kernel_constraints import paged_attention_refusal
from ascend_vlm.testing._checks import bad, refuse

# Arguments the mock does not model, with the value that leaves them off.
_UNMODELLED = (
    "pse_shift", "atten_mask", "actual_seq_lengths", "dequant_scale1", "quant_scale1",
    "dequant_scale2", "quant_scale2", "quant_offset2", "antiquant_scale", "antiquant_offset",
    "key_antiquant_scale", "key_antiquant_offset", "value_antiquant_scale",
    "value_antiquant_offset", "query_padding_size", "kv_padding_size", "key_shared_prefix",
    "value_shared_prefix", "actual_shared_prefix_len", "query_rope", "key_rope",
    "key_rope_antiquant_scale",
)  # fmt: skip


def npu_fused_infer_attention_score(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    pse_shift=None,
    atten_mask=None,
    actual_seq_lengths=None,
    actual_seq_lengths_kv=None,
    dequant_scale1=None,
    quant_scale1=None,
    dequant_scale2=None,
    quant_scale2=None,
    quant_offset2=None,
    antiquant_scale=None,
    antiquant_offset=None,
    key_antiquant_scale=None,
    key_antiquant_offset=None,
    value_antiquant_scale=None,
    value_antiquant_offset=None,
    block_table=None,
    query_padding_size=None,
    kv_padding_size=None,
    key_shared_prefix=None,
    value_shared_prefix=None,
    actual_shared_prefix_len=None,
    query_rope=None,
    key_rope=None,
    key_rope_antiquant_scale=None,
    num_heads: int = 1,
    scale: float = 1.0,
    pre_tokens: int = 2147483647,
    next_tokens: int = 2147483647,
    input_layout: str = "BSH",
    num_key_value_heads: int = 0,
    sparse_mode: int = 0,
    inner_precise: int = 0,
    block_size: int = 0,
    antiquant_mode: int = 0,
    key_antiquant_mode: int = 0,
    value_antiquant_mode: int = 0,
    softmax_lse_flag: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(attention_out, softmax_lse)``: ``softmax(scale * q k^T) v`` per row over its first
    ``actual_seq_lengths_kv[b]`` keys, read block by block through ``block_table``;
    ``attention_out`` like ``query``, ``softmax_lse`` empty (``softmax_lse_flag`` False)."""
    given = locals()
    for name in _UNMODELLED:
        if given[name] is not None:
            raise NotImplementedError(f"{name}: the mock models page-attention decode only")
    if block_table is None:
        raise NotImplementedError("block_table: the mock models page-attention decode only")
    if softmax_lse_flag:
        raise NotImplementedError("softmax_lse_flag: the mock returns no softmax_lse")
    if input_layout != "BNSD" or query.dim() != 4 or query.shape[2] != 1:
        raise bad("query", "BNSD [B, N, 1, D] (input_layout 'BNSD', Q_S = 1)", input_layout)
    batch, heads, _, head_dim = query.shape
    if num_heads != heads:
        raise bad("num_heads", f"query's N ({heads})", num_heads)
    kv_heads = num_key_value_heads or num_heads
    refusal = paged_attention_refusal(query.dtype, batch, heads, kv_heads, head_dim, block_size)
    if refusal is not None:
        raise refuse("npu_fused_infer_attention_score", refusal)
    if key.shape != value.shape or key.dim() != 4:
        raise bad("key", "(blocknum, KV_N, blocksize, D) like value", tuple(key.shape))
    if tuple(key.shape[1:]) != (kv_heads, block_size, head_dim):
        raise bad("key", f"(blocknum, {kv_heads}, {block_size}, {head_dim})", tuple(key.shape))
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise bad("key", f"dtype {query.dtype} like query", key.dtype)
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or len(block_table) != batch:
        raise bad("block_table", f"int32 [{batch}, maxBlockNumPerSeq]", block_table.shape)
    if actual_seq_lengths_kv is None or len(actual_seq_lengths_kv) != batch:
        raise bad("actual_seq_lengths_kv", f"{batch} lengths (required with block_table)",
                  actual_seq_lengths_kv)  # fmt: skip
    blocks_needed = [math.ceil(int(n) / block_size) for n in actual_seq_lengths_kv]
    if max(blocks_needed) > block_table.shape[1]:
        raise bad("block_table", f"at least {max(blocks_needed)} columns", block_table.shape)
    if sum(blocks_needed) > key.shape[0]:
        # the documented rule counts every row's blocks, a block shared by rows once per row
        raise bad("key", f"blocknum >= {sum(blocks_needed)} (the rows' block counts summed)",
                  key.shape[0])  # fmt: skip
    group = heads // kv_heads
    output = torch.empty_like(query)
    for row in range(batch):
        length = int(actual_seq_lengths_kv[row])
        ids = block_table[row, : blocks_needed[row]].long()
        # (blocks, KV_N, blocksize, D) -> (KV_N, blocks * blocksize, D), the row's first keys
        keys = key[ids].transpose(0, 1).reshape(kv_heads, -1, head_dim)[:, :length].float()
        values = value[ids].transpose(0, 1).reshape(kv_heads, -1, head_dim)[:, :length].float()
        keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
        scores = query[row].float() @ keys.transpose(1, 2) * scale  # [N, 1, length]
        output[row] = (scores.softmax(-1) @ values).to(query.dtype)
    return output, torch.empty(0, dtype=torch.float32)
