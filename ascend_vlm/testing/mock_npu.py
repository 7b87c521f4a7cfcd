"""A strict stand-in for ``torch_npu`` so the NPU code path runs on CPU tensors.

``install_mock_npu()`` puts a module named ``torch_npu`` into ``sys.modules`` (with
``npu_fusion_attention``, ``npu_rms_norm``, ``npu_rotary_mul``, ``npu_swiglu``,
``npu_weight_quant_batchmatmul``, ``npu_convert_weight_to_int4pack`` and an ``npu`` submodule)
and sets ``torch.npu`` to that submodule (``is_available``, ``device_count``, ``current_device``,
``set_device``, ``synchronize``, ``Stream``, ``Event``, ``current_stream``, ``stream``,
``recorded_streams`` (what ``Tensor.record_stream``, patched as torch_npu patches it, got),
``mstx`` (profiler ranges), ``get_device_name``, which reports an Atlas A2 SoC, :data:`MOCK_SOC_NAME`), and selects the
``"mock"`` kernel backend (:mod:`ascend_vlm.kernel_backend`).
``uninstall_mock_npu()`` restores exactly what was there before, the backend selection included.

Each stand-in op re-implements the documented contract of the real kernel on CPU tensors,
independently of :mod:`ascend_vlm.ops`: argument validation (``ValueError`` naming the argument,
expected and got), layouts, mask polarity, ``sparse_mode``, ``scale``, ``head_num``, GQA, dtype
support and the return structure. What the docs leave open is marked UNVERIFIED and chosen to be
conservative; unsupported features raise ``NotImplementedError`` instead of guessing.
Sources (Ascend/op-plugin docs): ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_fusion_attention.md``,
``docs/context/torch_npu-npu_rotary_mul.md``, ``（beta）torch_npu-npu_rms_norm.md``,
``（beta）torch_npu-npu_swiglu.md``, ``torch_npu-npu_weight_quant_batchmatmul.md``,
``torch_npu-npu_convert_weight_to_int4pack.md``; summarised with sources in
shared/reference/npu_api.md §1.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import threading
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ascend_vlm import kernel_backend
from ascend_vlm.kernel_backend import MOCK_MARKER
from ascend_vlm.testing._streams import make_stream_api

INT_MAX = 2147483647  # default pre_tockens / next_tockens
# npu_fusion_attention
FA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FA_LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")
FA_MAX_QUERY_HEADS = 256
FA_MAX_HEAD_DIM = 768
FA_COMPRESSED_MASK = 2048  # sparse_mode 2/3/4 take triu(ones(2048, 2048), diagonal=1)
FA_SUPPORTED_SPARSE_MODES = (0, 2, 3)
# npu_rms_norm (A2/A3 dtype table: (x, gamma) pairs)
RMS_NORM_DTYPE_PAIRS = {
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float32),
}
# npu_rotary_mul
ROPE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ROPE_MAX_HEAD_DIM = 896  # D < 896
ROPE_MAX_BN = 1000  # half: B, N < 1000; interleave: B * N < 1000 (B and N of x's layout)
ROPE_MODES = ("half", "interleave")


@dataclass(frozen=True)
class _RopeLayout:
    """One x layout of npu_rotary_mul by the axes of its B, N and S (D is last). Its r1/r2
    tables share S and D with x and are 1 elsewhere (11SD-like); in half mode they may also
    share B (B1SD-like) or be x's full shape."""

    name: str
    batch_axis: int
    heads_axis: int
    seq_axis: int

    def table_patterns(self, rotary_mode: str) -> tuple[frozenset[int], ...]:
        """The sets of axes a table may share with x (all its other dims are 1)."""
        shared = frozenset({self.seq_axis, 3})
        if rotary_mode == "interleave":
            return (shared,)
        return (shared, shared | {self.batch_axis}, frozenset(range(4)))


