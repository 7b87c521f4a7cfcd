"""rotary_embedding specifics: gradients, transformers' mrope rule, input errors, and the
q+k pair op (rotary_embedding_pair) against two single calls."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _op_samples import KernelSpy, RotaryCase, rotary_cases
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.models.qwen2_vl import modeling_qwen2_vl

from ascend_vlm import ops


def _case(**overrides) -> RotaryCase:
    base = dict(
        batch=2,
        heads=2,
        seq=3,
        head_dim=8,
        rotary_dim=8,
        table_form="BS",
        mrope_section=None,
        interleaved=False,
        dtype=torch.float64,
        seed=2,
    )
    return RotaryCase(**{**base, **overrides})


@pytest.mark.parametrize(
    "case",
    [
        _case(),
        _case(interleaved=True, rotary_dim=4, table_form="S"),
        _case(table_form="mrope", mrope_section=(1, 1, 2)),
    ],
    ids=["half", "interleaved-partial", "mrope"],
)
def test_gradcheck_fp64(case: RotaryCase) -> None:
    (x, cos, sin), kwargs = case.op_args()
    inputs = tuple(t.requires_grad_() for t in (x, cos, sin))
    assert torch.autograd.gradcheck(lambda *t: ops.rotary_embedding(*t, **kwargs), inputs)


def test_mrope_matches_transformers_qwen2_vl() -> None:
    """transformers 5.x merges the sections on the [3, B, S, D/2] frequencies inside the rotary
    module, then duplicates them; the op takes the duplicated [3, B, S, D] tables instead."""
    section = [1, 1, 2]
    freqs = torch.randn(3, 2, 5, 4)
    x = torch.randn(2, 3, 5, 8)
    recompose = modeling_qwen2_vl.Qwen2VLRotaryEmbedding.recomposition_frequencies
    holder = SimpleNamespace(mrope_section=section)
    cos_hf, sin_hf = recompose(holder, freqs.cos()), recompose(holder, freqs.sin())
    expected, _ = modeling_qwen2_vl.apply_rotary_pos_emb(x, x, cos_hf, sin_hf)
    tables = torch.cat((freqs, freqs), dim=-1)
    out = ops.rotary_embedding(x, tables.cos(), tables.sin(), mrope_section=section)
    torch.testing.assert_close(out, expected)


def _pair_args(case: RotaryCase, key_heads: int) -> tuple[tuple[torch.Tensor, ...], dict]:
    """q from the case, and a k with ``key_heads`` heads (GQA) on the same tables."""
    (q, cos, sin), kwargs = case.op_args()
    k = torch.randn(q.shape[0], key_heads, *q.shape[2:], generator=torch.Generator().manual_seed(7))
    return (q, k.to(q.dtype), cos, sin), kwargs


@pytest.mark.parametrize("backend", ["cpu", "mock"])
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=rotary_cases(), key_heads=st.integers(1, 3))
def test_pair_equals_two_single_calls_bitwise(case, key_heads, backend, request, monkeypatch):
    (q, k, cos, sin), kwargs = _pair_args(case, key_heads)
    spy = None
    if backend == "mock":
        torch_npu = request.getfixturevalue("mock_npu").torch_npu
        spy = KernelSpy(monkeypatch, torch_npu, "npu_rotary_mul")
    q_out, k_out = ops.rotary_embedding_pair(q, k, cos, sin, **kwargs)
    pair_launches = spy.calls if spy else 0
    assert torch.equal(q_out, ops.rotary_embedding(q, cos, sin, **kwargs))
    assert torch.equal(k_out, ops.rotary_embedding(k, cos, sin, **kwargs))
    if spy:  # the pair launched the kernel exactly when the two single calls did
        assert spy.calls == 2 * pair_launches


def test_pair_gradcheck_fp64_and_compiles() -> None:
    (q, k, cos, sin), kwargs = _pair_args(_case(table_form="mrope", mrope_section=(1, 1, 2)), 1)
    inputs = tuple(t.requires_grad_() for t in (q, k, cos, sin))
    assert torch.autograd.gradcheck(lambda *t: ops.rotary_embedding_pair(*t, **kwargs), inputs)
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda *t: [2.0 * out for out in ops.rotary_embedding_pair(*t, **kwargs)],
        fullgraph=True,
        backend="aot_eager",
    )
    plain = [t.detach() for t in inputs]
    expected = [2.0 * out for out in ops.rotary_embedding_pair(*plain, **kwargs)]
    for got, want in zip(compiled(*plain), expected, strict=True):
        torch.testing.assert_close(got, want)
