"""The public functions composed of ops: rms_norm_promoting, rotary_embedding_pair_vision,
rotary_embedding_pair_complex, packed_attention (and swiglu_projections, tested in
test_swiglu.py)."""

from __future__ import annotations

import pytest
import torch

from ascend_vlm import ops
from ascend_vlm.ops.swiglu import swiglu_projections

BF16 = torch.bfloat16


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _llama_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward, step for step."""
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(x.dtype)


def test_rms_norm_promoting_gives_the_llama_modules_dtype_for_fp32_weights_on_bf16() -> None:
    x = torch.randn(3, 5, 16, generator=_generator()).to(BF16)
    weight = torch.randn(16, generator=_generator()) + 1.0
    got = ops.rms_norm_promoting(x, weight, 1e-6)
    assert got.dtype == torch.float32  # promote(fp32 weight, bf16 x), as the stock module
    unit = torch.ones(16, dtype=BF16)
    assert torch.equal(got, weight * ops.rms_norm(x, unit, 1e-6))
    torch.testing.assert_close(got, _llama_rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize(
    ("weight_dtype", "offset"), [(BF16, 0.0), (torch.float32, 1.0), (BF16, 1.0)]
)
def test_rms_norm_promoting_is_rms_norm_for_equal_dtypes_or_an_offset(weight_dtype, offset):
    x = torch.randn(4, 8, generator=_generator()).to(BF16)
    weight = torch.randn(8, generator=_generator()).to(weight_dtype)
    got = ops.rms_norm_promoting(x, weight, 1e-5, offset=offset)
    assert got.dtype == BF16
    assert torch.equal(got, ops.rms_norm(x, weight, 1e-5, offset=offset))


def test_rms_norm_promoting_names_a_bad_weight() -> None:
    x = torch.randn(2, 8, dtype=BF16)
    with pytest.raises(ValueError, match=r"^weight: expected a floating-point dtype, got torch"):
        ops.rms_norm_promoting(x, torch.ones(8, dtype=torch.int64), 1e-6)
    with pytest.raises(ValueError, match=r"^weight: expected shape \(8,\)"):
        ops.rms_norm_promoting(x, torch.ones(4), 1e-6)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def test_rotary_embedding_pair_vision_computes_in_fp32_and_returns_the_inputs_dtypes() -> None:
    generator = _generator()
    q = torch.randn(6, 4, 8, generator=generator).to(BF16)  # [T, N, D]
    k = torch.randn(6, 2, 8, generator=generator)  # fp32, fewer heads
    angles = torch.randn(6, 4, generator=generator)
    cos, sin = (f(torch.cat((angles, angles), -1)).to(BF16) for f in (torch.cos, torch.sin))
    q_out, k_out = ops.rotary_embedding_pair_vision(q, k, cos, sin)
    assert (q_out.dtype, k_out.dtype) == (BF16, torch.float32)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    # fp32 math: the pair op on fp32 [1, N, T, D] views, cast back (what the adapter did)
    views = [t.float().transpose(0, 1).unsqueeze(0) for t in (q, k)]
    q_fp32, k_fp32 = ops.rotary_embedding_pair(*views, cos.float(), sin.float())
    assert torch.equal(q_out, q_fp32[0].transpose(0, 1).to(BF16))
    assert torch.equal(k_out, k_fp32[0].transpose(0, 1))
    # ... which is the formula in float64, within fp32 (k) and bf16 (q) rounding
    c, s = cos.double()[:, None], sin.double()[:, None]
    for got, x in ((q_out, q), (k_out, k)):
        expected = x.double() * c + _rotate_half(x.double()) * s
        torch.testing.assert_close(got, expected.to(got.dtype))


def test_rotary_embedding_pair_vision_names_an_input_of_the_wrong_rank() -> None:
    q = torch.zeros(1, 6, 4, 8)
    with pytest.raises(ValueError, match=r"^q: expected 3-D \[T, N, D\], got shape \(1, 6, 4, 8\)"):
        ops.rotary_embedding_pair_vision(q, q[0], torch.ones(6, 8), torch.zeros(6, 8))


def _llama4_complex_rope(xq, xk, freqs_cis):
    """transformers' Llama 4 ``apply_rotary_emb``, step for step (complex64 products)."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    xq_out = torch.view_as_real(xq_ * freqs_cis[:, :, None, :]).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis[:, :, None, :]).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def _llama4_vision_complex_rope(query, key, freqs_ci):
    """transformers' Llama 4 ``vision_apply_rotary_emb``: freqs_ci [S, 1, D/2] viewed as
    [1, S, 1, D/2]."""
    query_ = torch.view_as_complex(query.float().reshape(*query.shape[:-1], -1, 2))
    key_ = torch.view_as_complex(key.float().reshape(*key.shape[:-1], -1, 2))
    freqs_ci = freqs_ci.view(1, query_.shape[1], 1, query_.shape[-1])
    query_out = torch.view_as_real(query_ * freqs_ci).flatten(3)
    key_out = torch.view_as_real(key_ * freqs_ci).flatten(3)
    return query_out.type_as(query), key_out.type_as(key)