# The kernel infers the layout from the tables; a table that fits several (full-shape tables,
# or unit dims) is read as the first here, in the docs' order.
ROPE_LAYOUTS = (
    _RopeLayout("BNSD", batch_axis=0, heads_axis=1, seq_axis=2),
    _RopeLayout("BSND", batch_axis=0, heads_axis=2, seq_axis=1),
    _RopeLayout("SBND", batch_axis=1, heads_axis=2, seq_axis=0),
)
SWIGLU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# npu_weight_quant_batchmatmul / npu_convert_weight_to_int4pack (Atlas A2/A3)
WQ_X_DTYPES = (torch.float16, torch.bfloat16)
WQ_MAX_DIM = 65535  # K and N
WQ_INT4_PER_INT32 = 8
# What the mock's torch.npu.get_device_name() reports: an Atlas A2 SoC (the simulated runtime's
# default, ASCEND_VLM_SIM_SOC); tests replace the function to model other SoCs.
MOCK_SOC_NAME = "Ascend910B1"


def _bad(argument: str, expected: str, got: object) -> ValueError:
    return ValueError(f"{argument}: expected {expected}, got {got}")


def _check_dtype(argument: str, tensor: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    if tensor.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise _bad(argument, f"dtype in ({names})", tensor.dtype)


# --- npu_fusion_attention -------------------------------------------------------------------


def _split_heads(
    tensor: torch.Tensor, layout: str, heads: int | None, argument: str
) -> torch.Tensor:
    """One non-TND input as ``[B, N, S, D]``; ``heads`` is needed for the H layouts."""
    ranks = {"BSH": 3, "SBH": 3, "BSND": 4, "BNSD": 4}
    if tensor.dim() != ranks[layout]:
        raise _bad(
            argument,
            f"{ranks[layout]}-D for input_layout {layout!r}",
            f"shape {tuple(tensor.shape)}",
        )
    if layout == "BNSD":
        return tensor
    if layout == "BSND":
        return tensor.transpose(1, 2)
    if tensor.shape[-1] % heads:
        raise _bad(
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
    if atten_mask.dtype not in (torch.bool, torch.uint8):
        raise _bad("atten_mask", "dtype bool or uint8 (1/True = not computed)", atten_mask.dtype)
    if sparse_mode in (2, 3):
        expected = torch.ones(FA_COMPRESSED_MASK, FA_COMPRESSED_MASK, dtype=torch.bool).triu(1)
        if tuple(atten_mask.shape) != expected.shape or not torch.equal(
            atten_mask.bool(), expected
        ):
            raise _bad(
                "atten_mask",
                f"the compressed {FA_COMPRESSED_MASK}x{FA_COMPRESSED_MASK} "
                f"triu(diagonal=1) mask for sparse_mode={sparse_mode}",
                f"a tensor of shape {tuple(atten_mask.shape)} with other contents",
            )
    elif tuple(atten_mask.shape) not in allowed_shapes:
        raise _bad(
            "atten_mask",
            f"one of the shapes {allowed_shapes} ({note})",
            f"shape {tuple(atten_mask.shape)}",
        )


def _cumulative(argument: str, lengths: Any, total: int) -> list[int]:
    """Per-segment lengths from a host list of cumulative ends (trailing zeros = skipped)."""
    if not isinstance(lengths, (list, tuple)) or not all(isinstance(n, int) for n in lengths):
        raise _bad(
            argument,
            "a host list of ints (cumulative lengths, no leading 0)",
            type(lengths).__name__,
        )
    ends = list(lengths)
    while len(ends) > 1 and ends[-1] == 0:  # trailing batches that do not take part
        ends.pop()
    starts = [0, *ends[:-1]]
    if not ends or any(e < s for s, e in zip(starts, ends, strict=True)) or ends[-1] != total:
        raise _bad(argument, f"nondecreasing cumulative lengths ending at T={total}", list(lengths))
    return [e - s for s, e in zip(starts, ends, strict=True)]


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    """Stand-in for ``torch_npu.npu_fusion_attention`` (signature and defaults of the doc).

    ``out = softmax(q @ k^T * scale, masked where atten_mask is 1) @ v`` per head, query head
    ``h`` using kv head ``h // (Nq / Nkv)``. ``scale`` defaults to 1.0 (not 1/sqrt(D)).
    ``atten_mask=None`` computes everything: ``sparse_mode`` and the token bands are then
    ignored, as documented. Returns the documented 7-tuple.
    """
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        _check_dtype(name, tensor, FA_DTYPES)
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise _bad("key/value", f"dtype {query.dtype} like query", (key.dtype, value.dtype))
    if input_layout not in FA_LAYOUTS:
        raise _bad("input_layout", f"one of {FA_LAYOUTS}", repr(input_layout))
    if value.shape != key.shape:
        raise _bad("value", f"shape {tuple(key.shape)} like key", f"shape {tuple(value.shape)}")
    if not 0.0 < keep_prob <= 1.0:
        raise _bad("keep_prob", "a float in (0, 1]", keep_prob)
    for name, given in (("pse", pse), ("padding_mask", padding_mask), ("prefix", prefix)):
        if given is not None:
            raise NotImplementedError(f"mock npu_fusion_attention: {name} is not implemented")
    if keep_prob < 1.0:
        raise NotImplementedError(
            "mock npu_fusion_attention: dropout (keep_prob < 1) is not "
            "implemented; the device RNG cannot be reproduced on CPU"
        )
    if atten_mask is not None and sparse_mode not in FA_SUPPORTED_SPARSE_MODES:
        raise NotImplementedError(
            f"mock npu_fusion_attention: sparse_mode={sparse_mode} is not implemented "
            f"(supported: {FA_SUPPORTED_SPARSE_MODES})"
        )
    if (
        atten_mask is not None
        and sparse_mode == 0
        and (pre_tockens, next_tockens) != (INT_MAX, INT_MAX)
    ):
        raise NotImplementedError(
            "mock npu_fusion_attention: pre_tockens/next_tockens bands are not implemented"
        )
    if not isinstance(head_num, int) or not 1 <= head_num <= FA_MAX_QUERY_HEADS:
        raise _bad("head_num", f"an int in [1, {FA_MAX_QUERY_HEADS}] (query heads)", head_num)
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
    """GQA rule and head-dim limits; ``head_axis`` is where N sits (-3 for BNSD, -2 for TND)."""
    q_heads, kv_heads, head_dim = q.shape[head_axis], k.shape[head_axis], q.shape[-1]
    if q_heads != head_num:
        raise _bad("head_num", f"the query head count {q_heads}", head_num)
    if kv_heads == 0 or q_heads % kv_heads:
        raise _bad("key", f"a head count dividing Nq={q_heads} (Nq/Nkv integer)", kv_heads)
    if k.shape[-1] != head_dim:
        raise _bad("key", f"head dim D={head_dim} like query (Dq = Dk)", k.shape[-1])
    if not 1 <= head_dim <= FA_MAX_HEAD_DIM:
        raise _bad("query", f"head dim D in [1, {FA_MAX_HEAD_DIM}]", head_dim)


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
            raise _bad("key", f"hidden size a multiple of D={head_dim}", tuple(key.shape))
        kv_heads = key.shape[-1] // head_dim
    k = _split_heads(key, layout, kv_heads, "key")
    v = _split_heads(value, layout, kv_heads, "value")
    _check_heads(q, k, head_num, head_axis=-3)
    batch, heads, q_len, _ = q.shape
    kv_len = k.shape[2]
    if k.shape[0] != batch:
        raise _bad("key", f"batch B={batch} like query", k.shape[0])
    if q_len == 0 or kv_len == 0:
        raise _bad("query/key", "sequence lengths S >= 1", (q_len, kv_len))
    drop = None
    if atten_mask is not None:
        shapes = [
            (batch, heads, q_len, kv_len),
            (batch, 1, q_len, kv_len),
            (1, 1, q_len, kv_len),
            (q_len, kv_len),
        ]
        _check_attention_mask(atten_mask, sparse_mode, shapes, "BNSS, B1SS, 11SS or SS")
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
            raise _bad(name, "3-D [T, N, D] for input_layout 'TND'", f"shape {tuple(tensor.shape)}")
    _check_heads(query, key, head_num, head_axis=-2)
    if actual_seq_qlen is None or actual_seq_kvlen is None:
        raise _bad(
            "actual_seq_qlen/actual_seq_kvlen",
            "both given for input_layout 'TND'",
            (actual_seq_qlen, actual_seq_kvlen),
        )
    q_lens = _cumulative("actual_seq_qlen", actual_seq_qlen, query.shape[0])
    kv_lens = _cumulative("actual_seq_kvlen", actual_seq_kvlen, key.shape[0])
    if len(q_lens) != len(kv_lens):
        raise _bad("actual_seq_kvlen", f"{len(q_lens)} segments like actual_seq_qlen", len(kv_lens))
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
        if bool(dead.any()):
            raise _bad(
                "atten_mask",
                "no fully masked row in varlen (TND) mode",
                f"a segment of {q_len} queries x {kv_len} keys with such rows",
            )
        outs.append(out.transpose(0, 1))
        deads.append(dead.transpose(0, 1))
    out = torch.cat(outs).to(query.dtype) if outs else torch.zeros_like(query)
    return out, torch.cat(deads) if deads else torch.zeros(query.shape[:2], dtype=torch.bool)


# --- npu_rms_norm, npu_rotary_mul, npu_swiglu -----------------------------------------------


def npu_rms_norm(
    self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-in for ``torch_npu.npu_rms_norm``: ``y = x / sqrt(mean(x^2) + eps) * gamma`` over
    the trailing ``gamma.dim()`` dims; returns ``(y in x.dtype, rstd in fp32)``. x has 2-8 dims;
    (x, gamma) dtypes follow the A2/A3 table (fp32 gamma allowed for fp16/bf16 x)."""
    if (self.dtype, gamma.dtype) not in RMS_NORM_DTYPE_PAIRS:
        raise _bad(
            "self/gamma",
            f"a dtype pair in {sorted(map(str, RMS_NORM_DTYPE_PAIRS))}",
            (self.dtype, gamma.dtype),
        )
    if not 2 <= self.dim() <= 8:
        raise _bad("self", "2 to 8 dims", f"shape {tuple(self.shape)}")
    if (
        gamma.dim() == 0
        or gamma.dim() > self.dim()
        or (tuple(gamma.shape) != tuple(self.shape[self.dim() - gamma.dim() :]))
    ):
        raise _bad("gamma", "the trailing dims of self", f"shape {tuple(gamma.shape)}")
    reduce_dims = tuple(range(self.dim() - gamma.dim(), self.dim()))
    x = self.float()
    # UNVERIFIED: rstd keeps the normalised dims as size 1 (the doc only says it has the
    # leading dims of self).
    rstd = torch.rsqrt(x.pow(2).mean(dim=reduce_dims, keepdim=True) + epsilon)
    return (x * rstd * gamma.float()).to(self.dtype), rstd


def _rope_layout(input: torch.Tensor, r1: torch.Tensor, rotary_mode: str) -> _RopeLayout:
    """The layout whose documented table pattern `r1` fits (see ROPE_LAYOUTS), else ValueError."""
    for layout in ROPE_LAYOUTS:
        for pattern in layout.table_patterns(rotary_mode):
            if all(r1.shape[i] == (input.shape[i] if i in pattern else 1) for i in range(4)):
                return layout
    patterns = (
        "11SD/1S1D/S11D"
        if rotary_mode == "interleave"
        else "11SD, B1SD, BNSD (or the BSND/SBND equivalents)"
    )
    raise _bad(
        "r1",
        f"a {patterns} table for input {tuple(input.shape)} in {rotary_mode!r} mode",
        f"shape {tuple(r1.shape)}",
    )


def npu_rotary_mul(
    input: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half"
) -> torch.Tensor:
    """Stand-in for ``torch_npu.npu_rotary_mul``: ``out = r1 * x + r2 * rotate(x)`` with
    ``rotate`` = ``cat(-x2, x1)`` of the halves ("half") or ``(-x[1::2], x[0::2])`` pairs
    ("interleave"). All 4-D; r1/r2 in [-1, 1] with a documented broadcast pattern."""
    if rotary_mode not in ROPE_MODES:
        raise _bad("rotary_mode", f"one of {ROPE_MODES}", repr(rotary_mode))
    for name, tensor in (("input", input), ("r1", r1), ("r2", r2)):
        _check_dtype(name, tensor, ROPE_DTYPES)
        if tensor.dim() != 4:
            raise _bad(name, "a 4-D tensor (BNSD, BSND or SBND)", f"shape {tuple(tensor.shape)}")
    if r1.dtype != input.dtype or r2.dtype != input.dtype:
        raise _bad("r1/r2", f"dtype {input.dtype} like input", (r1.dtype, r2.dtype))
    if r2.shape != r1.shape:
        raise _bad("r2", f"shape {tuple(r1.shape)} like r1", f"shape {tuple(r2.shape)}")
    head_dim = input.shape[-1]
    if head_dim % 2 or head_dim >= ROPE_MAX_HEAD_DIM:
        raise _bad("input", f"an even last dim D < {ROPE_MAX_HEAD_DIM}", tuple(input.shape))
    layout = _rope_layout(input, r1, rotary_mode)
    batch, heads = input.shape[layout.batch_axis], input.shape[layout.heads_axis]
    too_big = (
        batch * heads >= ROPE_MAX_BN
        if rotary_mode == "interleave"
        else max(batch, heads) >= ROPE_MAX_BN
    )
    if too_big:
        limit = "B * N" if rotary_mode == "interleave" else "B and N"
        raise _bad(
            "input",
            f"{limit} < {ROPE_MAX_BN} in {rotary_mode!r} mode ({layout.name}: B={batch}, N={heads})",
            tuple(input.shape),
        )
    for name, table in (("r1", r1), ("r2", r2)):
        # A unit table computed in fp32 and rounded to r1's dtype stays within one unit of
        # rounding (eps) of 1; anything beyond is a scaled table the kernel does not take.
        if bool((table.abs() > 1.0 + torch.finfo(table.dtype).eps).any()):
            raise _bad(name, "values in [-1, 1] (cos/sin)", f"max |value| {table.abs().max():g}")
    x = input.float()
    if rotary_mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    else:
        rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).reshape(x.shape)
    return (r1.float() * x + r2.float() * rotated).to(input.dtype)


def npu_swiglu(input: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Stand-in for ``torch_npu.npu_swiglu``: ``silu(A) * B`` with A the FIRST half of
    ``input`` along ``dim``; the input must be contiguous, 1-8 dims."""
    _check_dtype("input", input, SWIGLU_DTYPES)
    if not 1 <= input.dim() <= 8:
        raise _bad("input", "1 to 8 dims", f"shape {tuple(input.shape)}")
    if not input.is_contiguous():
        raise _bad("input", "a contiguous tensor", f"strides {input.stride()}")
    if not -input.dim() <= dim < input.dim() or input.shape[dim] % 2:
        raise _bad("dim", f"a dim of {tuple(input.shape)} with an even size", dim)
    first, second = input.float().chunk(2, dim=dim)
    return (torch.nn.functional.silu(first) * second).to(input.dtype)


# --- npu_weight_quant_batchmatmul, npu_convert_weight_to_int4pack ---------------------------


def _pack_int4_words(values: torch.Tensor) -> torch.Tensor:
    """int32 ``(R, C)`` in [-8, 7] -> int32 ``(R, C/8)``: value ``8j + i`` of a row in bits
    ``4i..4i+3`` of word ``j`` (two's-complement nibbles). UNVERIFIED: the doc only says "8 int4
    per int32, interleaved"; this order is the mock's own, and :func:`_unpack_int4_words` (what
    the mock matmul reads) is its exact inverse."""
    nibbles = (values.to(torch.int64) & 0xF).reshape(values.shape[0], -1, WQ_INT4_PER_INT32)
    shifts = torch.arange(0, 4 * WQ_INT4_PER_INT32, 4, dtype=torch.int64)
    words = (nibbles << shifts).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _unpack_int4_words(words: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_pack_int4_words`: int32 ``(R, C/8)`` -> int64 ``(R, C)`` in [-8, 7]."""
    shifts = torch.arange(0, 4 * WQ_INT4_PER_INT32, 4, dtype=torch.int64)
    nibbles = ((words.to(torch.int64) & 0xFFFFFFFF)[..., None] >> shifts) & 0xF
    return (nibbles - ((nibbles & 0x8) << 1)).reshape(words.shape[0], -1)


def npu_convert_weight_to_int4pack(weight: torch.Tensor, inner_k_tiles: int = 0) -> torch.Tensor:
    """Stand-in for ``torch_npu.npu_convert_weight_to_int4pack``: a contiguous 2-D int32 weight
    ``(k, n)`` or ``(n, k)`` of int4 values in [-8, 7], last dim a multiple of 8, packed into
    int32 ``(k, n/8)`` / ``(n, k/8)``, 8 values per int32 (order: :func:`_pack_int4_words`,
    UNVERIFIED). ``inner_k_tiles`` is reserved (ignored, as documented)."""
    _check_dtype("weight", weight, (torch.int32,))
    if weight.dim() != 2:
        raise _bad("weight", "a 2-D (k, n) or (n, k) tensor", f"shape {tuple(weight.shape)}")
    if not weight.is_contiguous():
        raise _bad("weight", "a contiguous tensor", f"strides {weight.stride()}")
    if weight.shape[1] % WQ_INT4_PER_INT32:
        raise _bad("weight", "a last dim that is a multiple of 8", f"shape {tuple(weight.shape)}")
    if weight.numel() and (weight.min() < -8 or weight.max() > 7):
        raise _bad(
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
) -> torch.Tensor:
    """Stand-in for ``torch_npu.npu_weight_quant_batchmatmul`` (Atlas A2/A3 contract):
    ``y = x @ ((weight + antiquant_offset) * antiquant_scale) + bias`` in x's dtype; the offset
    is ADDED. x (M, K) fp16/bf16; weight (K, N) int8, or int32 carrying int4 (from
    :func:`npu_convert_weight_to_int4pack`; passed transposed, K = 8 * rows); K, N in
    [1, 65535]; scale/offset per tensor (1,)/(1, 1), per channel (1, N)/(N,) or per group
    (ceil(K/G), N), in x's dtype; group size 0 or a multiple of 32 in [32, K-1]; bias (N,) or
    (1, N), contiguous, fp32 for bf16 x and fp16 for fp16 x. The dequantized weight and the
    product are computed in fp32 here (the kernel's internal precision is UNVERIFIED). Output
    quantization (``quant_scale``) and int64 scales are not implemented."""
    if quant_scale is not None or quant_offset is not None:
        raise NotImplementedError(
            "mock npu_weight_quant_batchmatmul: quant_scale/quant_offset are not implemented"
        )
    _check_dtype("x", x, WQ_X_DTYPES)
    if x.dim() != 2:
        raise _bad("x", "2-D (M, K)", f"shape {tuple(x.shape)}")
    if antiquant_scale.dtype == torch.int64:
        raise NotImplementedError("mock npu_weight_quant_batchmatmul: int64 scales")
    _check_dtype("weight", weight, (torch.int8, torch.int32))
    if weight.dim() != 2:
        raise _bad("weight", "2-D (K, N)", f"shape {tuple(weight.shape)}")
    if weight.dtype == torch.int32 and _transposed(weight) and weight.shape == (1, 8):
        raise _bad("weight", "not an int4 (1, 8) weight passed transposed", "that case")
    w = _quant_weight_kn(weight)
    (m, k), n = x.shape, w.shape[1]
    if w.shape[0] != k:
        raise _bad("weight", f"K={k} rows like x (M, K) (int4: 8 per int32 row)", tuple(w.shape))
    if m == 0 or not (1 <= k <= WQ_MAX_DIM and 1 <= n <= WQ_MAX_DIM):
        raise _bad("x/weight", f"M >= 1 and K, N in [1, {WQ_MAX_DIM}]", (m, k, n))
    if not isinstance(inner_precise, int) or inner_precise not in (0, 1):
        raise _bad("inner_precise", "0 or 1", inner_precise)
    group = antiquant_group_size
    if group != 0 and not (32 <= group <= k - 1 and group % 32 == 0):
        raise _bad("antiquant_group_size", f"0 or a multiple of 32 in [32, K-1={k - 1}]", group)
    if antiquant_scale.dtype != x.dtype:
        raise _bad("antiquant_scale", f"dtype {x.dtype} like x", antiquant_scale.dtype)
    shape = tuple(antiquant_scale.shape)
    allowed = [(-(-k // group), n)] if group else [(1,), (1, 1), (1, n), (n,)]
    if shape not in allowed:
        raise _bad("antiquant_scale", f"a shape in {allowed} (group size {group})", shape)
    if antiquant_offset is not None:
        if antiquant_offset.dtype != antiquant_scale.dtype:
            raise _bad(
                "antiquant_offset",
                f"dtype {antiquant_scale.dtype} like antiquant_scale",
                antiquant_offset.dtype,
            )
        if tuple(antiquant_offset.shape) != shape:
            raise _bad(
                "antiquant_offset", f"shape {shape} like antiquant_scale", antiquant_offset.shape
            )
    if bias is not None:
        bias_dtype = torch.float32 if x.dtype == torch.bfloat16 else torch.float16
        if bias.dtype != bias_dtype:
            raise _bad("bias", f"dtype {bias_dtype} for x of dtype {x.dtype}", bias.dtype)
        if tuple(bias.shape) not in ((n,), (1, n)):
            raise _bad("bias", f"shape ({n},) or (1, {n})", tuple(bias.shape))
        if not bias.is_contiguous():
            raise _bad("bias", "a contiguous tensor", f"strides {bias.stride()}")

    def per_row_of_k(table: torch.Tensor) -> torch.Tensor:
        """A scale/offset table as (K, N) (or broadcastable), in fp32."""
        table = table.float().reshape(-1, n) if table.numel() > 1 else table.float().reshape(1, 1)
        return table.repeat_interleave(group, dim=0)[:k] if group else table

    dequantized = w.float()
    if antiquant_offset is not None:
        dequantized = dequantized + per_row_of_k(antiquant_offset)
    dequantized = dequantized * per_row_of_k(antiquant_scale)
    y = x.float() @ dequantized
    if bias is not None:
        y = y + bias.float().reshape(1, n)
    return y.to(x.dtype)


def get_device_name(device: Any = None) -> str:
    """Stand-in for ``torch_npu.npu.get_device_name``: the SoC name, :data:`MOCK_SOC_NAME` for
    every device (torch_npu returns ``aclrtGetSocName``'s string, e.g. ``Ascend910B1``)."""
    return MOCK_SOC_NAME


MSTX_MAX_MESSAGE_BYTES = 255


def _make_mstx(npu: types.ModuleType) -> types.ModuleType:
    """Stand-in for ``torch_npu.npu.mstx``'s range API: ``range_start(msg, stream=None) -> int``
    (a non-zero range id; ``stream`` None marks the host only, else a ``torch.npu`` stream)
    and ``range_end(range_id)``. Strict where the docs are: ``msg`` a string of at most 255
    bytes, ``range_id`` one that ``range_start`` returned and not yet ended. ``ranges`` lists
    ``(msg, stream, ended)`` per started range, for tests."""
    mstx = types.ModuleType("torch_npu.npu.mstx", "mock mstx ranges")
    mstx.ranges = []

    def range_start(msg: str, stream: Any = None) -> int:
        if not isinstance(msg, str) or len(msg.encode()) > MSTX_MAX_MESSAGE_BYTES:
            raise _bad("msg", f"a string of at most {MSTX_MAX_MESSAGE_BYTES} bytes", msg)
        if stream is not None and not isinstance(stream, npu.Stream):
            raise _bad("stream", "None or a torch.npu.Stream", stream)
        mstx.ranges.append([msg, stream, False])
        return len(mstx.ranges)

    def range_end(range_id: int) -> None:
        if not isinstance(range_id, int) or not 1 <= range_id <= len(mstx.ranges):
            raise _bad("range_id", "an id range_start returned", range_id)
        if mstx.ranges[range_id - 1][2]:
            raise _bad("range_id", "a range not yet ended", range_id)
        mstx.ranges[range_id - 1][2] = True

    mstx.range_start = range_start
    mstx.range_end = range_end
    return mstx


# --- install / uninstall --------------------------------------------------------------------

_ABSENT = object()
_LOCK = threading.Lock()
_SAVED: list[dict[str, Any]] = []  # one entry per active install (nesting allowed)


def _build_modules(device_count: int) -> tuple[types.ModuleType, types.ModuleType]:
    mock = types.ModuleType("torch_npu", "ascend_vlm's mock torch_npu (CPU tensors)")
    mock.__spec__ = importlib.machinery.ModuleSpec("torch_npu", loader=None)
    mock.__version__ = "0.0.0+ascend_vlm.mock"
    setattr(mock, MOCK_MARKER, True)
    for op in (
        npu_convert_weight_to_int4pack,
        npu_fusion_attention,
        npu_rms_norm,
        npu_rotary_mul,
        npu_swiglu,
        npu_weight_quant_batchmatmul,
    ):
        setattr(mock, op.__name__, op)
    npu = types.ModuleType("torch_npu.npu", "mock torch.npu namespace")
    npu.__spec__ = importlib.machinery.ModuleSpec("torch_npu.npu", loader=None)
    for name, value in make_stream_api(device_count).items():
        setattr(npu, name, value)
    npu.get_device_name = get_device_name
    npu.recorded_streams = []
    npu.mstx = _make_mstx(npu)
    mock.npu = npu
    return mock, npu


def install_mock_npu(device_count: int = 1) -> types.ModuleType:
    """Install the mock ``torch_npu`` (and ``torch.npu``); returns the mock module.

    Selects the ``"mock"`` kernel backend. Installs nest: each call must be paired with
    :func:`uninstall_mock_npu`. Raises ``RuntimeError`` if a real torch_npu is already imported
    (the mock never shadows it).
    """
    if device_count < 1:
        raise _bad("device_count", "an int >= 1", device_count)
    with _LOCK:
        current = sys.modules.get("torch_npu")
        if current is not None and not getattr(current, MOCK_MARKER, False):
            raise RuntimeError(
                "install_mock_npu: a real torch_npu is imported; refusing to "
                "shadow it (set ASCEND_VLM_TEST_REAL_NPU=1 to test on it)"
            )
        saved = {
            "torch_npu": sys.modules.get("torch_npu", _ABSENT),
            "torch_npu.npu": sys.modules.get("torch_npu.npu", _ABSENT),
            "torch.npu": torch.__dict__.get("npu", _ABSENT),
        }
        mock, npu = _build_modules(device_count)
        sys.modules["torch_npu"] = mock
        sys.modules["torch_npu.npu"] = npu
        torch.npu = npu
        saved["record_stream"] = torch.Tensor.record_stream
        torch.Tensor.record_stream = _record_stream(npu, torch.Tensor.record_stream)
        saved["backend"] = kernel_backend.set_backend("mock")
        _SAVED.append(saved)
        return mock


def uninstall_mock_npu() -> None:
    """Undo the latest :func:`install_mock_npu`, restoring the previous modules and kernel
    backend selection exactly."""
    with _LOCK:
        if not _SAVED:
            raise RuntimeError("uninstall_mock_npu: the mock NPU is not installed")
        saved = _SAVED.pop()
        for name in ("torch_npu", "torch_npu.npu"):
            if saved[name] is _ABSENT:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = saved[name]
        if saved["torch.npu"] is _ABSENT:
            torch.__dict__.pop("npu", None)
        else:
            torch.npu = saved["torch.npu"]
        torch.Tensor.record_stream = saved["record_stream"]
        kernel_backend.set_backend(saved["backend"])


def _record_stream(npu: types.ModuleType, original: Any) -> Any:
    """``Tensor.record_stream`` taking the mock's streams, as torch_npu's patch makes it take
    NPU streams: the mock's (CPU) "NPU tensors" record ``(tensor, stream)`` in
    ``torch.npu.recorded_streams`` (there is no caching allocator to tell); other streams go
    to torch's own method."""

    def record_stream(tensor: torch.Tensor, stream: Any) -> None:
        if not isinstance(stream, npu.Stream):
            return original(tensor, stream)
        npu.recorded_streams.append((tensor, stream))
        return None

    return record_stream


@contextlib.contextmanager
def mock_npu(device_count: int = 1) -> Iterator[types.ModuleType]:
    """``with mock_npu() as torch_npu:`` — the mock installed for the block."""
    module = install_mock_npu(device_count)
    try:
        yield module
    finally:
        uninstall_mock_npu()


kernel_backend.register_mock_installer(install_mock_npu)

__all__ = [
    "get_device_name",
    "install_mock_npu",
    "mock_npu",
    "npu_convert_weight_to_int4pack",
    "npu_fusion_attention",
    "npu_rms_norm",
    "npu_rotary_mul",
    "npu_swiglu",
    "npu_weight_quant_batchmatmul",
    "uninstall_mock_npu",
]
