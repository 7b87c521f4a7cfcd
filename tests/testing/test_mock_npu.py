"""The mock torch_npu is strict: it reproduces each kernel's documented contract and rejects or
mis-computes what the real kernel would, so tests of the NPU path cannot pass by accident.
Oracle: torch SDPA / plain torch formulas, independent of the mock."""

from __future__ import annotations

import re
import sys

import pytest
import torch
import torch.nn.functional as F

from ascend_vlm.testing import install_mock_npu, mock_npu, mock_ops, uninstall_mock_npu
from ascend_vlm.testing.npu_namespace import MOCK_SOC_NAME

COMPRESSED_CAUSAL = torch.ones(2048, 2048, dtype=torch.bool).triu(diagonal=1)


def _qkv(batch=2, heads=4, kv_heads=2, q_len=3, kv_len=5, dim=8, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, q_len, dim, generator=gen).to(dtype)
    k = torch.randn(batch, kv_heads, kv_len, dim, generator=gen).to(dtype)
    v = torch.randn(batch, kv_heads, kv_len, dim, generator=gen).to(dtype)
    return q, k, v


def _sdpa(q, k, v, keep=None, scale=None):
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=keep, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


def _raises(error, message):
    return pytest.raises(error, match=re.escape(message))


# --- npu_fusion_attention ---------------------------------------------------------------------


def test_atten_mask_true_means_not_computed_and_inverting_it_changes_the_result() -> None:
    q, k, v = _qkv()
    drop = torch.rand(2, 1, 3, 5, generator=torch.Generator().manual_seed(1)) < 0.3
    drop[..., 0] = False  # keep every row alive
    expected = _sdpa(q, k, v, keep=~drop, scale=0.5)
    out = mock_ops.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=drop, scale=0.5)[0]
    torch.testing.assert_close(out, expected)
    inverted = mock_ops.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=~drop, scale=0.5)[0]
    assert not torch.allclose(inverted, expected, atol=1e-3)


def test_scale_defaults_to_one_not_inverse_sqrt_d() -> None:
    q, k, v = _qkv()
    out = mock_ops.npu_fusion_attention(q, k, v, 4, "BNSD")[0]
    torch.testing.assert_close(out, _sdpa(q, k, v, scale=1.0))
    assert not torch.allclose(out, _sdpa(q, k, v), atol=1e-3)


def test_sparse_modes_2_and_3_align_causality_top_left_and_bottom_right() -> None:
    q, k, v = _qkv(q_len=3, kv_len=5)
    rows, cols = torch.arange(3)[:, None], torch.arange(5)[None, :]
    top_left = mock_ops.npu_fusion_attention(
        q, k, v, 4, "BNSD", atten_mask=COMPRESSED_CAUSAL, sparse_mode=2, scale=0.3
    )[0]
    bottom_right = mock_ops.npu_fusion_attention(
        q, k, v, 4, "BNSD", atten_mask=COMPRESSED_CAUSAL, sparse_mode=3, scale=0.3
    )[0]
    torch.testing.assert_close(top_left, _sdpa(q, k, v, keep=cols <= rows, scale=0.3))
    torch.testing.assert_close(bottom_right, _sdpa(q, k, v, keep=cols <= rows + 2, scale=0.3))


def test_sparse_mode_without_mask_computes_full_attention() -> None:
    q, k, v = _qkv()
    out = mock_ops.npu_fusion_attention(q, k, v, 4, "BNSD", sparse_mode=3, scale=0.3)[0]
    torch.testing.assert_close(out, _sdpa(q, k, v, scale=0.3))


@pytest.mark.parametrize(
    "mask",
    [torch.ones(2048, 2048, dtype=torch.bool).tril(), torch.ones(3, 5, dtype=torch.bool).triu(1)],
    ids=["sdpa-polarity", "uncompressed"],
)
def test_causal_modes_demand_the_compressed_triu_mask(mask: torch.Tensor) -> None:
    q, k, v = _qkv()
    with _raises(ValueError, "atten_mask: expected the compressed 2048x2048 triu(diagonal=1)"):
        mock_ops.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=mask, sparse_mode=3)


