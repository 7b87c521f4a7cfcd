"""The arguments of ``fused_attention`` checked: dtypes, ranks and shapes per layout, the mask,
scale and dropout; the validated geometry of a call (:class:`AttentionShape`)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ascend_vlm.ops._checks import check_dtype, check_rank, check_same_dtype, invalid
from ascend_vlm.ops._op_spec import load_spec

_SPEC = load_spec("fused_attention")
_QKV_DTYPES = _SPEC.input_dtypes("query")
_MASK_DTYPES = _SPEC.input_dtypes("attention_mask")
LAYOUTS = ("BNSD", "BSH")


class AttentionShape(NamedTuple):
    """Validated geometry of one call (a NamedTuple: built on every call, so kept cheap)."""

    batch: int
    num_heads: int
    num_kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int


def check_attention_args(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    layout: str,
    num_heads: int | None,
    num_kv_heads: int | None,
    _causal: bool,
    scale: float | None,
    dropout_p: float,
    dropout_seed: int | None,
) -> AttentionShape:
    if (  # the common BNSD call, every rule below at once; the rest runs to explain a failure
        layout == "BNSD"
        and query.dtype in _QKV_DTYPES
        and key.dtype == query.dtype
        and value.dtype == query.dtype
        and query.dim() == 4
        and key.dim() == 4
        and value.shape == key.shape
        and num_heads is None
        and num_kv_heads is None
        and (scale is None or math.isfinite(scale))
        and (dropout_p == 0.0 or (0.0 < dropout_p < 1.0 and dropout_seed is not None))
    ):
        batch, heads, q_len, head_dim = query.shape
        kv_batch, kv_heads, kv_len, kv_head_dim = key.shape
        if kv_batch == batch and kv_head_dim == head_dim and kv_heads and not heads % kv_heads:
            if attention_mask is None:
                return AttentionShape(batch, heads, kv_heads, q_len, kv_len, head_dim)
            if attention_mask.dim() == 4 and attention_mask.dtype in _MASK_DTYPES:
                mask_batch, mask_heads, mask_q, mask_kv = attention_mask.shape
                if (
                    mask_batch in (1, batch)
                    and mask_heads in (1, heads)
                    and mask_q in (1, q_len)
                    and mask_kv in (1, kv_len)
                ):
                    return AttentionShape(batch, heads, kv_heads, q_len, kv_len, head_dim)
    return _explained_shape(
        query,
        key,
        value,
        attention_mask,
        layout,
        num_heads,
        num_kv_heads,
        scale,
        dropout_p,
        dropout_seed,
    )


def _explained_shape(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    layout: str,
    num_heads: int | None,
    num_kv_heads: int | None,
    scale: float | None,
    dropout_p: float,
    dropout_seed: int | None,
) -> AttentionShape:
    """The rules of :func:`check_attention_args` one at a time: the shape, or ``ValueError`` naming the first
    argument that breaks one."""
    if layout not in LAYOUTS:
        raise invalid("layout", f"one of {LAYOUTS}", repr(layout))
    check_dtype("query", query, _QKV_DTYPES)
    check_same_dtype("key", key, "query", query.dtype)
    check_same_dtype("value", value, "query", query.dtype)
    batch, heads, kv_heads, q_len, kv_len, head_dim, expected_kv = _layout_geometry(
        query, key, value, layout, num_heads, num_kv_heads
    )
    if kv_heads <= 0 or heads % kv_heads:
        raise invalid("num_kv_heads", f"a divisor of the {heads} query heads (GQA/MQA)", kv_heads)
    if tuple(key.shape) != expected_kv:
        raise invalid(
            "key",
            f"shape {expected_kv} (B, heads and D matching query)",
            f"shape {tuple(key.shape)}",
        )
    if value.shape != key.shape:
        raise invalid("value", f"shape {tuple(key.shape)} like key", f"shape {tuple(value.shape)}")
    shape = AttentionShape(batch, heads, kv_heads, q_len, kv_len, head_dim)
    if attention_mask is not None:
        check_attention_mask(attention_mask, shape)
    if scale is not None and not math.isfinite(scale):
        raise invalid("scale", "a finite float or None (1/sqrt(D))", scale)
    if not 0.0 <= dropout_p < 1.0:
        raise invalid("dropout_p", "a float in [0, 1)", dropout_p)
    if dropout_p > 0.0 and dropout_seed is None:
        raise invalid(
            "dropout_seed",
            "an int when dropout_p > 0 (ascend_vlm.ops.fused_attention draws one from torch's "
            "RNG; callers of torch.ops.ascend_vlm.fused_attention pass it)",
            None,
        )
    return shape


def _layout_geometry(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: str,
    num_heads: int | None,
    num_kv_heads: int | None,
) -> tuple[int, int, int, int, int, int, tuple[int, ...]]:
    """``(batch, heads, kv_heads, q_len, kv_len, head_dim, expected key shape)`` read from the
    tensors of ``layout``; ``ValueError`` naming a tensor of the wrong rank or a head count that
    contradicts the shapes."""
    if layout == "BNSD":
        for name, tensor, dims in (
            ("query", query, "Nq, Sq"),
            ("key", key, "Nkv, Skv"),
            ("value", value, "Nkv, Skv"),
        ):
            check_rank(name, tensor, 4, f"4-D [B, {dims}, D] for layout 'BNSD'")
        batch, heads, q_len, head_dim = query.shape
        kv_heads, kv_len = key.shape[1], key.shape[2]
        for name, given, actual in (
            ("num_heads", num_heads, heads),
            ("num_kv_heads", num_kv_heads, kv_heads),
        ):
            if given is not None and given != actual:
                raise invalid(name, f"{actual} (from the BNSD shapes) or None", given)
        expected_kv = (batch, kv_heads, kv_len, head_dim)
    else:
        for name, tensor, dims in (
            ("query", query, "Sq, Nq*D"),
            ("key", key, "Skv, Nkv*D"),
            ("value", value, "Skv, Nkv*D"),
        ):
            check_rank(name, tensor, 3, f"3-D [B, {dims}] for layout 'BSH'")
        if num_heads is None or num_heads <= 0:
            raise invalid("num_heads", "a positive int for layout 'BSH'", num_heads)
        heads = num_heads
        kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        batch, q_len, hidden = query.shape
        if hidden % heads:
            raise invalid(
                "query", f"last dim divisible by num_heads={heads}", f"shape {tuple(query.shape)}"
            )
        head_dim = hidden // heads
        kv_len = key.shape[1]
        if kv_heads <= 0:
            raise invalid("num_kv_heads", "a positive int or None", kv_heads)
        expected_kv = (batch, kv_len, kv_heads * head_dim)
    return batch, heads, kv_heads, q_len, kv_len, head_dim, expected_kv


def check_attention_mask(mask: torch.Tensor, shape: AttentionShape) -> None:
    check_dtype("attention_mask", mask, _MASK_DTYPES)
    full = (shape.batch, shape.num_heads, shape.q_len, shape.kv_len)
    if mask.dim() == 2:
        if mask.dtype != torch.bool:
            raise invalid(
                "attention_mask", "dtype bool for a 2-D [B, Skv] padding mask", mask.dtype
            )
        if tuple(mask.shape) != (shape.batch, shape.kv_len):
            raise invalid(
                "attention_mask", f"2-D [B, Skv] = {full[0], full[3]}", f"shape {tuple(mask.shape)}"
            )
    elif mask.dim() != 4 or any(m not in (1, f) for m, f in zip(mask.shape, full, strict=True)):
        raise invalid(
            "attention_mask",
            f"2-D [B, Skv] or 4-D broadcastable to [B, Nq, Sq, Skv] = {full}",
            f"shape {tuple(mask.shape)}",
        )
