"""``varlen_attention``: packed variable-length attention in TND layout.

Segment ``i`` holds query rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` and key rows
``cu_seqlens_k[i]:cu_seqlens_k[i+1]``; each segment attends only within itself, with the
semantics of :func:`~ascend_vlm.ops.fused_attention` (GQA, bottom-right causal, 0 for rows with
no visible key). This is Qwen2-VL's vision attention over many images packed in one sequence.

NPU: ``torch_npu.npu_fusion_attention(input_layout="TND", actual_seq_qlen=cu_seqlens_q[1:],
actual_seq_kvlen=cu_seqlens_k[1:])`` — host lists of cumulative lengths without the leading 0;
in varlen no row may be entirely masked (Ascend/op-plugin
docs/zh/custom_APIs/torch_npu/torch_npu-npu_fusion_attention.md; npu_api.md §1). Calls within
:func:`~ascend_vlm.ops.kernel_constraints.fusion_attention_varlen_refusal`'s limits (every head
dim 1..768 unpadded, Nq <= 256, T in 1..1M, at most 1K segments) go to the kernel; the rest, and
segments with rows that see no key, run the reference.
"""

from __future__ import annotations

import importlib
import itertools
import math

import torch

from ascend_vlm.ops._checks import check_dtype, check_rank, check_same_dtype, invalid
from ascend_vlm.ops._host_values import HostValueCache
from ascend_vlm.ops._op_spec import load_spec
from ascend_vlm.ops._registration import define_op, empty_like_first_input
from ascend_vlm.ops.fused_attention import (
    NPU_SPARSE_RIGHT_DOWN_CAUSAL,
    checked_bnsd_attention,
    fused_attention,
    npu_causal_mask,
)
from ascend_vlm.ops.kernel_constraints import fusion_attention_varlen_refusal

SPEC = load_spec("varlen_attention")
_QKV_DTYPES = SPEC.input_dtypes("query")
_CU_DTYPES = SPEC.input_dtypes("cu_seqlens_q")


def _check(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    _max_seqlen_q: int | None,
    _max_seqlen_k: int | None,
    _causal: bool,
    scale: float | None,
) -> None:
    """The checks that need no values of cu_seqlens (so they hold for fake tensors too); the
    implementations check the offsets themselves (`_query_and_key_lengths`)."""
    check_dtype("query", query, _QKV_DTYPES)
    check_same_dtype("key", key, "query", query.dtype)
    check_same_dtype("value", value, "query", query.dtype)
    check_rank("query", query, 3, "3-D [T, Nq, D] (TND)")
    check_rank("key", key, 3, "3-D [Tk, Nkv, D] (TND)")
    heads, head_dim = query.shape[1], query.shape[2]
    kv_heads = key.shape[1]
    if key.shape[2] != head_dim:
        raise invalid("key", f"head dim D={head_dim} like query", f"shape {tuple(key.shape)}")
    if kv_heads == 0 or heads % kv_heads:
        raise invalid(
            "key",
            f"a head count >= 1 dividing the {heads} query heads (GQA/MQA)",
            f"shape {tuple(key.shape)}",
        )
    if value.shape != key.shape:
        raise invalid("value", f"shape {tuple(key.shape)} like key", f"shape {tuple(value.shape)}")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_dtype(name, cu, _CU_DTYPES)
        check_rank(name, cu, 1, "1-D [num_segments + 1]")
        if cu.shape[0] < 1:
            raise invalid(name, "at least one entry (the leading 0)", "an empty tensor")
    if cu_seqlens_k.shape != cu_seqlens_q.shape:
        raise invalid(
            "cu_seqlens_k",
            f"shape {tuple(cu_seqlens_q.shape)} like cu_seqlens_q",
            f"shape {tuple(cu_seqlens_k.shape)}",
        )
    if scale is not None and not math.isfinite(scale):
        raise invalid("scale", "a finite float or None (1/sqrt(D))", scale)


# The offsets of a cu_seqlens tensor on the host: read once per tensor (transformers hands the
# same one to every vision layer), shared by the checks, the NPU call and _equal_segment_count.
host_bounds = HostValueCache(lambda cu_seqlens: tuple(cu_seqlens.tolist()))