@pytest.mark.parametrize("mode", [1, 4, 5, 6, 7, 8])
def test_other_sparse_modes_are_not_implemented(mode: int) -> None:
    q, k, v = _qkv()
    with _raises(NotImplementedError, f"sparse_mode={mode} is not implemented"):
        mock_ops.npu_fusion_attention(
            q, k, v, 4, "BNSD", atten_mask=COMPRESSED_CAUSAL, sparse_mode=mode
        )


def _to_layout(bnsd: torch.Tensor, layout: str) -> torch.Tensor:
    bsnd = bnsd.transpose(1, 2)
    bsh = bsnd.reshape(bsnd.shape[0], bsnd.shape[1], -1)
    return {"BNSD": bnsd, "BSND": bsnd, "BSH": bsh, "SBH": bsh.transpose(0, 1)}[layout]


@pytest.mark.parametrize("layout", ["BNSD", "BSND", "BSH", "SBH"])
def test_layouts_agree_and_output_keeps_the_layout(layout: str) -> None:
    q, k, v = _qkv()
    out = mock_ops.npu_fusion_attention(
        *(_to_layout(t, layout) for t in (q, k, v)), 4, layout, scale=0.3
    )[0]
    torch.testing.assert_close(out, _to_layout(_sdpa(q, k, v, scale=0.3), layout))


def test_wrong_layout_is_rejected_or_changes_the_result() -> None:
    q, k, v = _qkv()
    with _raises(ValueError, "query: expected 3-D for input_layout 'BSH'"):
        mock_ops.npu_fusion_attention(q, k, v, 4, "BSH")
    square_q, square_k, square_v = _qkv(heads=4, kv_heads=4, q_len=4, kv_len=4)
    as_bnsd = mock_ops.npu_fusion_attention(square_q, square_k, square_v, 4, "BNSD", scale=0.3)[0]
    as_bsnd = mock_ops.npu_fusion_attention(square_q, square_k, square_v, 4, "BSND", scale=0.3)[0]
    assert not torch.allclose(as_bnsd, as_bsnd, atol=1e-3)


BAD_ATTENTION_CALLS = {
    "head_num": (
        lambda q, k, v: mock_ops.npu_fusion_attention(q, k, v, 2, "BNSD"),
        ValueError,
        "head_num: expected the query head count 4, got 2",
    ),
    "gqa": (
        lambda q, k, v: mock_ops.npu_fusion_attention(q[:, :3], k, v, 3, "BNSD"),
        ValueError,
        "key: expected a head count dividing Nq=3",
    ),
    "fp64": (
        lambda q, k, v: mock_ops.npu_fusion_attention(
            q.double(), k.double(), v.double(), 4, "BNSD"
        ),
        ValueError,
        "query: expected dtype in (float16, bfloat16, float32), got torch.float64",
    ),
    "mixed": (
        lambda q, k, v: mock_ops.npu_fusion_attention(q, k.half(), v, 4, "BNSD"),
        ValueError,
        "key/value: expected dtype torch.float32 like query",
    ),
    "layout": (
        lambda q, k, v: mock_ops.npu_fusion_attention(q, k, v, 4, "NSD"),
        ValueError,
        "input_layout: expected one of",
    ),
    "mask_dtype": (
        lambda q, k, v: mock_ops.npu_fusion_attention(
            q, k, v, 4, "BNSD", atten_mask=torch.zeros(3, 5)
        ),
        ValueError,
        "atten_mask: expected dtype bool or uint8",
    ),
    "mask_shape": (
        lambda q, k, v: mock_ops.npu_fusion_attention(
            q, k, v, 4, "BNSD", atten_mask=torch.zeros(2, 5, dtype=torch.bool)
        ),
        ValueError,
        "atten_mask: expected one of the shapes",
    ),
    "keep_prob": (
        lambda q, k, v: mock_ops.npu_fusion_attention(q, k, v, 4, "BNSD", keep_prob=0.0),
        ValueError,
        "keep_prob: expected a float in (0, 1]",
    ),
    "dropout": (
        lambda q, k, v: mock_ops.npu_fusion_attention(q, k, v, 4, "BNSD", keep_prob=0.9),
        NotImplementedError,
        "dropout (keep_prob < 1) is not implemented",
    ),
    "padding_mask": (
        lambda q, k, v: mock_ops.npu_fusion_attention(q, k, v, 4, "BNSD", padding_mask=q),
        NotImplementedError,
        "padding_mask is not implemented",
    ),
}


