"""Stand-in for ``torch_npu.npu_fusion_attention`` (doc: Ascend/op-plugin
``docs/zh/custom_APIs/torch_npu/torch_npu-npu_fusion_attention.md``; npu_api.md §1): layouts
BSH/SBH/BSND/BNSD and varlen TND, mask polarity, ``sparse_mode`` 0/2/3, ``scale``, ``head_num``
and GQA, computed naively in fp32 on CPU tensors."""

from __future__ import annotations

from typing import Any

import torch

from ascend_vlm.ops.kernel_constraints import (
    FUSION_ATTENTION_COMPRESSED_MASK,
    FUSION_ATTENTION_LAYOUTS,
    FUSION_ATTENTION_MASK_DTYPES,
    FUSION_ATTENTION_MASK_SHAPES,
    NPU_DTYPES,
    fusion_attention_refusal,
    fusion_attention_varlen_refusal,
    fusion_attention_varlen_rows_refusal,
)
from ascend_vlm.testing._checks import bad, check_dtype, refuse

INT_MAX = 2147483647  # default pre_tockens / next_tockens
FA_SUPPORTED_SPARSE_MODES = (0, 2, 3)
KERNEL = "npu_fusion_attention"


def _split_heads(
    tensor: torch.Tensor, layout: str, heads: int | None, argument: str
) -> torch.Tensor:
    """One non-TND input as ``[B, N, S, D]``; ``heads`` is needed for the H layouts."""
    ranks = {"BSH": 3, "SBH": 3, "BSND": 4, "BNSD": 4}
    if tensor.dim() != ranks[layout]:
        raise bad(
            argument,
            f"{ranks[layout]}-D for input_layout {layout!r}",
            f"shape {tuple(tensor.shape)}",
        )
    if layout == "BNSD":
        return tensor
    if layout == "BSND":
        return tensor.transpose(1, 2)
    if tensor.shape[-1] % heads:
        raise bad(
            argument, f"hidden size divisible into {heads} heads", f"shape {tuple(tensor.shape)}"
        )
    bsh = tensor if layout == "BSH" else tensor.transpose(0, 1)
    batch, seq, hidden = bsh.shape
    return bsh.reshape(batch, seq, heads, hidden // heads).transpose(1, 2)


def _merge_heads(out: torch.Tensor, layout: str) -> torch.Tensor:
    """``[B, N, S, D]`` back to ``layout``."""
    if layout == "BNSD":
        return out.contiguous()
    bsnd = out.transpose(1, 2)
    if layout == "BSND":
        return bsnd.contiguous()
    batch, seq, heads, dim = bsnd.shape
    bsh = bsnd.reshape(batch, seq, heads * dim)
    return bsh if layout == "BSH" else bsh.transpose(0, 1).contiguous()


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, drop: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Naive fp32 attention of ``[N, Sq, D]`` with ``[Nkv, Skv, D]`` keys; ``drop`` broadcastable
    to ``[N, Sq, Skv]`` marks positions NOT computed. Returns (out, fully-masked-row flags)."""
    group = q.shape[0] // k.shape[0]
    k = k.float().repeat_interleave(group, dim=0)
    v = v.float().repeat_interleave(group, dim=0)
    scores = torch.einsum("nqd,nkd->nqk", q.float(), k) * scale
    drop = (
        torch.zeros(scores.shape, dtype=torch.bool) if drop is None else drop.expand(scores.shape)
    )
    scores = scores.masked_fill(drop, float("-inf"))
    dead = drop.all(dim=-1)  # also True for rows with no key at all
    weights = torch.softmax(scores.masked_fill(dead[..., None], 0.0), dim=-1)
    out = torch.einsum("nqk,nkd->nqd", weights, v)
    return out.masked_fill(dead[..., None], 0.0), dead


def _causal_drop(q_len: int, kv_len: int, sparse_mode: int) -> torch.Tensor:
    """``[Sq, Skv]`` True where NOT computed: mode 2 top-left, mode 3 bottom-right aligned."""
    shift = kv_len - q_len if sparse_mode == 3 else 0
    return torch.ones(q_len, kv_len, dtype=torch.bool).triu(diagonal=shift + 1)


def _check_attention_mask(
    atten_mask: torch.Tensor, sparse_mode: int, allowed_shapes: list[tuple[int, ...]], note: str
) -> None:
    if atten_mask.dtype not in FUSION_ATTENTION_MASK_DTYPES:
        raise bad("atten_mask", "dtype bool or uint8 (1/True = not computed)", atten_mask.dtype)
    if sparse_mode in (2, 3):
        size = FUSION_ATTENTION_COMPRESSED_MASK
        expected = torch.ones(size, size, dtype=torch.bool).triu(1)
        if tuple(atten_mask.shape) != expected.shape or not torch.equal(
            atten_mask.bool(), expected
        ):
            raise bad(
                "atten_mask",
                f"the compressed {size}x{size} triu(diagonal=1) mask for sparse_mode={sparse_mode}",
                f"a tensor of shape {tuple(atten_mask.shape)} with other contents",
            )
    elif tuple(atten_mask.shape) not in allowed_shapes:
        raise bad(
            "atten_mask",
            f"one of the shapes {allowed_shapes} ({note})",
            f"shape {tuple(atten_mask.shape)}",
        )


def _cumulative(argument: str, lengths: Any, total: int) -> list[int]:
    """Per-segment lengths from a host list of cumulative ends (trailing zeros = skipped)."""
    if not isinstance(lengths, (list, tuple)) or not all(isinstance(n, int) for n in lengths):
        raise bad(
            argument,
            "a host list of ints (cumulative lengths, no leading 0)",
            type(lengths).__name__,
        )
    ends = list(lengths)
    while len(ends) > 1 and ends[-1] == 0:  # trailing batches that do not take part
        ends.pop()
    starts = [0, *ends[:-1]]
    if not ends or any(e < s for s, e in zip(starts, ends, strict=True)) or ends[-1] != total:
        raise bad(argument, f"nondecreasing cumulative lengths ending at T={total}", list(lengths))
    return [e - s for s, e in zip(starts, ends, strict=True)]


def _check_fusion_attention_arguments(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    input_layout: str,
    keep_prob: float,
    given: dict[str, Any],
) -> None:
    """The checks common to all layouts: dtypes, layout, shapes, dropout; ``given`` maps
    the optional arguments the mock does not model to their values (refused unless None)."""
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        check_dtype(name, tensor, NPU_DTYPES)
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise bad("key/value", f"dtype {query.dtype} like query", (key.dtype, value.dtype))
    if input_layout not in FUSION_ATTENTION_LAYOUTS:
        raise bad("input_layout", f"one of {FUSION_ATTENTION_LAYOUTS}", repr(input_layout))
    if value.shape != key.shape:
        raise bad("value", f"shape {tuple(key.shape)} like key", f"shape {tuple(value.shape)}")
    if not 0.0 < keep_prob <= 1.0:
        raise bad("keep_prob", "a float in (0, 1]", keep_prob)
    for name, value_given in given.items():
        if value_given is not None:
            raise NotImplementedError(f"mock npu_fusion_attention: {name} is not implemented")
    if keep_prob < 1.0:
        raise NotImplementedError(
            "mock npu_fusion_attention: dropout (keep_prob < 1) is not "
            "implemented; the device RNG cannot be reproduced on CPU"
        )


def _check_sparse_mode(
    atten_mask: torch.Tensor | None, sparse_mode: int, pre_tockens: int, next_tockens: int
) -> None:
    """Refuse the sparse modes and token bands the mock does not model (they only take effect
    with a mask)."""
    if atten_mask is None:
        return
    if sparse_mode not in FA_SUPPORTED_SPARSE_MODES:
        raise NotImplementedError(
            f"mock npu_fusion_attention: sparse_mode={sparse_mode} is not implemented "
            f"(supported: {FA_SUPPORTED_SPARSE_MODES})"
        )
    if sparse_mode == 0 and (pre_tockens, next_tockens) != (INT_MAX, INT_MAX):
        raise NotImplementedError(
            "mock npu_fusion_attention: pre_tockens/next_tockens bands are not implemented"
        )


def npu_fusion_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_num: int,
    input_layout: str,
    pse: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    scale: float = 1.0,
    keep_prob: float = 1.0,
    pre_tockens: int = INT_MAX,
    next_tockens: int = INT_MAX,
    inner_precise: int = 0,
    prefix: list[int] | None = None,
    actual_seq_qlen: list[int] | None = None,
    actual_seq_kvlen: list[int] | None = None,
    sparse_mode: int = 0,
    gen_mask_parallel: bool = True,
    sync: bool = False,
    softmax_layout: str = "",
    sink: torch.Tensor | None = None,
    dropout_mask: torch.Tensor | None = None,
    seed: int = 0,
    offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    """Stand-in for ``torch_npu.npu_fusion_attention`` (the registered signature).

    ``out = softmax(q @ k^T * scale, masked where atten_mask is 1) @ v`` per head, query head
    ``h`` using kv head ``h // (Nq / Nkv)``. ``scale`` defaults to 1.0 (not 1/sqrt(D)).
    ``atten_mask=None`` computes everything: ``sparse_mode`` and the token bands are then
    ignored, as documented. Returns the documented 7-tuple. ``pse``, ``padding_mask``,
    ``prefix``, ``sink`` (a per-head extra softmax logit) and ``dropout_mask`` raise
    ``NotImplementedError``; ``seed``/``offset`` only seed dropout, which is refused
    (``keep_prob < 1``), so they change nothing here.
    """
    unmodelled = {"pse": pse, "padding_mask": padding_mask, "prefix": prefix}
    unmodelled |= {"sink": sink, "dropout_mask": dropout_mask}
    _check_fusion_attention_arguments(query, key, value, input_layout, keep_prob, unmodelled)
    _check_sparse_mode(atten_mask, sparse_mode, pre_tockens, next_tockens)
    if not isinstance(head_num, int) or head_num < 1:
        raise bad("head_num", "a positive int (query heads)", head_num)
    if input_layout == "TND":
        out, dead = _fusion_attention_tnd(
            query,
            key,
            value,
            head_num,
            atten_mask,
            scale,
            actual_seq_qlen,
            actual_seq_kvlen,
            sparse_mode,
        )
        stats_shape = (head_num, query.shape[0], 8)
    else:
        out, dead = _fusion_attention_batched(
            query, key, value, head_num, input_layout, atten_mask, scale, sparse_mode
        )
        stats_shape = (*dead.shape, 8)
    # softmax_max / softmax_sum are fp32 per the doc; their shape here is UNVERIFIED (only [0]
    # is used by ascend_vlm). The last four outputs are reserved / dropout bookkeeping.
    softmax_max = torch.zeros(stats_shape, dtype=torch.float32)
    softmax_sum = torch.zeros(stats_shape, dtype=torch.float32)
    return out, softmax_max, softmax_sum, torch.empty(0, dtype=query.dtype), 0, 0, 0


def _check_heads(q: torch.Tensor, k: torch.Tensor, head_num: int, head_axis: int) -> None:
    """head_num and the head dims agree with the tensors; ``head_axis`` is where N sits (-3 for
    BNSD, -2 for TND). The limits on them are the kernel's refusals (``kernel_constraints``)."""
    q_heads, head_dim = q.shape[head_axis], q.shape[-1]
    if q_heads != head_num:
        raise bad("head_num", f"the query head count {q_heads}", head_num)
    if k.shape[-1] != head_dim:
        raise bad("key", f"head dim D={head_dim} like query (Dq = Dk)", k.shape[-1])


def _fusion_attention_batched(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_num: int,
    layout: str,
    atten_mask: torch.Tensor | None,
    scale: float,
    sparse_mode: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    q = _split_heads(query, layout, head_num, "query")
    kv_heads = None
    if layout in ("BSH", "SBH"):
        head_dim = query.shape[-1] // head_num
        if key.shape[-1] % head_dim:
            raise bad("key", f"hidden size a multiple of D={head_dim}", tuple(key.shape))
        kv_heads = key.shape[-1] // head_dim
    k = _split_heads(key, layout, kv_heads, "key")
    v = _split_heads(value, layout, kv_heads, "value")
    _check_heads(q, k, head_num, head_axis=-3)
    batch, heads, q_len, head_dim = q.shape
    kv_len = k.shape[2]
    if k.shape[0] != batch:
        raise bad("key", f"batch B={batch} like query", k.shape[0])
    refusal = fusion_attention_refusal(
        query.dtype, batch, heads, k.shape[1], q_len, kv_len, head_dim
    )
    if refusal is not None:
        raise refuse(KERNEL, refusal)
    drop = None
    if atten_mask is not None:
        shapes = [
            (batch, heads, q_len, kv_len),
            (batch, 1, q_len, kv_len),
            (1, 1, q_len, kv_len),
            (q_len, kv_len),
        ]
        _check_attention_mask(
            atten_mask, sparse_mode, shapes, " or ".join(FUSION_ATTENTION_MASK_SHAPES)
        )
        if sparse_mode == 0:
            drop = atten_mask.bool()
            drop = drop.reshape(1, 1, q_len, kv_len) if drop.dim() == 2 else drop
        else:
            drop = _causal_drop(q_len, kv_len, sparse_mode)[None, None]
    outs, deads = [], []
    for b in range(batch):
        mask_b = None if drop is None else drop[min(b, drop.shape[0] - 1)]
        out_b, dead_b = _attend(q[b], k[b], v[b], mask_b, scale)
        outs.append(out_b)
        deads.append(dead_b)
    # UNVERIFIED: the doc says fully masked ("invalid") rows are handled by inner_precise=2
    # (auto-enabled e.g. for sparse_mode 3 with Sq > Skv) without stating their value; 0 here.
    out = torch.stack(outs).to(query.dtype)
    return _merge_heads(out, layout), torch.stack(deads)


def _fusion_attention_tnd(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_num: int,
    atten_mask: torch.Tensor | None,
    scale: float,
    actual_seq_qlen: Any,
    actual_seq_kvlen: Any,
    sparse_mode: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    for name, tensor in (("query", query), ("key", key)):
        if tensor.dim() != 3:
            raise bad(name, "3-D [T, N, D] for input_layout 'TND'", f"shape {tuple(tensor.shape)}")
    _check_heads(query, key, head_num, head_axis=-2)
    if actual_seq_qlen is None or actual_seq_kvlen is None:
        raise bad(
            "actual_seq_qlen/actual_seq_kvlen",
            "both given for input_layout 'TND'",
            (actual_seq_qlen, actual_seq_kvlen),
        )
    q_lens = _cumulative("actual_seq_qlen", actual_seq_qlen, query.shape[0])
    kv_lens = _cumulative("actual_seq_kvlen", actual_seq_kvlen, key.shape[0])
    if len(q_lens) != len(kv_lens):
        raise bad("actual_seq_kvlen", f"{len(q_lens)} segments like actual_seq_qlen", len(kv_lens))
    refusal = fusion_attention_varlen_refusal(
        query.dtype,
        head_num,
        key.shape[1],
        query.shape[2],
        (query.shape[0], key.shape[0]),
        len(actual_seq_qlen),
    )
    if refusal is not None:
        raise refuse(KERNEL, refusal)
    if atten_mask is not None:
        shape = (max(q_lens), max(kv_lens))
        _check_attention_mask(atten_mask, sparse_mode, [shape], "varlen takes only SS")
    outs, deads = [], []
    q_start = kv_start = 0
    for q_len, kv_len in zip(q_lens, kv_lens, strict=True):
        q = query[q_start : q_start + q_len].transpose(0, 1)
        k = key[kv_start : kv_start + kv_len].transpose(0, 1)
        v = value[kv_start : kv_start + kv_len].transpose(0, 1)
        q_start, kv_start = q_start + q_len, kv_start + kv_len
        if q_len == 0:
            continue
        drop = None
        if atten_mask is not None:
            drop = (
                atten_mask.bool()[:q_len, :kv_len]
                if sparse_mode == 0
                else _causal_drop(q_len, kv_len, sparse_mode)
            )
        out, dead = _attend(q, k, v, drop, scale)
        refusal = fusion_attention_varlen_rows_refusal(q_len, kv_len, bool(dead.any()))
        if refusal is not None:
            raise refuse(KERNEL, refusal)
        outs.append(out.transpose(0, 1))
        deads.append(dead.transpose(0, 1))
    out = torch.cat(outs).to(query.dtype) if outs else torch.zeros_like(query)
    return out, torch.cat(deads) if deads else torch.zeros(query.shape[:2], dtype=torch.bool)
