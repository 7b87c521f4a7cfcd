"""Shared sample inputs and independent naive formulas for the ops tests (OpInfo style).

Each op has a hypothesis strategy drawing a *case* (shapes, dtype, masks, flags) and a case
object that builds the op's inputs and the expected output from a naive float64 formula written
here from the math — it shares no code with ``ascend_vlm.ops`` or the mock NPU. Forward,
backward, mock-NPU and compile tests all draw from these generators.

Every case has ``op_args()`` (the op's positional args and kwargs), ``naive(*args)`` (the float64
formula of those positional args: one tensor, or a tuple for a multi-output op; differentiable
through the floating-point tensors, which the gradient tests rely on) and ``expected()``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch
from hypothesis import strategies as st

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """Comparison tolerances: fp32 1e-5, half precision 2e-2, fp64 1e-10."""
    if dtype == torch.float64:
        return {"atol": 1e-10, "rtol": 1e-10}
    if dtype == torch.float32:
        return {"atol": 1e-5, "rtol": 1e-5}
    return {"atol": 2e-2, "rtol": 2e-2}


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, generator=_generator(seed), dtype=torch.float64).to(dtype)


def as_float64(args: tuple) -> tuple:
    """``args`` with every floating-point tensor converted to float64 (others as they are)."""
    return tuple(
        a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args
    )


class NaiveCase:
    """``expected()``: the case's naive formula on its own inputs, in float64."""

    def expected(self) -> torch.Tensor | tuple[torch.Tensor, ...]:
        args, _ = self.op_args()
        return self.naive(*as_float64(args))