@pytest.mark.parametrize("name", sorted(BAD_ATTENTION_CALLS))
def test_fusion_attention_rejects_what_the_kernel_rejects(name: str) -> None:
    call, error, message = BAD_ATTENTION_CALLS[name]
    with _raises(error, message):
        call(*_qkv())


def test_returns_the_documented_seven_tuple() -> None:
    result = mock_ops.npu_fusion_attention(*_qkv(), 4, "BNSD")
    assert len(result) == 7
    assert all(isinstance(t, torch.Tensor) for t in result[:4])
    assert all(isinstance(n, int) for n in result[4:])
    assert result[1].dtype == result[2].dtype == torch.float32


def _tnd(lengths: list[int], heads: int = 2, dim: int = 4) -> torch.Tensor:
    return torch.randn(sum(lengths), heads, dim, generator=torch.Generator().manual_seed(3))


def test_tnd_attends_within_cumulative_segments() -> None:
    lengths = [2, 0, 3]
    q = k = v = _tnd(lengths)
    out = mock_ops.npu_fusion_attention(
        q, k, v, 2, "TND", scale=0.5, actual_seq_qlen=[2, 2, 5], actual_seq_kvlen=[2, 2, 5]
    )[0]
    for start, stop in ((0, 2), (2, 5)):
        seg = q[start:stop].transpose(0, 1)[None]
        expected = _sdpa(seg, seg, seg, scale=0.5)[0].transpose(0, 1)
        torch.testing.assert_close(out[start:stop], expected)
    trailing = mock_ops.npu_fusion_attention(
        q, k, v, 2, "TND", scale=0.5, actual_seq_qlen=[2, 5, 0], actual_seq_kvlen=[2, 5, 0]
    )[0]
    torch.testing.assert_close(trailing, out)


BAD_TND_CALLS = {
    "tensor": (
        {"actual_seq_qlen": torch.tensor([2, 5]), "actual_seq_kvlen": [2, 5]},
        "actual_seq_qlen: expected a host list of ints",
    ),
    "missing": ({"actual_seq_kvlen": [2, 5]}, "actual_seq_qlen/actual_seq_kvlen: expected both"),
    "short": (
        {"actual_seq_qlen": [2, 4], "actual_seq_kvlen": [2, 5]},
        "actual_seq_qlen: expected nondecreasing cumulative lengths ending at T=5",
    ),
    "mask_shape": (
        {
            "actual_seq_qlen": [2, 5],
            "actual_seq_kvlen": [2, 5],
            "atten_mask": torch.zeros(1, 1, 3, 3, dtype=torch.bool),
        },
        "atten_mask: expected one of the shapes [(3, 3)] (varlen takes only SS)",
    ),
    "dead_row": (
        {
            "actual_seq_qlen": [2, 5],
            "actual_seq_kvlen": [2, 5],
            "atten_mask": torch.ones(3, 3, dtype=torch.bool),
        },
        "atten_mask: expected no fully masked row in varlen (TND) mode",
    ),
}


@pytest.mark.parametrize("name", sorted(BAD_TND_CALLS))
def test_tnd_rejects_bad_lengths_and_masks(name: str) -> None:
    kwargs, message = BAD_TND_CALLS[name]
    q = _tnd([2, 3])
    with _raises(ValueError, message):
        mock_ops.npu_fusion_attention(q, q, q, 2, "TND", **kwargs)


# --- npu_rms_norm, npu_rotary_mul, npu_swiglu -------------------------------------------------


def test_rms_norm_returns_y_and_fp32_rstd() -> None:
    x = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    gamma = torch.randn(8)
    y, rstd = mock_ops.npu_rms_norm(x, gamma, epsilon=1e-5)
    x32 = x.float()
    expected_rstd = 1.0 / torch.sqrt(x32.square().mean(-1, keepdim=True) + 1e-5)
    assert y.dtype == torch.bfloat16 and rstd.dtype == torch.float32
    torch.testing.assert_close(rstd, expected_rstd)
    torch.testing.assert_close(y, (x32 * expected_rstd * gamma).bfloat16())


