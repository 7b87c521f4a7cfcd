"""``fused_attention``: batched softmax attention in BNSD or BSH layout.

``out = softmax(q @ k^T * scale + mask) @ v`` per head, with GQA/MQA (query head ``h`` reads kv
head ``h // (Nq / Nkv)``), torch-SDPA mask polarity (True = attend), bottom-right aligned causal
masking (query ``i`` of ``Sq`` sees key ``j`` iff ``j <= i + Skv - Sq``) and 0 output for rows
whose every key is masked.

NPU: ``torch_npu.npu_fusion_attention`` (Ascend/op-plugin
docs/zh/custom_APIs/torch_npu/torch_npu-npu_fusion_attention.md; facts in
shared/reference/npu_api.md §1): its ``atten_mask`` is the inverse polarity (True = drop), shaped
BNSS/B1SS/11SS/SS; ``scale`` defaults to 1.0 so we always pass it; ``head_num`` is the query
head count; causal is ``sparse_mode=3`` (rightDownCausal) with the compressed 2048x2048
``triu(diagonal=1)`` mask; it returns a 7-tuple whose ``[0]`` is the output. Its limits
(:func:`~ascend_vlm.ops.kernel_constraints.fusion_attention_refusal`: fp16/bf16/fp32, Nq <= 256,
head dim 1..768 with no alignment, S in 1..1M) decide the path: every head dim a supported
family uses (8 in the tiny models, 64, 72 and 80 in the ViTs, 128 to 512 in the decoders) goes
to the kernel as it is, unpadded; a call outside them (D > 768, Nq > 256, float64, an empty
sequence) runs the reference.
"""

from __future__ import annotations

import importlib
import math

import torch
import torch.nn.functional as F

from ascend_vlm.ops._attention_args import AttentionShape, check_attention_args
from ascend_vlm.ops._host_values import HostValueCache, readable_on_host
from ascend_vlm.ops._op_spec import load_spec
from ascend_vlm.ops._registration import define_op, empty_like_first_input
from ascend_vlm.ops.kernel_constraints import (
    FUSION_ATTENTION_COMPRESSED_MASK,
    fusion_attention_refusal,
)

SPEC = load_spec("fused_attention")
# Additive-mask entries at or below this count as "masked" when deciding whether a whole row is
# masked (HF builds masks from finfo(dtype).min, and exp(-1e4) is 0 in every float dtype).
MASKED_ADDITIVE_BELOW = -1e4
NPU_SPARSE_RIGHT_DOWN_CAUSAL = 3


def _causal_keep(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """``[Sq, Skv]`` bool, True where query ``i`` may see key ``j``: ``j <= i + Skv - Sq``."""
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - q_len)


def _mask_keep(attention_mask: torch.Tensor) -> torch.Tensor:
    """A checked ``attention_mask`` as a bool "attend" mask (4-D, broadcastable)."""
    if attention_mask.dtype == torch.bool:
        return attention_mask if attention_mask.dim() == 4 else attention_mask[:, None, None]
    return attention_mask > MASKED_ADDITIVE_BELOW


def _keep_mask(
    attention_mask: torch.Tensor | None, causal: bool, shape: AttentionShape, device: torch.device
) -> torch.Tensor | None:
    """The bool "attend" mask (4-D, broadcastable) combining padding and causality, or None."""
    keep = None if attention_mask is None else _mask_keep(attention_mask)
    if causal and shape.q_len > 1:  # a single (last) query sees every key: nothing to mask
        causal_keep = _causal_keep(shape.q_len, shape.kv_len, device)
        keep = causal_keep[None, None] if keep is None else keep & causal_keep
    return keep


def _dead_row_mask(keep: torch.Tensor) -> torch.Tensor:
    """``[.., Sq, 1]`` bool, True for rows with no visible key (computed on the device)."""
    return ~keep.any(dim=-1, keepdim=True)


def _dead_rows(keep: torch.Tensor | None) -> torch.Tensor | None:
    """`_dead_row_mask`, or None when no row is dead (one host read: reference path only).
    Traced (backward under torch.compile) it is always the mask: the fix-up is exact either way."""
    if keep is None:
        return None
    dead = _dead_row_mask(keep)
    if not readable_on_host(dead):
        return dead
    return dead if bool(dead.any()) else None


# Whether a mask alone leaves some query row without a visible key: a host read per mask object
# (transformers hands one mask to every layer), so the reference asks once per forward.
_mask_has_dead_rows = HostValueCache(lambda mask: bool(_dead_row_mask(_mask_keep(mask)).any()))