def _complex_table(batch: int, seq: int, pairs: int, scale: float) -> torch.Tensor:
    angles = torch.randn(batch, seq, pairs, generator=_generator()) * 3
    return torch.polar(torch.ones_like(angles), angles) * scale


# batch 1: the NPU kernel's interleave mode takes the [1, 1, S, D] table; batch 2: per-row
# tables, which the op computes with the reference.
@pytest.mark.parametrize("backend", ["cpu", "mock"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize(
    ("dtype", "scale"), [(torch.float32, 1.0), (torch.float32, 1.5), (BF16, 1.0)]
)
def test_rotary_embedding_pair_complex_equals_llama4_apply_rotary_emb(
    dtype, scale, batch, backend, request
) -> None:
    device = torch.device("cpu")
    if backend == "mock":
        device = request.getfixturevalue("mock_npu").device
    generator = _generator()
    q = torch.randn(batch, 5, 4, 8, generator=generator).to(device, dtype)  # [B, S, N, D]
    k = torch.randn(batch, 5, 2, 8, generator=generator).to(device, dtype)
    freqs = _complex_table(batch, 5, 4, scale).to(device)
    got = ops.rotary_embedding_pair_complex(q, k, freqs, table_scale=max(scale, 1.0))
    expected = _llama4_complex_rope(q, k, freqs)
    atol = 1e-5 if dtype == torch.float32 else 1e-2
    for out, reference in zip(got, expected, strict=True):
        assert out.dtype == dtype and out.shape == reference.shape
        torch.testing.assert_close(out, reference, atol=atol, rtol=0)


def test_rotary_embedding_pair_complex_equals_llama4_vision_apply_rotary_emb() -> None:
    generator = _generator()
    query = torch.randn(3, 5, 4, 8, generator=generator)
    key = torch.randn(3, 5, 4, 8, generator=generator)
    freqs_ci = _complex_table(1, 5, 4, 1.0).reshape(5, 1, 4)
    got = ops.rotary_embedding_pair_complex(query, key, freqs_ci)
    expected = _llama4_vision_complex_rope(query, key, freqs_ci)
    for out, reference in zip(got, expected, strict=True):
        torch.testing.assert_close(out, reference, atol=1e-5, rtol=0)


def test_rotary_embedding_pair_complex_names_a_bad_table() -> None:
    q = torch.zeros(2, 5, 4, 8)
    with pytest.raises(ValueError, match=r"^freqs: expected a complex tensor, got dtype"):
        ops.rotary_embedding_pair_complex(q, q, torch.ones(2, 5, 4))
    with pytest.raises(ValueError, match=r"^freqs: expected S\*D/2=20 or B\*S\*D/2=40 elements"):
        ops.rotary_embedding_pair_complex(q, q, _complex_table(2, 4, 4, 1.0))


def _per_segment(query, key, value, cu_q, cu_k, causal) -> torch.Tensor:
    """fused_attention on each segment alone, concatenated: [1, T, Nq, D]."""
    outputs = []
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    for i in range(len(bounds_q) - 1):
        q = query[:, :, bounds_q[i] : bounds_q[i + 1]]
        k = key[:, :, bounds_k[i] : bounds_k[i + 1]]
        v = value[:, :, bounds_k[i] : bounds_k[i + 1]]
        outputs.append(ops.fused_attention(q, k, v, causal=causal).transpose(1, 2))
    return torch.cat(outputs, dim=1)


SEGMENTS = {
    "one": ([0, 9], None),
    "equal": ([0, 3, 6, 9], None),
    "unequal": ([0, 2, 7, 9], None),
    "cross": ([0, 4, 9], [0, 5, 11]),
}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("segments", list(SEGMENTS))
def test_packed_attention_equals_fused_attention_per_segment(segments, causal) -> None:
    offsets_q, offsets_k = SEGMENTS[segments]
    cu_q = torch.tensor(offsets_q, dtype=torch.int32)
    cu_k = None if offsets_k is None else torch.tensor(offsets_k, dtype=torch.int32)
    generator = _generator()
    query = torch.randn(1, 4, offsets_q[-1], 8, generator=generator)
    tk = offsets_q[-1] if offsets_k is None else offsets_k[-1]
    key, value = torch.randn(2, 1, 2, tk, 8, generator=generator).unbind(0)  # GQA: 2 kv heads
    got = ops.packed_attention(query, key, value, cu_q, cu_k, causal=causal)
    assert got.shape == (1, offsets_q[-1], 4, 8) and got.is_contiguous()
    expected = _per_segment(query, key, value, cu_q, cu_q if cu_k is None else cu_k, causal)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


def test_packed_attention_names_an_input_that_is_not_one_packed_sequence() -> None:
    query = torch.zeros(2, 4, 3, 8)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^query: expected 4-D \[1, N, T, D\] \(packed segm"):
        ops.packed_attention(query, query[:1], query[:1], cu)


def test_swiglu_projections_is_exported() -> None:
    assert ops.swiglu_projections is swiglu_projections