def _segment_lengths(
    name: str, cu_seqlens: torch.Tensor, total: int, max_seqlen: int | None
) -> list[int]:
    """Check the values of ``cu_seqlens`` (starts at 0, nondecreasing, ends at ``total``)."""
    bounds = host_bounds(cu_seqlens)
    lengths = [b - a for a, b in itertools.pairwise(bounds)]
    if bounds[0] != 0 or bounds[-1] != total or any(n < 0 for n in lengths):
        raise invalid(name, f"nondecreasing offsets from 0 to {total}", list(bounds))
    if max_seqlen is not None and lengths and max(lengths) > max_seqlen:
        max_name = name.replace("cu_seqlens", "max_seqlen")
        raise invalid(max_name, f">= the longest segment ({max(lengths)})", max_seqlen)
    return lengths


def _query_and_key_lengths(
    query: torch.Tensor,
    key: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
) -> tuple[list[int], list[int]]:
    """Checked segment lengths of the queries and keys. Self-attention callers (Qwen-VL vision)
    pass one cu_seqlens tensor for both: it is then checked once (reads go through
    ``host_bounds``, one per tensor)."""
    q_lens = _segment_lengths("cu_seqlens_q", cu_seqlens_q, query.shape[0], max_seqlen_q)
    if (
        cu_seqlens_k is cu_seqlens_q
        and key.shape[0] == query.shape[0]
        and max_seqlen_k in (None, max_seqlen_q)
    ):
        return q_lens, q_lens
    return q_lens, _segment_lengths("cu_seqlens_k", cu_seqlens_k, key.shape[0], max_seqlen_k)


def _reference(
    _checked: None,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    causal: bool,
    scale: float | None,
) -> torch.Tensor:
    q_lens, k_lens = _query_and_key_lengths(
        query, key, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
    )
    if q_lens and q_lens == k_lens and len(set(q_lens)) == 1 and q_lens[0] > 0:
        # Equal segments (e.g. same-size images): one batched call, [n, S, N, D] -> BNSD.
        n, seg = len(q_lens), q_lens[0]
        q, k, v = (t.view(n, seg, *t.shape[1:]).transpose(1, 2) for t in (query, key, value))
        out = checked_bnsd_attention(q, k, v, causal, scale)
        return out.transpose(1, 2).reshape(query.shape)
    outputs = []
    for q, k, v in zip(query.split(q_lens), key.split(k_lens), value.split(k_lens), strict=True):
        if q.shape[0] == 0 or k.shape[0] == 0:  # nothing to attend to: rows are 0 by contract
            outputs.append(q.new_zeros(q.shape))
            continue
        out = checked_bnsd_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], causal, scale
        )
        outputs.append(out[0].transpose(0, 1))
    return torch.cat(outputs) if outputs else query.new_zeros(query.shape)


def _npu(
    _checked: None,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    causal: bool,
    scale: float | None,
) -> torch.Tensor:
    q_lens, k_lens = _query_and_key_lengths(
        query, key, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
    )
    # Varlen forbids fully masked rows: segments with queries but too few keys stay on the
    # reference, which defines those rows as 0.
    has_dead_rows = any(
        q_len > 0 and (k_len == 0 or (causal and q_len > k_len))
        for q_len, k_len in zip(q_lens, k_lens, strict=True)
    )
    refusal = fusion_attention_varlen_refusal(
        query.dtype,
        query.shape[1],
        key.shape[1],
        query.shape[2],
        (query.shape[0], key.shape[0]),
        len(q_lens),
    )
    if refusal is not None or has_dead_rows:
        return _reference(
            None,
            query,
            key,
            value,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            causal,
            scale,
        )
    torch_npu = importlib.import_module("torch_npu")
    return torch_npu.npu_fusion_attention(
        query,
        key,
        value,
        query.shape[1],
        "TND",
        atten_mask=npu_causal_mask(query.device) if causal else None,
        scale=1.0 / math.sqrt(query.shape[2]) if scale is None else scale,
        keep_prob=1.0,
        actual_seq_qlen=list(host_bounds(cu_seqlens_q)[1:]),
        actual_seq_kvlen=list(host_bounds(cu_seqlens_k)[1:]),
        sparse_mode=NPU_SPARSE_RIGHT_DOWN_CAUSAL if causal else 0,
    )[0]