def _to_bnsd(tensor: torch.Tensor, heads: int, layout: str) -> torch.Tensor:
    if layout == "BNSD":
        return tensor
    batch, seq, hidden = tensor.shape
    return tensor.view(batch, seq, heads, hidden // heads).transpose(1, 2)


def _from_bnsd(out: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "BNSD":
        return out
    batch, heads, seq, head_dim = out.shape
    return out.transpose(1, 2).reshape(batch, seq, heads * head_dim)


def _reference(
    shape: AttentionShape,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    layout: str,
    _num_heads: int | None,
    _num_kv_heads: int | None,
    causal: bool,
    scale: float | None,
    dropout_p: float,
    dropout_seed: int | None,
) -> torch.Tensor:
    """Plain-torch fused_attention (also what backward differentiates): one SDPA call with GQA
    via ``enable_gqa``, masks merged into one SDPA mask, dead rows zeroed afterwards; with
    dropout, the same math spelled out around the seeded mask of `_dropout_attention`."""
    if layout == "BNSD":
        q, k, v = query, key, value
    else:
        q = _to_bnsd(query, shape.num_heads, layout)
        k = _to_bnsd(key, shape.num_kv_heads, layout)
        v = _to_bnsd(value, shape.num_kv_heads, layout)
    # Plain causal over a square score matrix is SDPA's own (top-left == bottom-right) fast path.
    # bool() here and for enable_gqa: SDPA takes Python bools, and traced with dynamic shapes
    # a shape comparison is a SymBool (bool() guards on it).
    sdpa_causal = bool(causal and attention_mask is None and shape.q_len == shape.kv_len)
    sdpa_mask = dead = None
    if attention_mask is not None or (causal and not sdpa_causal):
        float_mask = attention_mask is not None and attention_mask.dtype != torch.bool
        keep = None  # built only where used: a float mask alone goes to SDPA as it is
        if causal:
            keep = _keep_mask(attention_mask, causal, shape, query.device)
            dead = _dead_rows(keep)
        elif not readable_on_host(attention_mask) or _mask_has_dead_rows(attention_mask):
            # a host read once per mask object; traced, the exact fix-up without the read
            keep = _mask_keep(attention_mask)
            dead = _dead_row_mask(keep)
        elif not float_mask:
            keep = _mask_keep(attention_mask)
        if float_mask:
            sdpa_mask = attention_mask.to(query.dtype)
            if causal:
                sdpa_mask = sdpa_mask.masked_fill(~keep, float("-inf"))
        else:
            sdpa_mask = keep
        if dead is not None:  # let dead rows attend everywhere (no NaN), then zero them below
            sdpa_mask = (
                sdpa_mask | dead
                if sdpa_mask.dtype == torch.bool
                else sdpa_mask.masked_fill(dead, 0.0)
            )
    enable_gqa = bool(shape.num_kv_heads != shape.num_heads)
    if dropout_p > 0.0:
        out = _dropout_attention(
            q, k, v, sdpa_mask, sdpa_causal, scale, enable_gqa, dropout_p, dropout_seed
        )
    else:
        out = F.scaled_dot_product_attention(
            q, k, v, sdpa_mask, 0.0, sdpa_causal, scale=scale, enable_gqa=enable_gqa
        )
    if dead is not None:
        out = out.masked_fill(dead, 0.0)
    return out if layout == "BNSD" else _from_bnsd(out, layout)


def _dropout_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float | None,
    enable_gqa: bool,
    dropout_p: float,
    dropout_seed: int,
) -> torch.Tensor:
    """SDPA's math (BNSD; ``mask`` bool "attend" or additive, ``causal`` only for square scores)
    with dropout on the probabilities: entry ``[b, h, i, j]`` is kept iff the float32
    ``torch.rand([B, Nq, Sq, Skv], generator=Generator(q.device).manual_seed(dropout_seed))``
    is ``>= dropout_p`` there, and kept entries are scaled by ``1 / (1 - dropout_p)``.

    The mask is a function of the seed alone (a private generator, no global RNG state touched),
    so backward's recomputation of this forward drops exactly the entries the forward dropped.
    """
    if enable_gqa:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if causal:
        mask = _causal_keep(q.shape[2], k.shape[2], q.device)
    if mask is not None:
        scores = (
            scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        )
    probs = scores.softmax(dim=-1)
    generator = torch.Generator(device=q.device).manual_seed(dropout_seed)
    kept = torch.rand(probs.shape, generator=generator, dtype=torch.float32, device=q.device)
    kept = kept >= dropout_p
    return (probs * kept) @ v / (1.0 - dropout_p)


def checked_bnsd_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    causal: bool,
    scale: float | None,
) -> torch.Tensor:
    """fused_attention's reference for BNSD query/key/value without mask or dropout whose
    dtypes, shapes (``Nq % Nkv == 0``, same B and D) and ``scale`` the caller has checked."""
    batch, heads, q_len, head_dim = query.shape
    shape = AttentionShape(batch, heads, key.shape[1], q_len, key.shape[2], head_dim)
    return _reference(shape, query, key, value, None, "BNSD", None, None, causal, scale, 0.0, None)


_NPU_CAUSAL_MASKS: dict[torch.device, torch.Tensor] = {}


def npu_causal_mask(device: torch.device) -> torch.Tensor:
    """The compressed causal mask sparse_mode 2/3/4 expect, cached per device."""
    if device not in _NPU_CAUSAL_MASKS:
        size = FUSION_ATTENTION_COMPRESSED_MASK
        ones = torch.ones(size, size, dtype=torch.bool)
        _NPU_CAUSAL_MASKS[device] = ones.triu(diagonal=1).to(device)
    return _NPU_CAUSAL_MASKS[device]