# --- attention ---------------------------------------------------------------------------------


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep: torch.Tensor | None,
    additive: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """float64 ``softmax(q k^T * scale + additive, keep) v`` on BNSD tensors; GQA by repeating
    kv heads; rows with no kept key are 0."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) * scale
    if additive is not None:
        scores = scores + additive.double()
    if keep is None:
        keep = torch.ones(scores.shape, dtype=torch.bool)
    keep = keep.expand(scores.shape)
    scores = scores.masked_fill(~keep, -math.inf)
    dead = ~keep.any(dim=-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(dead, 0.0), dim=-1)
    return (weights @ v).masked_fill(dead, 0.0)


def bottom_right_causal_keep(q_len: int, kv_len: int) -> torch.Tensor:
    """``keep[i, j] = j <= i + kv_len - q_len`` written out with index grids."""
    rows = torch.arange(q_len)[:, None]
    cols = torch.arange(kv_len)[None, :]
    return cols <= rows + (kv_len - q_len)


MASK_KINDS = ("none", "left_pad", "right_pad", "bool_4d", "additive")


@dataclass(frozen=True)
class AttentionCase(NaiveCase):
    layout: str
    batch: int
    kv_heads: int
    group: int
    q_len: int
    kv_len: int
    head_dim: int
    mask_kind: str
    causal: bool
    scale: float | None
    dtype: torch.dtype
    seed: int
    pad_counts: tuple[int, ...] = field(default=())

    @property
    def heads(self) -> int:
        return self.kv_heads * self.group

    def bnsd_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = _randn((self.batch, self.heads, self.q_len, self.head_dim), self.seed, self.dtype)
        kv_shape = (self.batch, self.kv_heads, self.kv_len, self.head_dim)
        return (
            q,
            _randn(kv_shape, self.seed + 1, self.dtype),
            _randn(kv_shape, self.seed + 2, self.dtype),
        )

    def mask(self) -> torch.Tensor | None:
        """The ``attention_mask`` argument (SDPA polarity: True = attend)."""
        if self.mask_kind in ("left_pad", "right_pad"):
            positions = torch.arange(self.kv_len)[None, :]
            pads = torch.tensor(self.pad_counts)[:, None]
            if self.mask_kind == "left_pad":
                return positions >= pads
            return positions < self.kv_len - pads
        gen = _generator(self.seed + 3)
        shape = (self.batch, 1 if self.seed % 2 else self.heads, self.q_len, self.kv_len)
        keep = torch.rand(shape, generator=gen) < 0.7
        if self.mask_kind == "bool_4d":
            return keep
        if self.mask_kind == "additive":  # HF style: 0 where attended, dtype min elsewhere
            return torch.zeros(shape, dtype=self.dtype).masked_fill(
                ~keep, torch.finfo(self.dtype).min
            )
        return None

    def expected_keep(self) -> torch.Tensor | None:
        mask = self.mask()
        keep = None
        if mask is not None:
            keep = mask[:, None, None, :] if mask.dim() == 2 else mask
            if keep.dtype != torch.bool:
                keep = keep == 0
        if self.causal:
            causal = bottom_right_causal_keep(self.q_len, self.kv_len)
            keep = causal if keep is None else keep & causal
        return keep

    def op_args(self) -> tuple[tuple[torch.Tensor, ...], dict]:
        q, k, v = self.bnsd_inputs()
        kwargs = {
            "layout": self.layout,
            "attention_mask": self.mask(),
            "causal": self.causal,
            "scale": self.scale,
        }
        if self.layout == "BSH":
            q, k, v = (to_bsh(t) for t in (q, k, v))
            kwargs.update(num_heads=self.heads, num_kv_heads=self.kv_heads)
        return (q, k, v), kwargs

    def naive(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.layout == "BSH":
            q = from_bsh(q, self.heads)
            k, v = from_bsh(k, self.kv_heads), from_bsh(v, self.kv_heads)
        scale = 1.0 / math.sqrt(self.head_dim) if self.scale is None else self.scale
        out = naive_attention(q, k, v, self.expected_keep(), None, scale)
        return to_bsh(out) if self.layout == "BSH" else out


def to_bsh(bnsd: torch.Tensor) -> torch.Tensor:
    batch, heads, seq, dim = bnsd.shape
    return bnsd.transpose(1, 2).reshape(batch, seq, heads * dim)


def from_bsh(bsh: torch.Tensor, heads: int) -> torch.Tensor:
    batch, seq, hidden = bsh.shape
    return bsh.reshape(batch, seq, heads, hidden // heads).transpose(1, 2)


@st.composite
def attention_cases(
    draw: st.DrawFn, dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
) -> AttentionCase:
    batch = draw(st.integers(1, 3))
    q_len = draw(st.integers(1, 9))
    kv_len = draw(st.one_of(st.just(q_len), st.integers(1, 9)))
    mask_kind = draw(st.sampled_from(MASK_KINDS))
    pad_counts = tuple(draw(st.integers(0, kv_len)) for _ in range(batch))
    return AttentionCase(
        layout=draw(st.sampled_from(("BNSD", "BSH"))),
        batch=batch,
        kv_heads=draw(st.integers(1, 3)),
        group=draw(st.sampled_from((1, 2, 3))),
        q_len=q_len,
        kv_len=kv_len,
        head_dim=draw(st.sampled_from((3, 8, 16))),
        mask_kind=mask_kind,
        causal=draw(st.booleans()),
        scale=draw(st.sampled_from((None, 0.3))),
        dtype=draw(st.sampled_from(dtypes)),
        seed=draw(st.integers(0, 2**16)),
        pad_counts=pad_counts,
    )


@dataclass(frozen=True)
class VarlenCase(NaiveCase):
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    kv_heads: int
    group: int
    head_dim: int
    causal: bool
    scale: float | None
    dtype: torch.dtype
    cu_dtype: torch.dtype
    seed: int

    def op_args(self) -> tuple[tuple[torch.Tensor, ...], dict]:
        heads = self.kv_heads * self.group
        q = _randn((sum(self.q_lens), heads, self.head_dim), self.seed, self.dtype)
        k = _randn((sum(self.kv_lens), self.kv_heads, self.head_dim), self.seed + 1, self.dtype)
        v = _randn((sum(self.kv_lens), self.kv_heads, self.head_dim), self.seed + 2, self.dtype)
        cu_q = torch.tensor([0, *itertools.accumulate(self.q_lens)], dtype=self.cu_dtype)
        cu_k = torch.tensor([0, *itertools.accumulate(self.kv_lens)], dtype=self.cu_dtype)
        return (q, k, v, cu_q, cu_k), {"causal": self.causal, "scale": self.scale}

    def naive(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *_cu) -> torch.Tensor:
        scale = 1.0 / math.sqrt(self.head_dim) if self.scale is None else self.scale
        pieces, q_at, k_at = [], 0, 0
        for q_len, kv_len in zip(self.q_lens, self.kv_lens, strict=True):
            q_seg = q[q_at : q_at + q_len].transpose(0, 1)[None]
            k_seg = k[k_at : k_at + kv_len].transpose(0, 1)[None]
            v_seg = v[k_at : k_at + kv_len].transpose(0, 1)[None]
            q_at, k_at = q_at + q_len, k_at + kv_len
            keep = bottom_right_causal_keep(q_len, kv_len) if self.causal else None
            if kv_len == 0:
                keep = torch.zeros(q_len, 0, dtype=torch.bool)
            pieces.append(
                naive_attention(q_seg, k_seg, v_seg, keep, None, scale)[0].transpose(0, 1)
            )
        return torch.cat(pieces)


@st.composite
def varlen_cases(draw: st.DrawFn, dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES) -> VarlenCase:
    segments = draw(st.integers(1, 12))
    q_lens = tuple(draw(st.integers(0, 7)) for _ in range(segments))
    same = draw(st.booleans())
    kv_lens = q_lens if same else tuple(draw(st.integers(0, 7)) for _ in range(segments))
    if sum(q_lens) == 0:
        q_lens = (*q_lens[:-1], 1)
    return VarlenCase(
        q_lens=q_lens,
        kv_lens=kv_lens,
        kv_heads=draw(st.integers(1, 2)),
        group=draw(st.sampled_from((1, 2))),
        head_dim=draw(st.sampled_from((4, 8))),
        causal=draw(st.booleans()),
        scale=draw(st.sampled_from((None, 0.5))),
        dtype=draw(st.sampled_from(dtypes)),
        cu_dtype=draw(st.sampled_from((torch.int32, torch.int64))),
        seed=draw(st.integers(0, 2**16)),
    )


# --- rms_norm, rotary_embedding, swiglu --------------------------------------------------------


@dataclass(frozen=True)
class RmsNormCase(NaiveCase):
    shape: tuple[int, ...]
    eps: float
    offset: float
    dtype: torch.dtype
    weight_dtype: torch.dtype
    seed: int

    def op_args(self) -> tuple[tuple[torch.Tensor, ...], dict]:
        x = _randn(self.shape, self.seed, self.dtype)
        weight = _randn(self.shape[-1:], self.seed + 1, self.weight_dtype)
        return (x, weight, self.eps), {"offset": self.offset}

    def naive(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rms = torch.sqrt((x * x).sum(-1, keepdim=True) / x.shape[-1] + eps)
        return x / rms * (self.offset + weight)


@st.composite
def rms_norm_cases(draw: st.DrawFn, dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES) -> RmsNormCase:
    dtype = draw(st.sampled_from(dtypes))
    rank = draw(st.integers(1, 4))
    leading = [draw(st.integers(1, 5)) for _ in range(rank - 1)]
    shape = (*leading, draw(st.integers(1, 33)))
    return RmsNormCase(
        shape=shape,
        eps=draw(st.sampled_from((1e-6, 1e-5))),
        offset=draw(st.sampled_from((0.0, 1.0))),
        dtype=dtype,
        weight_dtype=draw(st.sampled_from((dtype, torch.float32))),
        seed=draw(st.integers(0, 2**16)),
    )


def rotate_index_and_sign(rotary_dim: int, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotate(x)[j] = sign[j] * x[index[j]]`` for the NeoX-half or GPT-J pairing."""
    half = rotary_dim // 2
    if interleaved:
        index = torch.tensor([j + 1 if j % 2 == 0 else j - 1 for j in range(rotary_dim)])
        sign = torch.tensor([-1.0 if j % 2 == 0 else 1.0 for j in range(rotary_dim)])
    else:
        index = torch.tensor([j + half if j < half else j - half for j in range(rotary_dim)])
        sign = torch.tensor([-1.0 if j < half else 1.0 for j in range(rotary_dim)])
    return index, sign.double()