varlen_attention = define_op(
    SPEC,
    check=_check,
    reference=_reference,
    npu=_npu,
    fake=empty_like_first_input,
    doc="""Attention within packed segments: q ``[T, Nq, D]``, k/v ``[Tk, Nkv, D]``, cu_seqlens
    int32/int64 ``[n + 1]`` from 0 to T (Tk). Returns ``[T, Nq, D]``. ``max_seqlen_*`` are
    optional upper bounds (checked). Bad shapes or offsets raise ``ValueError``.""",
)


def _equal_segment_count(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    total_q: int,
    total_k: int,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
) -> int | None:
    """``n`` when the call is self-attention (one cu_seqlens tensor for queries and keys) over
    ``n`` non-empty segments of one length ``L`` within the ``max_seqlen_*`` given, else None.

    Such a call equals :func:`~ascend_vlm.ops.fused_attention` on ``n`` batched sequences of
    length ``L``. Malformed offsets give None (the varlen op's checks then report them).
    """
    if cu_seqlens_k is not cu_seqlens_q or total_k != total_q or cu_seqlens_q.dim() != 1:
        return None
    bounds = host_bounds(cu_seqlens_q)
    count = len(bounds) - 1
    if count < 1 or total_q == 0 or total_q % count:
        return None
    length = total_q // count
    if bounds != tuple(range(0, total_q + 1, length)):
        return None
    if any(limit is not None and limit < length for limit in (max_seqlen_q, max_seqlen_k)):
        return None
    return count


def packed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None = None,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """:func:`varlen_attention` in the layout transformers hands its attention functions.

    q ``[1, Nq, T, D]``, k/v ``[1, Nkv, Tk, D]``: segments packed along the sequence axis, with
    the offsets, bounds, ``causal`` and ``scale`` of :func:`varlen_attention`; ``cu_seqlens_k``
    defaults to ``cu_seqlens_q``. Returns ``[1, T, Nq, D]`` contiguous, equal to
    :func:`varlen_attention` on the ``[T, N, D]`` views. Computed as:

    * one segment: :func:`fused_attention` on the inputs as they are;
    * self-attention (one offsets tensor for queries and keys) over ``n`` segments of one length
      ``L``: one :func:`fused_attention` over ``[n, N, L, D]`` views of the inputs, which spares
      the round trip through the packed ``[T, N, D]`` layout;
    * otherwise :func:`varlen_attention` on ``[T, N, D]`` views.

    Raises ValueError naming the argument for inputs that are not 4-D with batch 1, and as
    :func:`varlen_attention` does for bad offsets.
    """
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if tensor.dim() != 4 or tensor.shape[0] != 1:
            raise invalid(
                name, "4-D [1, N, T, D] (packed segments)", f"shape {tuple(tensor.shape)}"
            )
    if cu_seqlens_k is None:
        cu_seqlens_k = cu_seqlens_q
    segments = _equal_segment_count(
        cu_seqlens_q, cu_seqlens_k, query.shape[2], key.shape[2], max_seqlen_q, max_seqlen_k
    )
    if segments == 1:
        output = fused_attention(query, key, value, causal=causal, scale=scale)
        return output.transpose(1, 2).contiguous()
    if segments is not None:
        # `view` splits the sequence axis without a copy: [1, N, n*L, D] -> [n, N, L, D].
        batched = [
            t.view(t.shape[1], segments, -1, t.shape[3]).transpose(0, 1)
            for t in (query, key, value)
        ]
        output = fused_attention(*batched, causal=causal, scale=scale)
        output = output.transpose(1, 2).reshape(1, query.shape[2], output.shape[1], -1)
        return output.contiguous()
    packed = [t[0].transpose(0, 1) for t in (query, key, value)]  # [T, N, D]
    output = varlen_attention(
        *packed,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        causal=causal,
        scale=scale,
    )
    return output.unsqueeze(0)