# Whether a float mask carries values other than 0 and "masked" (npu needs pure masks); a host
# read, so kept per mask object (one per forward, not one per layer).
_has_additive_bias = HostValueCache(
    lambda mask: bool(((mask > MASKED_ADDITIVE_BELOW) & (mask != 0)).any())
)


def _npu(
    shape: AttentionShape,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    layout: str,
    num_heads: int | None,
    num_kv_heads: int | None,
    causal: bool,
    scale: float | None,
    dropout_p: float,
    dropout_seed: int | None,
) -> torch.Tensor:
    float_mask = attention_mask is not None and attention_mask.dtype != torch.bool
    refusal = fusion_attention_refusal(
        query.dtype,
        shape.batch,
        shape.num_heads,
        shape.num_kv_heads,
        shape.q_len,
        shape.kv_len,
        shape.head_dim,
    )
    if (
        refusal is not None
        # The kernel draws its dropout mask from the device generator (its seed and offset only
        # feed torch_npu's own grad op), while backward here recomputes through the reference:
        # only the reference's seeded mask is the same in both.
        or dropout_p > 0.0
        or (float_mask and _has_additive_bias(attention_mask))
    ):
        return _reference(
            shape,
            query,
            key,
            value,
            attention_mask,
            layout,
            num_heads,
            num_kv_heads,
            causal,
            scale,
            dropout_p,
            dropout_seed,
        )
    torch_npu = importlib.import_module("torch_npu")
    softmax_scale = 1.0 / math.sqrt(shape.head_dim) if scale is None else scale
    dead = None
    if attention_mask is None and causal and shape.q_len <= shape.kv_len:
        drop_mask, sparse_mode = npu_causal_mask(query.device), NPU_SPARSE_RIGHT_DOWN_CAUSAL
    elif attention_mask is None and not causal:
        drop_mask, sparse_mode = None, 0
    else:
        keep = _keep_mask(attention_mask, causal, shape, query.device)
        # Applied whether or not a row is dead: asking would be a host sync per layer.
        dead = _dead_row_mask(keep)
        keep = keep | dead
        # Full (Sq, Skv) planes; batch/head dims as the mask has them: 11SS, B1SS or BNSS
        # (a head-broadcast-only 1NSS is not a documented shape, so it gets the batch too).
        batch = shape.batch if keep.shape[0] != 1 or keep.shape[1] != 1 else 1
        drop_mask = ~keep.expand(batch, keep.shape[1], shape.q_len, shape.kv_len)
        sparse_mode = 0
    out = torch_npu.npu_fusion_attention(
        query,
        key,
        value,
        shape.num_heads,
        layout,
        atten_mask=drop_mask,
        scale=softmax_scale,
        keep_prob=1.0,
        sparse_mode=sparse_mode,
    )[0]
    if dead is not None:
        out = _from_bnsd(_to_bnsd(out, shape.num_heads, layout).masked_fill(dead, 0.0), layout)
    return out


def _draw_dropout_seed(dropout_p: float, dropout_seed: int | None) -> int | None:
    """One seed from torch's default CPU generator when dropout is on and no seed was given."""
    if dropout_seed is None and dropout_p > 0.0:
        return int(torch.randint(2**62, ()).item())
    return dropout_seed


fused_attention = define_op(
    SPEC,
    check=check_attention_args,
    reference=_reference,
    npu=_npu,
    fake=empty_like_first_input,
    fills={"dropout_seed": _draw_dropout_seed},
    doc="""Softmax attention; output has the query's layout and shape.

    Layouts: "BNSD" q ``[B, Nq, Sq, D]``, k/v ``[B, Nkv, Skv, D]``; "BSH" q ``[B, Sq, Nq*D]``,
    k/v ``[B, Skv, Nkv*D]`` with ``num_heads`` (and ``num_kv_heads``, default ``num_heads``)
    required. ``Nq % Nkv == 0``. ``scale`` defaults to ``1/sqrt(D)``. ``attention_mask``: bool
    (True = attend) ``[B, Skv]`` padding mask or 4-D broadcastable to ``[B, Nq, Sq, Skv]``, or a
    4-D float additive mask. ``causal`` is bottom-right aligned and combines with the mask.
    Fully masked rows give 0.

    ``dropout_p > 0`` drops attention probabilities whenever it is given, in grad mode or not
    (as ``torch.nn.functional.scaled_dot_product_attention`` does; callers pass 0 in eval). The
    mask is a function of ``dropout_seed`` (see `_dropout_attention`); when it is None, one seed
    is drawn from torch's default CPU generator per call, so ``torch.manual_seed`` reproduces a
    run and checkpointing with ``preserve_rng_state`` (the default) recomputes the same mask.
    Bad inputs raise ``ValueError`` naming the argument.
    """,
)