@pytest.mark.parametrize(
    ("x", "gamma", "message"),
    [
        (
            torch.randn(2, 8),
            torch.randn(8, dtype=torch.bfloat16),
            "input/gamma: expected a dtype pair",
        ),
        (torch.randn(8), torch.randn(8), "input: expected 2 to 8 dims"),
        (torch.randn(2, 8), torch.randn(4), "gamma: expected the trailing dims of input"),
    ],
    ids=["fp32-x-bf16-gamma", "1-D", "gamma-shape"],
)
def test_rms_norm_rejects_what_the_kernel_rejects(x, gamma, message) -> None:
    with _raises(ValueError, message):
        mock_ops.npu_rms_norm(x, gamma)


def _angles(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(4)) * 3


def test_rotary_modes_differ_and_follow_their_formulas() -> None:
    x = torch.randn(2, 3, 5, 8)
    angle = _angles(1, 1, 5, 8)
    cos, sin = angle.cos(), angle.sin()
    half = mock_ops.npu_rotary_mul(x, cos, sin)
    interleave = mock_ops.npu_rotary_mul(x, cos, sin, rotary_mode="interleave")
    x1, x2 = x[..., :4], x[..., 4:]
    torch.testing.assert_close(half, x * cos + torch.cat((-x2, x1), -1) * sin)
    pairs = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    torch.testing.assert_close(interleave, x * cos + pairs * sin)
    assert not torch.allclose(half, interleave, atol=1e-3)


@pytest.mark.parametrize(
    ("table_shape", "mode", "message"),
    [
        ((2, 1, 5, 8), "interleave", "r1: expected a 11SD/1S1D/S11D table"),
        ((1, 3, 5, 8), "half", "r1: expected a 11SD, B1SD, BNSD"),
        ((5, 8), "half", "r1: expected a 4-D tensor"),
    ],
    ids=["B1SD-interleave", "1NSD", "2-D"],
)
def test_rotary_rejects_undocumented_table_shapes(table_shape, mode, message) -> None:
    angle = _angles(*table_shape)
    with _raises(ValueError, message):
        mock_ops.npu_rotary_mul(torch.randn(2, 3, 5, 8), angle.cos(), angle.sin(), rotary_mode=mode)


def test_rotary_takes_the_documented_bsnd_case_with_a_long_sequence() -> None:
    # docs' case 2: x [2, 8192, 5, 128] with 1S1D tables; B=2 and N=5 are within the limit
    x, angle = torch.randn(2, 8192, 5, 128), _angles(1, 8192, 1, 128)
    x1, x2 = x.chunk(2, dim=-1)
    expected = angle.cos() * x + angle.sin() * torch.cat((-x2, x1), dim=-1)
    torch.testing.assert_close(mock_ops.npu_rotary_mul(x, angle.cos(), angle.sin()), expected)


@pytest.mark.parametrize(
    ("x_shape", "table_shape", "mode", "message"),
    [
        ((1000, 2, 5, 8), (1, 1, 5, 8), "half", "(BNSD: B=1000, N=2)"),
        ((2, 5, 1000, 8), (1, 5, 1, 8), "half", "(BSND: B=2, N=1000)"),
        ((5, 2, 1000, 8), (5, 1, 1, 8), "half", "(SBND: B=2, N=1000)"),
        ((40, 25, 25, 8), (1, 25, 1, 8), "interleave", "B * N < 1000 in 'interleave' mode"),
    ],
    ids=["BNSD-batch", "BSND-heads", "SBND-heads", "BSND-interleave"],
)
def test_rotary_limits_b_and_n_of_the_layout_its_tables_give(
    x_shape, table_shape, mode, message
) -> None:
    angle = _angles(*table_shape)
    with _raises(ValueError, message):
        mock_ops.npu_rotary_mul(torch.randn(x_shape), angle.cos(), angle.sin(), rotary_mode=mode)


def test_rotary_rejects_tables_outside_unit_range_and_mixed_dtypes() -> None:
    x = torch.randn(1, 2, 5, 8)
    table = torch.full((1, 1, 5, 8), 2.0)
    with _raises(ValueError, "r1: expected values in [-1, 1] (cos/sin)"):
        mock_ops.npu_rotary_mul(x, table, table)
    with _raises(ValueError, "r1/r2: expected dtype torch.float32 like input"):
        mock_ops.npu_rotary_mul(x, table.half().clamp(-1, 1), table.half().clamp(-1, 1))


