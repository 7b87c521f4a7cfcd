"""varlen_attention specifics: gradients, segment isolation, offsets validation."""

from __future__ import annotations

import pytest
import torch
from _op_samples import KernelSpy, VarlenCase

from ascend_vlm import ops
from ascend_vlm.kernel_backend import using_backend


def _case(**overrides) -> VarlenCase:
    base = dict(
        q_lens=(2, 0, 3),
        kv_lens=(2, 0, 3),
        kv_heads=1,
        group=2,
        head_dim=3,
        causal=True,
        scale=None,
        dtype=torch.float64,
        cu_dtype=torch.int32,
        seed=5,
    )
    return VarlenCase(**{**base, **overrides})


@pytest.mark.parametrize(
    "case",
    [_case(), _case(q_lens=(1, 3), kv_lens=(2, 2), causal=False, cu_dtype=torch.int64)],
    ids=["causal-self", "cross"],
)
def test_gradcheck_fp64(case: VarlenCase) -> None:
    (q, k, v, cu_q, cu_k), kwargs = case.op_args()
    inputs = tuple(t.requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(
        lambda *t: ops.varlen_attention(*t, cu_q, cu_k, **kwargs), inputs
    )


def test_segments_do_not_see_each_other() -> None:
    (q, k, v, cu_q, cu_k), _ = _case(dtype=torch.float32, causal=False).op_args()
    out = ops.varlen_attention(q, k, v, cu_q, cu_k)
    v_changed = v.clone()
    v_changed[:2] += 100.0  # only the first segment's values
    changed = ops.varlen_attention(q, k, v_changed, cu_q, cu_k)
    assert not torch.allclose(out[:2], changed[:2])
    torch.testing.assert_close(out[2:], changed[2:])


def test_many_equal_segments_match_one_segment_at_a_time() -> None:
    (q, k, v, cu, _), kwargs = _case(
        q_lens=(4,) * 6, kv_lens=(4,) * 6, dtype=torch.float32
    ).op_args()
    batched = ops.varlen_attention(q, k, v, cu, cu, **kwargs)
    for start in range(0, 24, 4):
        one = torch.tensor([0, 4])
        piece = ops.varlen_attention(
            q[start : start + 4], k[start : start + 4], v[start : start + 4], one, one, **kwargs
        )
        torch.testing.assert_close(batched[start : start + 4], piece)


@pytest.mark.parametrize(
    ("heads", "head_dim", "dtype", "on_kernel"),
    [
        (2, 4, torch.float32, True),
        (257, 4, torch.float32, False),
        (2, 769, torch.float32, False),
        (2, 4, torch.float64, False),
    ],
    ids=["fits", "257-heads", "D-769", "fp64"],
)
def test_npu_path_uses_the_kernel_only_within_its_limits(
    heads, head_dim, dtype, on_kernel, mock_npu, monkeypatch
) -> None:
    spy = KernelSpy(monkeypatch, mock_npu.torch_npu, "npu_fusion_attention")
    packed = torch.randn(5, heads, head_dim, dtype=dtype, device=mock_npu.device)
    cu_seqlens = torch.tensor([0, 2, 5], dtype=torch.int32, device=mock_npu.device)
    out = ops.varlen_attention(packed, packed, packed, cu_seqlens, cu_seqlens)
    assert spy.calls == int(on_kernel)
    with using_backend("cpu"):
        expected = ops.varlen_attention(packed, packed, packed, cu_seqlens, cu_seqlens)
    torch.testing.assert_close(out, expected)


def test_backward_when_no_query_sees_a_key_gives_zero_gradients() -> None:
    """Every segment has no key: the output is constant zeros, so every gradient is zero."""
    query = torch.randn(3, 2, 4, requires_grad=True)
    key = torch.randn(0, 1, 4, requires_grad=True)
    value = torch.randn(0, 1, 4, requires_grad=True)
    cu_q, cu_k = torch.tensor([0, 1, 3]), torch.tensor([0, 0, 0])
    out = ops.varlen_attention(query, key, value, cu_q, cu_k)
    assert torch.equal(out, torch.zeros(3, 2, 4))
    out.sum().backward()
    assert torch.equal(query.grad, torch.zeros(3, 2, 4))
    assert key.grad.shape == value.grad.shape == (0, 1, 4)