@dataclass(frozen=True)
class RotaryCase(NaiveCase):
    """``table_scale`` multiplies the unit cos/sin tables, as transformers' ``attention_scaling``
    does (YaRN, longrope), and is passed to the op as the tables' bound."""

    batch: int
    heads: int
    seq: int
    head_dim: int
    rotary_dim: int
    table_form: str  # "S", "1S", "BS" or "mrope"
    mrope_section: tuple[int, ...] | None
    interleaved: bool
    dtype: torch.dtype
    seed: int
    table_scale: float = 1.0

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        lead = {"S": (), "1S": (1,), "BS": (self.batch,), "mrope": (3, self.batch)}
        angles = (
            _randn(
                (*lead[self.table_form], self.seq, self.rotary_dim), self.seed + 1, torch.float64
            )
            * 3.0
        )
        return tuple((t(angles) * self.table_scale).to(self.dtype) for t in (torch.cos, torch.sin))

    def kwargs(self) -> dict:
        kwargs = {"interleaved": self.interleaved, "table_scale": self.table_scale}
        if self.mrope_section is not None:
            kwargs["mrope_section"] = list(self.mrope_section)
        return kwargs

    def op_args(self) -> tuple[tuple[torch.Tensor, ...], dict]:
        x = _randn((self.batch, self.heads, self.seq, self.head_dim), self.seed, self.dtype)
        return (x, *self.tables()), self.kwargs()

    def selected_tables(self, table: torch.Tensor) -> torch.Tensor:
        """cos/sin as ``[B|1, 1, S, Dr]``; mrope picks component (chunk index % 3) per dim."""
        if self.mrope_section is not None:
            bounds = list(itertools.accumulate(self.mrope_section * 2))
            component = [
                next(i for i, b in enumerate(bounds) if j < b) % 3 for j in range(self.rotary_dim)
            ]
            table = torch.stack([table[component[j], ..., j] for j in range(self.rotary_dim)], -1)
        while table.dim() < 3:
            table = table[None]
        return table[:, None]

    def naive(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cos4, sin4 = self.selected_tables(cos), self.selected_tables(sin)
        index, sign = rotate_index_and_sign(self.rotary_dim, self.interleaved)
        part = x[..., : self.rotary_dim]
        rotated = part * cos4 + part[..., index] * sign * sin4
        return torch.cat((rotated, x[..., self.rotary_dim :]), dim=-1)


@dataclass(frozen=True)
class RotaryPairCase(NaiveCase):
    """rotary_embedding_pair: q from ``single``, a k with ``key_heads`` heads (GQA)."""

    single: RotaryCase
    key_heads: int

    @property
    def dtype(self) -> torch.dtype:
        return self.single.dtype

    def op_args(self) -> tuple[tuple[torch.Tensor, ...], dict]:
        (q, cos, sin), kwargs = self.single.op_args()
        k_shape = (q.shape[0], self.key_heads, *q.shape[2:])
        return (q, _randn(k_shape, self.single.seed + 7, q.dtype), cos, sin), kwargs

    def naive(self, q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        return self.single.naive(q, cos, sin), self.single.naive(k, cos, sin)


@st.composite
def rotary_cases(draw: st.DrawFn, dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES) -> RotaryCase:
    head_dim = draw(st.sampled_from((4, 8, 12, 16)))
    table_form = draw(st.sampled_from(("S", "1S", "BS", "mrope")))
    mrope_section = None
    if table_form == "mrope":
        mrope_section = draw(st.sampled_from(((1, 1, 2), (2, 1, 1), (1, 2, 3), (2, 3, 3))))
        rotary_dim = 2 * sum(mrope_section)
        head_dim = max(head_dim, rotary_dim)
    else:
        rotary_dim = draw(st.sampled_from(sorted({head_dim, head_dim // 2 + head_dim // 2 % 2})))
    return RotaryCase(
        batch=draw(st.integers(1, 3)),
        heads=draw(st.integers(1, 3)),
        seq=draw(st.integers(1, 7)),
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        table_form=table_form,
        mrope_section=mrope_section,
        interleaved=draw(st.booleans()),
        dtype=draw(st.sampled_from(dtypes)),
        seed=draw(st.integers(0, 2**16)),
        table_scale=draw(st.sampled_from((1.0, 1.0, 1.75))),
    )


@st.composite
def rotary_pair_cases(
    draw: st.DrawFn, dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
) -> RotaryPairCase:
    return RotaryPairCase(draw(rotary_cases(dtypes)), draw(st.integers(1, 3)))


@dataclass(frozen=True)
class SwigluCase(NaiveCase):
    shape: tuple[int, ...]
    dim: int
    dtype: torch.dtype
    seed: int

    def op_args(self) -> tuple[tuple[torch.Tensor, ...], dict]:
        return (_randn(self.shape, self.seed, self.dtype), self.dim), {}

    def naive(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        half = x.shape[dim] // 2
        gate, up = x.narrow(dim, 0, half), x.narrow(dim, half, half)
        return gate / (1.0 + torch.exp(-gate)) * up


@st.composite
def swiglu_cases(draw: st.DrawFn, dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES) -> SwigluCase:
    rank = draw(st.integers(1, 4))
    dim = draw(st.integers(-rank, rank - 1))
    shape = [draw(st.integers(1, 5)) for _ in range(rank)]
    shape[dim] = 2 * draw(st.integers(1, 9))
    return SwigluCase(tuple(shape), dim, draw(st.sampled_from(dtypes)), draw(st.integers(0, 2**16)))


# --- weight_quant_matmul ------------------------------------------------------------------------


def int4_bytes(values: torch.Tensor) -> torch.Tensor:
    """The library's int4 layout written from its definition: column k of row n in byte k // 2,
    low nibble for even k, as ``value mod 16``; an odd K leaves the last high nibble 0."""
    rows, cols = values.shape
    nibbles = torch.zeros(rows, cols + cols % 2, dtype=torch.int64)
    nibbles[:, :cols] = values.to(torch.int64) % 16
    return (nibbles[:, 0::2] + 16 * nibbles[:, 1::2]).to(torch.uint8)


QUANT_GROUP_SIZES = (0, 32, 64, 128, 256)


@dataclass(frozen=True)
class WeightQuantCase(NaiveCase):
    """``y = x @ W^T + bias`` with ``W[n, k] = (q[n, k] + offset[g, n]) * scale[g, n]``,
    ``g = k // group_size`` (0: every k in group 0). Scales keep the output of order 1."""

    leading: tuple[int, ...]
    in_features: int
    out_features: int
    bits: int
    group_size: int
    with_offset: bool
    with_bias: bool
    dtype: torch.dtype
    scale_dtype: torch.dtype
    seed: int

    @property
    def groups(self) -> int:
        return 1 if self.group_size == 0 else -(-self.in_features // self.group_size)

    def values(self) -> torch.Tensor:
        """q as int64 ``(N, K)``, the full range of the bit width."""
        low, high = (-128, 128) if self.bits == 8 else (-8, 8)
        shape = (self.out_features, self.in_features)
        return torch.randint(low, high, shape, generator=_generator(self.seed + 1))

    def op_args(self) -> tuple[tuple, dict]:
        q = self.values()
        weight = q.to(torch.int8) if self.bits == 8 else int4_bytes(q)
        q_max = 127 if self.bits == 8 else 7
        shape = (self.groups, self.out_features)
        unit = torch.rand(shape, generator=_generator(self.seed + 2), dtype=torch.float64)
        scale = ((0.5 + unit) / (q_max * math.sqrt(self.in_features))).to(self.scale_dtype)
        offset = bias = None
        if self.with_offset:
            offset = (_randn(shape, self.seed + 3, torch.float64) * q_max / 4).to(self.scale_dtype)
        if self.with_bias:
            bias = _randn((self.out_features,), self.seed + 4, self.scale_dtype)
        x = _randn((*self.leading, self.in_features), self.seed, self.dtype)
        return (x, weight, scale, offset, bias, self.group_size), {}

    def naive(self, x, _weight, scale, offset, bias, group_size) -> torch.Tensor:
        group_of_k = torch.tensor(
            [k // group_size if group_size else 0 for k in range(self.in_features)]
        )
        q = self.values().double()
        shift = 0.0 if offset is None else offset[group_of_k].t()
        w = (q + shift) * scale[group_of_k].t()
        y = x @ w.t()
        return y if bias is None else y + bias


@st.composite
def weight_quant_cases(
    draw: st.DrawFn, dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
) -> WeightQuantCase:
    dtype = draw(st.sampled_from(dtypes))
    group_size = draw(st.sampled_from(QUANT_GROUP_SIZES))
    # K: small, or spanning several groups with a partial last one (or whole groups).
    in_features = draw(
        st.one_of(
            st.integers(1, 40),
            st.integers(2, 5).map(lambda g: g * max(group_size, 32) - 8),
            st.integers(1, 3).map(lambda g: g * max(group_size, 32)),
        )
    )
    return WeightQuantCase(
        leading=tuple(draw(st.integers(1, 3)) for _ in range(draw(st.integers(0, 2)))),
        in_features=in_features,
        out_features=draw(st.integers(1, 9)),
        bits=draw(st.sampled_from((8, 4))),
        group_size=group_size,
        with_offset=draw(st.booleans()),
        with_bias=draw(st.booleans()),
        dtype=dtype,
        scale_dtype=draw(st.sampled_from((dtype, torch.float32))),
        seed=draw(st.integers(0, 2**16)),
    )


# --- moe_experts ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MoeCase(NaiveCase):
    """Routed experts: K distinct experts per token; weights scaled by 1/sqrt(fan-in) keep the
    output of order 1. ``transposed`` stores the expert weights (in, out) as Llama 4 does."""

    tokens: int
    top_k: int
    experts: int
    hidden_size: int
    intermediate_size: int
    transposed: bool
    routing_weights_on: str
    index_dtype: torch.dtype
    weights_dtype: torch.dtype
    dtype: torch.dtype
    seed: int

    def op_args(self) -> tuple[tuple, dict]:
        h, i, e = self.hidden_size, self.intermediate_size, self.experts
        hidden = _randn((self.tokens, h), self.seed, self.dtype)
        scores = torch.rand((self.tokens, e), generator=_generator(self.seed + 1))
        selected = scores.argsort(dim=-1)[:, : self.top_k].to(self.index_dtype)
        weights = torch.rand((self.tokens, self.top_k), generator=_generator(self.seed + 2))
        gate_up = _randn((e, 2 * i, h), self.seed + 3, torch.float64) / math.sqrt(h)
        down = _randn((e, h, i), self.seed + 4, torch.float64) / math.sqrt(i)
        if self.transposed:
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        kwargs = {"transposed": self.transposed, "routing_weights_on": self.routing_weights_on}
        return (
            hidden,
            weights.to(self.weights_dtype),
            selected,
            gate_up.contiguous().to(self.dtype),
            down.contiguous().to(self.dtype),
        ), kwargs

    def naive(self, hidden, weights, selected, gate_up, down) -> torch.Tensor:
        """``y[t] = sum_k w * down_e(silu(gate_e(x)) * up_e(x))``, with ``x = w * x[t]`` instead
        when the weights scale the input; one token and choice at a time."""
        rows = []
        for t in range(self.tokens):
            total = torch.zeros(self.hidden_size, dtype=torch.float64)
            for k in range(self.top_k):
                e = int(selected[t, k])
                w = weights[t, k]
                first = gate_up[e].t() if self.transposed else gate_up[e]  # (2I, H)
                second = down[e].t() if self.transposed else down[e]  # (H, I)
                x = w * hidden[t] if self.routing_weights_on == "input" else hidden[t]
                projected = first @ x
                gate = projected[: self.intermediate_size]
                up = projected[self.intermediate_size :]
                y = second @ (gate / (1.0 + torch.exp(-gate)) * up)
                total = total + (w * y if self.routing_weights_on == "output" else y)
            rows.append(total)
        return torch.stack(rows)


@st.composite
def moe_cases(draw: st.DrawFn, dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES) -> MoeCase:
    dtype = draw(st.sampled_from(dtypes))
    experts = draw(st.integers(1, 6))
    return MoeCase(
        tokens=draw(st.integers(1, 6)),
        top_k=draw(st.integers(1, min(experts, 3))),
        experts=experts,
        hidden_size=draw(st.integers(1, 8)),
        intermediate_size=draw(st.integers(1, 6)),
        transposed=draw(st.booleans()),
        routing_weights_on=draw(st.sampled_from(("output", "input"))),
        index_dtype=draw(st.sampled_from((torch.int64, torch.int32))),
        weights_dtype=draw(st.sampled_from((dtype, torch.float32))),
        dtype=dtype,
        seed=draw(st.integers(0, 2**16)),
    )


# --- gated delta rule (chunk_gated_delta_rule, recurrent_gated_delta_rule) ---------------------


@dataclass(frozen=True)
class GatedDeltaCase(NaiveCase):
    """q/k ``[B, T, Hk, K]`` with keys of norm about 1 (the delta rule is stable for ``beta |k|^2
    <= 2``), v ``[B, T, Hk * group, V]``, g = -softplus(noise) and beta = sigmoid(noise)."""

    batch: int
    tokens: int
    key_heads: int
    group: int
    key_dim: int
    value_dim: int
    with_state: bool
    l2norm: bool
    scale: float | None
    dtype: torch.dtype
    seed: int

    @property
    def output_dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        """The output in the query's dtype, the state in the compute dtype."""
        return self.dtype, torch.float64 if self.dtype == torch.float64 else torch.float32

    def op_args(self) -> tuple[tuple, dict]:
        heads = self.key_heads * self.group
        qk_shape = (self.batch, self.tokens, self.key_heads, self.key_dim)
        gate_shape = (self.batch, self.tokens, heads)
        unit = self.key_dim**-0.5
        q = (_randn(qk_shape, self.seed, torch.float64) * unit).to(self.dtype)
        k = (_randn(qk_shape, self.seed + 1, torch.float64) * unit).to(self.dtype)
        v = _randn((self.batch, self.tokens, heads, self.value_dim), self.seed + 2, self.dtype)
        g = -torch.nn.functional.softplus(_randn(gate_shape, self.seed + 3, torch.float64))
        beta = torch.sigmoid(_randn(gate_shape, self.seed + 4, torch.float64))
        state = None
        if self.with_state:
            state_shape = (self.batch, heads, self.key_dim, self.value_dim)
            state = _randn(state_shape, self.seed + 5, torch.float32)
        args = (q, k, v, g.to(self.dtype), beta.to(self.dtype), state)
        return args, {"scale": self.scale, "use_qk_l2norm": self.l2norm}

    def naive(self, q, k, v, g, beta, state) -> tuple[torch.Tensor, torch.Tensor]:
        """The paper's recurrence with ``S`` ``[V, K]``: ``S_t = e^g_t S_{t-1} (I - beta_t k_t
        k_t^T) + beta_t v_t k_t^T``, ``o_t = S_t q_t * scale``; returns ``(o, S_T^T)``."""
        if self.l2norm:
            q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
            k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        scale = self.key_dim**-0.5 if self.scale is None else self.scale
        q, k = (x.repeat_interleave(self.group, dim=2) for x in (q, k))
        heads = v.shape[2]
        if state is None:
            s = torch.zeros(self.batch, heads, self.value_dim, self.key_dim, dtype=torch.float64)
        else:
            s = state.transpose(-1, -2)
        eye = torch.eye(self.key_dim, dtype=torch.float64)
        outputs = []
        for t in range(self.tokens):
            k_t, b_t = k[:, t, :, :, None], beta[:, t, :, None, None]
            s = g[:, t, :, None, None].exp() * s @ (eye - b_t * k_t @ k_t.transpose(-1, -2))
            s = s + b_t * v[:, t, :, :, None] @ k_t.transpose(-1, -2)
            outputs.append((s @ q[:, t, :, :, None])[..., 0] * scale)
        return torch.stack(outputs, dim=1), s.transpose(-1, -2)


@st.composite
def gated_delta_cases(
    draw: st.DrawFn, dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES, kernel_dims: int = 0
) -> GatedDeltaCase:
    """``kernel_dims``: a head dim the NPU kernel needs, drawn for K and V half of the time."""
    dims = draw(st.sampled_from((0, kernel_dims))) if kernel_dims else 0
    return GatedDeltaCase(
        batch=draw(st.integers(1, 2)),
        tokens=draw(st.integers(1, 6)),
        key_heads=draw(st.integers(1, 2)),
        group=draw(st.integers(1, 2)),
        key_dim=dims or draw(st.integers(1, 4)),
        value_dim=dims or draw(st.integers(1, 4)),
        with_state=draw(st.booleans()),
        l2norm=draw(st.booleans()),
        scale=draw(st.sampled_from((None, 0.7))),
        dtype=draw(st.sampled_from(dtypes)),
        seed=draw(st.integers(0, 2**16)),
    )


# --- causal_conv1d ------------------------------------------------------------------------------


@dataclass(frozen=True)
class CausalConvCase(NaiveCase):
    batch: int
    tokens: int
    channels: int
    width: int
    state_len: int | None  # None: no conv_state
    with_bias: bool
    activation: str | None
    dtype: torch.dtype
    seed: int

    @property
    def output_dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        return self.dtype, self.dtype

    def op_args(self) -> tuple[tuple, dict]:
        x = _randn((self.batch, self.tokens, self.channels), self.seed, self.dtype)
        weight = _randn((self.channels, self.width), self.seed + 1, self.dtype)
        state = bias = None
        if self.state_len is not None:
            state_shape = (self.batch, self.channels, self.state_len)
            state = _randn(state_shape, self.seed + 2, self.dtype)
        if self.with_bias:
            bias = _randn((self.channels,), self.seed + 3, self.dtype)
        return (x, weight, state, bias), {"activation": self.activation}

    def naive(self, x, weight, state, bias) -> tuple[torch.Tensor, torch.Tensor]:
        """``out[t] = act(bias + sum_j weight[:, j] * xs[t + S - W + 1 + j])`` over ``xs`` = the
        state's steps then x's; the new state is the last S steps of ``xs``."""
        length = self.width - 1 if state is None else state.shape[-1]
        steps = [] if state is None else list(state.unbind(-1))
        if state is None:
            steps = [x.new_zeros(self.batch, self.channels)] * length
        steps += list(x.unbind(1))
        outputs = []
        for t in range(self.tokens):
            window = steps[t + length - self.width + 1 : t + length + 1]
            out = sum(weight[:, j] * step for j, step in enumerate(window))
            out = out if bias is None else out + bias
            outputs.append(out if self.activation is None else out * torch.sigmoid(out))
        new_state = (
            torch.stack(steps[len(steps) - length :], dim=-1)
            if length
            else x.new_zeros(self.batch, self.channels, 0)
        )
        return torch.stack(outputs, dim=1), new_state


@st.composite
def causal_conv_cases(
    draw: st.DrawFn, dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
) -> CausalConvCase:
    width = draw(st.integers(1, 4))
    return CausalConvCase(
        batch=draw(st.integers(1, 2)),
        tokens=draw(st.integers(1, 6)),
        channels=draw(st.integers(1, 5)),
        width=width,
        state_len=draw(st.sampled_from((None, width - 1, width))),
        with_bias=draw(st.booleans()),
        activation=draw(st.sampled_from((None, "silu"))),
        dtype=draw(st.sampled_from(dtypes)),
        seed=draw(st.integers(0, 2**16)),
    )


# --- helpers shared by the op tests -----------------------------------------------------------


def on_device(args: tuple, kwargs: dict, device: torch.device) -> tuple[tuple, dict]:
    """Move every tensor argument to ``device`` (the mock runs on CPU, real NPU on npu:0)."""

    def move(value):
        return value.to(device) if isinstance(value, torch.Tensor) else value

    return tuple(move(a) for a in args), {name: move(v) for name, v in kwargs.items()}


def assert_matches_naive(
    out: torch.Tensor,
    expected: torch.Tensor,
    dtype: torch.dtype,
    output_dtype: torch.dtype | None = None,
) -> None:
    """``out`` has ``output_dtype`` (default ``dtype``) and matches within ``dtype``'s
    tolerance (the inputs' precision bounds the error of an output computed in more)."""
    output_dtype = dtype if output_dtype is None else output_dtype
    assert out.dtype == output_dtype, f"output dtype {out.dtype}, expected {output_dtype}"
    assert out.shape == expected.shape, (
        f"output shape {tuple(out.shape)} vs {tuple(expected.shape)}"
    )
    torch.testing.assert_close(out.cpu().double(), expected, **tolerance(dtype))


class KernelSpy:
    """Counts calls of one torch_npu function (wrapped in place with pytest's monkeypatch);
    ``shapes`` holds each call's positional tensor shapes, in call order."""

    def __init__(self, monkeypatch, module, name: str) -> None:
        self.calls = 0
        self.shapes: list[tuple[tuple[int, ...], ...]] = []
        original = getattr(module, name)

        def counting(*args, **kwargs):
            self.calls += 1
            self.shapes.append(tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor)))
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, counting)