def _doc_rotate_matrix(dim: int, mode: str) -> torch.Tensor:
    """A ``rotate`` matrix with ``x @ rotate`` = the mode's built-in rotation (the docs'
    example 3 for "half"; the signed pair swap for "interleave")."""
    rotate = torch.zeros(dim, dim)
    if mode == "half":
        rotate[: dim // 2, dim // 2 :] = torch.eye(dim // 2)
        rotate[dim // 2 :, : dim // 2] = -torch.eye(dim // 2)
    else:
        for i in range(0, dim, 2):
            rotate[i, i + 1], rotate[i + 1, i] = 1.0, -1.0
    return rotate


@pytest.mark.parametrize("mode", ["half", "interleave"])
def test_rotary_with_a_rotate_matrix_uses_x_at_rotate(mode) -> None:
    x, angle = torch.randn(2, 3, 5, 8), _angles(1, 1, 5, 8)
    cos, sin = angle.cos(), angle.sin()
    built_in = mock_ops.npu_rotary_mul(x, cos, sin, mode)
    rotate = _doc_rotate_matrix(8, mode)
    torch.testing.assert_close(mock_ops.npu_rotary_mul(x, cos, sin, mode, rotate), built_in)
    # Any matrix is taken: x_new = x @ rotate, whatever the mode.
    swap = torch.eye(8).flip(0)
    torch.testing.assert_close(
        mock_ops.npu_rotary_mul(x, cos, sin, mode, rotate=swap), x * cos + (x @ swap) * sin
    )


def test_rotary_rejects_a_rotate_matrix_of_the_wrong_shape_or_dtype() -> None:
    x, angle = torch.randn(2, 3, 5, 8), _angles(1, 1, 5, 8)
    with _raises(ValueError, "rotate: expected a 2-D (D, D) = (8, 8) matrix, got (4, 4)"):
        mock_ops.npu_rotary_mul(x, angle.cos(), angle.sin(), rotate=torch.eye(4))
    with _raises(ValueError, "rotate: expected dtype torch.float32 like input"):
        mock_ops.npu_rotary_mul(x, angle.cos(), angle.sin(), rotate=torch.eye(8).half())


def test_swiglu_gates_the_first_half_and_needs_contiguous_input() -> None:
    gate, up = torch.randn(3, 4), torch.randn(3, 4)
    torch.testing.assert_close(mock_ops.npu_swiglu(torch.cat((gate, up), -1)), F.silu(gate) * up)
    with _raises(ValueError, "input: expected a contiguous tensor"):
        mock_ops.npu_swiglu(torch.randn(8, 3).t())
    with _raises(ValueError, "dim: expected a dim of (3, 5) with an even size"):
        mock_ops.npu_swiglu(torch.randn(3, 5))


# --- npu_weight_quant_batchmatmul, npu_convert_weight_to_int4pack ----------------------------


def _wq_inputs(k=100, n=6, m=3, rows=1, dtype=torch.float16, bits=8):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(m, k, generator=gen).to(dtype)
    low, high = (-128, 128) if bits == 8 else (-8, 8)
    q = torch.randint(low, high, (n, k), generator=gen)  # our (N, K) rows
    scale = (torch.rand(rows, n, generator=gen) / 50).to(dtype)
    offset = torch.randn(rows, n, generator=gen).to(dtype)
    return x, q, scale, offset


def _antiquant(x, q_kn, scale, offset, group, bias=None):
    """The doc's formula in float64: x @ ((w + offset) * scale) + bias, per-group rows repeated."""
    rows = torch.arange(q_kn.shape[0]) // group if group else torch.zeros(q_kn.shape[0]).long()
    w = (q_kn.double() + offset.double()[rows]) * scale.double()[rows]
    y = x.double() @ w
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("group", [0, 32, 64])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_weight_quant_adds_the_offset_per_group_and_keeps_x_dtype(group, dtype) -> None:
    rows = -(-100 // group) if group else 1  # K = 100: a partial last group
    x, q, scale, offset = _wq_inputs(rows=rows, dtype=dtype)
    bias = torch.randn(6).to(torch.float32 if dtype == torch.bfloat16 else torch.float16)
    weight = q.to(torch.int8).t()  # the transposed view of (N, K) rows
    out = mock_ops.npu_weight_quant_batchmatmul(
        x, weight, scale, offset, bias=bias, antiquant_group_size=group
    )
    assert out.dtype == dtype and out.shape == (3, 6)
    expected = _antiquant(x, q.t(), scale, offset, group, bias)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)
    subtracted = _antiquant(x, q.t(), scale, -offset, group, bias)
    assert not torch.allclose(out.double(), subtracted, atol=1e-1)


@pytest.mark.parametrize("transposed", [True, False])
def test_int4pack_round_trips_through_the_matmul_in_both_orientations(transposed) -> None:
    x, q, scale, offset = _wq_inputs(k=64, n=16, rows=2, bits=4)
    values = (q if transposed else q.t()).to(torch.int32).contiguous()  # (n, k) or (k, n)
    packed = mock_ops.npu_convert_weight_to_int4pack(values)
    assert packed.dtype == torch.int32 and packed.shape == (values.shape[0], values.shape[1] // 8)
    weight = packed.t() if transposed else packed
    out = mock_ops.npu_weight_quant_batchmatmul(x, weight, scale, offset, antiquant_group_size=32)
    expected = _antiquant(x, q.t(), scale, offset, 32)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    ("weight", "message"),
    [
        (
            torch.zeros(4, 8, dtype=torch.int64),
            "weight: expected dtype in (int32), got torch.int64",
        ),
        (torch.zeros(4, 12, dtype=torch.int32), "weight: expected a last dim that is a multiple"),
        (torch.zeros(16, 8, dtype=torch.int32).t(), "weight: expected a contiguous tensor"),
        (torch.full((2, 8), 8, dtype=torch.int32), "weight: expected int4 values in [-8, 7]"),
        (torch.zeros(8, dtype=torch.int32), "weight: expected a 2-D (k, n) or (n, k) tensor"),
    ],
    ids=["dtype", "last-dim", "contiguous", "range", "rank"],
)
def test_int4pack_rejects_what_the_converter_rejects(weight, message) -> None:
    with _raises(ValueError, message):
        mock_ops.npu_convert_weight_to_int4pack(weight)


def _bad_wq(**changes):
    x, q, scale, offset = _wq_inputs(rows=4)
    call = {
        "x": x,
        "weight": q.to(torch.int8).t(),
        "antiquant_scale": scale,
        "antiquant_offset": offset,
        "antiquant_group_size": 32,
        **changes,
    }
    return lambda: mock_ops.npu_weight_quant_batchmatmul(**call)


BAD_WEIGHT_QUANT_CALLS = {
    "x_fp32": (
        _bad_wq(x=torch.randn(3, 100)),
        "x: expected dtype in (float16, bfloat16), got torch.float32",
    ),
    "x_rank": (_bad_wq(x=torch.randn(1, 3, 100).half()), "x: expected 2-D (M, K)"),
    "k": (_bad_wq(x=torch.randn(3, 99).half()), "weight: expected K=99 rows like x"),
    "group_48": (
        _bad_wq(antiquant_group_size=48),
        "antiquant_group_size: expected 0 or a multiple",
    ),
    "group_k": (
        _bad_wq(antiquant_group_size=128, antiquant_scale=torch.ones(1, 6).half()),
        "antiquant_group_size: expected 0 or a multiple of 32 in [32, K-1=99], got 128",
    ),
    "scale_rows": (
        _bad_wq(antiquant_scale=torch.ones(3, 6).half(), antiquant_offset=None),
        "antiquant_scale: expected a shape in [(4, 6)] (group size 32), got (3, 6)",
    ),
    "scale_dtype": (
        _bad_wq(antiquant_scale=torch.ones(4, 6), antiquant_offset=None),
        "antiquant_scale: expected dtype torch.float16 like x, got torch.float32",
    ),
    "offset_shape": (
        _bad_wq(antiquant_offset=torch.ones(1, 6).half()),
        "antiquant_offset: expected shape (4, 6) like antiquant_scale",
    ),
    "bias_dtype_bf16": (
        _bad_wq(
            x=torch.randn(3, 100).bfloat16(),
            antiquant_scale=torch.ones(4, 6).bfloat16(),
            antiquant_offset=None,
            bias=torch.zeros(6).bfloat16(),
        ),
        "bias: expected dtype torch.float32 for x of dtype torch.bfloat16, got torch.bfloat16",
    ),
    "bias_dtype_fp16": (
        _bad_wq(bias=torch.zeros(6)),
        "bias: expected dtype torch.float16 for x of dtype torch.float16, got torch.float32",
    ),
    "empty": (_bad_wq(x=torch.zeros(0, 100).half()), "x/weight: expected M >= 1"),
}


@pytest.mark.parametrize("name", sorted(BAD_WEIGHT_QUANT_CALLS))
def test_weight_quant_rejects_what_the_kernel_rejects(name: str) -> None:
    call, message = BAD_WEIGHT_QUANT_CALLS[name]
    with _raises(ValueError, message):
        call()


def test_weight_quant_output_quantization_is_not_implemented() -> None:
    with _raises(NotImplementedError, "quant_scale/quant_offset are not implemented"):
        _bad_wq(quant_scale=torch.ones(1, 6))()


@pytest.mark.parametrize("argument", ["sink", "dropout_mask"])
def test_fusion_attention_refuses_the_tensors_it_does_not_model(argument) -> None:
    q, k, v = _qkv()
    with _raises(NotImplementedError, f"mock npu_fusion_attention: {argument} is not"):
        mock_ops.npu_fusion_attention(q, k, v, 4, "BNSD", **{argument: torch.zeros(4)})


def test_fusion_attention_seed_and_offset_change_nothing_without_dropout() -> None:
    q, k, v = _qkv()
    seeded = mock_ops.npu_fusion_attention(q, k, v, 4, "BNSD", seed=7, offset=3)[0]
    torch.testing.assert_close(seeded, mock_ops.npu_fusion_attention(q, k, v, 4, "BNSD")[0])


def test_weight_quant_weight_dtype_is_not_implemented() -> None:
    with _raises(NotImplementedError, "weight_dtype=29 is not implemented"):
        _bad_wq(weight_dtype=29)()


def test_stream_refuses_torch_npus_internal_keywords() -> None:
    with mock_npu(), _raises(NotImplementedError, "mock Stream: ['stream_id'] are not"):
        torch.npu.Stream(stream_id=1)


def test_device_name_is_an_atlas_a2_soc() -> None:
    with mock_npu() as torch_npu:
        assert torch_npu.npu.get_device_name() == MOCK_SOC_NAME == "Ascend910B1"
        assert torch.npu.get_device_name(0) == "Ascend910B1"


def test_mstx_ranges_follow_the_documented_contract() -> None:
    with mock_npu() as torch_npu:
        mstx = torch_npu.npu.mstx
        stream = torch.npu.current_stream()
        first = mstx.range_start("stage", stream)
        second = mstx.range_start("host only")
        assert first != 0 and second not in (0, first)
        mstx.range_end(second)
        mstx.range_end(first)
        assert mstx.ranges == [["stage", stream, True], ["host only", None, True]]
        with _raises(ValueError, "range_id: expected a range not yet ended"):
            mstx.range_end(first)
        with _raises(ValueError, "range_id: expected an id range_start returned"):
            mstx.range_end(99)
        with _raises(ValueError, "message: expected a string of at most 255 bytes"):
            mstx.range_start("x" * 256)
        with _raises(ValueError, "stream: expected None or a torch.npu.Stream"):
            mstx.range_start("stage", stream=3)
        with _raises(NotImplementedError, "mock mstx: domain='trace' is not implemented"):
            mstx.range_start("stage", domain="trace")


# --- install / uninstall ----------------------------------------------------------------------


def test_install_and_uninstall_restore_everything_exactly() -> None:
    before = (
        sys.modules.get("torch_npu"),
        sys.modules.get("torch_npu.npu"),
        torch.__dict__.get("npu", "absent"),
    )
    with mock_npu() as outer:
        assert sys.modules["torch_npu"] is outer
        assert torch.npu.is_available() and torch.npu.device_count() == 1
        with mock_npu(device_count=2) as inner:
            assert sys.modules["torch_npu"] is inner and torch.npu.device_count() == 2
        assert sys.modules["torch_npu"] is outer and torch.npu.device_count() == 1
    after = (
        sys.modules.get("torch_npu"),
        sys.modules.get("torch_npu.npu"),
        torch.__dict__.get("npu", "absent"),
    )
    assert after == before


def test_never_shadows_a_real_torch_npu(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", type(sys)("torch_npu"))
    with _raises(RuntimeError, "a real torch_npu is imported"):
        install_mock_npu()


def test_uninstall_without_install_raises() -> None:
    with _raises(RuntimeError, "the mock NPU is not installed"):
        uninstall_mock_npu()
