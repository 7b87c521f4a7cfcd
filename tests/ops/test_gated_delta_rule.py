"""Qwen3.5's linear-attention ops against transformers' own torch implementation, against each
other (chunked = recurrent; decode continues a prefill), and on the NPU path where OpInfo
cannot reach (a torch_npu without the kernel; causal_conv1d's Ascend 950 kernel)."""

from __future__ import annotations

import pytest
import torch
from _op_samples import KernelSpy
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5

from ascend_vlm import ops
from ascend_vlm.kernel_backend import using_backend

FP32 = {"atol": 1e-5, "rtol": 1e-5}


def _delta_inputs(batch: int, tokens: int, key_heads: int, value_heads: int, dim: int, seed: int):
    """Raw (unnormalised) q/k as Qwen3.5 hands them with use_qk_l2norm, and a random state."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    q, k = randn(batch, tokens, key_heads, dim), randn(batch, tokens, key_heads, dim)
    v = randn(batch, tokens, value_heads, dim + 1)
    g = -torch.nn.functional.softplus(randn(batch, tokens, value_heads))
    beta = torch.sigmoid(randn(batch, tokens, value_heads))
    return q, k, v, g, beta, randn(batch, value_heads, dim, dim + 1)


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("tokens", [1, 63, 150])
def test_chunked_equals_recurrent_equals_transformers(tokens: int, with_state: bool) -> None:
    q, k, v, g, beta, state = _delta_inputs(3, tokens, 2, 4, 8, seed=tokens)
    state = state if with_state else None
    chunked = ops.chunk_gated_delta_rule(q, k, v, g, beta, state, use_qk_l2norm=True)
    recurrent = ops.recurrent_gated_delta_rule(q, k, v, g, beta, state, use_qk_l2norm=True)
    # Qwen3.5's layer repeats each key head over Hv / Hk value heads before these functions in
    # the lowest supported transformers (inside them in newer ones): the same mapping either way
    q_rep, k_rep = (t.repeat_interleave(2, dim=2) for t in (q, k))
    theirs = {}
    for name, function in (
        ("chunk", qwen3_5.torch_chunk_gated_delta_rule),
        ("recurrent", qwen3_5.torch_recurrent_gated_delta_rule),
    ):
        theirs[name] = function(
            q_rep, k_rep, v, g, beta, initial_state=state, output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
    for ours in (chunked, recurrent):
        for theirs_pair in theirs.values():
            for got, want in zip(ours, theirs_pair, strict=True):
                torch.testing.assert_close(got, want, atol=5e-5, rtol=5e-5)


def test_decode_continues_a_prefill() -> None:
    """Prefill T - 3 tokens, then decode the rest one at a time from the returned state: the
    same outputs and final state as one pass over all T."""
    q, k, v, g, beta, state = _delta_inputs(2, 70, 1, 2, 4, seed=1)
    whole, whole_state = ops.chunk_gated_delta_rule(q, k, v, g, beta, state, scale=0.3)
    split = 67
    outputs = [
        ops.chunk_gated_delta_rule(*(t[:, :split] for t in (q, k, v, g, beta)), state, scale=0.3)
    ]
    carried = outputs[0][1]
    for t in range(split, 70):
        out, carried = ops.recurrent_gated_delta_rule(
            *(x[:, t : t + 1] for x in (q, k, v, g, beta)), carried, scale=0.3
        )
        outputs.append((out, carried))
    torch.testing.assert_close(torch.cat([o for o, _ in outputs], dim=1), whole, **FP32)
    torch.testing.assert_close(carried, whole_state, **FP32)


@pytest.mark.parametrize(
    ("op", "kernel"),
    [
        (ops.chunk_gated_delta_rule, "npu_chunk_gated_delta_rule"),
        (ops.recurrent_gated_delta_rule, "npu_recurrent_gated_delta_rule"),
    ],
)
def test_a_torch_npu_without_the_kernel_runs_the_reference(op, kernel, mock_npu, monkeypatch):
    """torch-npu 2.6.0.post5, 2.8.0.post5 and 2.9.1 lack the chunk kernel (schema file)."""
    q, k, v, g, beta, state = (t.bfloat16() for t in _delta_inputs(1, 2, 1, 1, 128, seed=2))
    with using_backend("cpu"):
        expected = op(q, k, v, g, beta, state)
    monkeypatch.delattr(mock_npu.torch_npu, kernel)
    with torch.no_grad():
        got = op(q, k, v, g, beta, state)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_the_mock_kernels_refuse_what_the_docs_exclude(mock_npu) -> None:
    torch_npu = mock_npu.torch_npu
    q = torch.zeros(9, 1, 64, dtype=torch.bfloat16)
    v = torch.zeros(9, 1, 64, dtype=torch.bfloat16)
    beta = torch.zeros(9, 1, dtype=torch.bfloat16)
    lengths = torch.tensor([9], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"query/value: expected head dims Dk = Dv = 128"):
        torch_npu.npu_chunk_gated_delta_rule(
            q, q, v, beta=beta, initial_state=torch.zeros(1, 1, 64, 64, dtype=torch.bfloat16),
            actual_seq_lengths=lengths, scale=0.1,
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"actual_seq_lengths: expected L_i <= 8, got \[9\]"):
        torch_npu.npu_recurrent_gated_delta_rule(
            q, q, v, torch.zeros(9, 1, 64, 64, dtype=torch.bfloat16), beta=beta, scale=0.1,
            actual_seq_lengths=lengths, ssm_state_indices=torch.arange(9, dtype=torch.int32),
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"query: expected dtype in \(bfloat16\)"):
        torch_npu.npu_recurrent_gated_delta_rule(
            q.float(), q, v, torch.zeros(1, 1, 64, 64), beta=beta, scale=0.1,
            actual_seq_lengths=lengths, ssm_state_indices=torch.zeros(9, dtype=torch.int32),
        )  # fmt: skip
    x = torch.zeros(1, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"weight: expected shape \(3, 128\) \[K=3, dim\]"):
        torch_npu.npu_fused_causal_conv1d(
            x, torch.zeros(4, 128, dtype=torch.bfloat16), torch.zeros(1, 2, 128).bfloat16()
        )
    with pytest.raises(ValueError, match=r"x: expected dim % 128 == 0"):
        torch_npu.npu_fused_causal_conv1d(
            x[..., :64], torch.zeros(3, 64).bfloat16(), torch.zeros(1, 2, 64).bfloat16()
        )


# --- causal_conv1d -------------------------------------------------------------------------------


def _conv_inputs(channels: int, width: int, dtype: torch.dtype = torch.float32):
    generator = torch.Generator().manual_seed(channels + width)
    x = torch.randn(2, 7, channels, generator=generator).to(dtype)
    weight = torch.randn(channels, width, generator=generator).to(dtype)
    state = torch.randn(2, channels, width, generator=generator).to(dtype)
    return x, weight, state


def test_causal_conv1d_matches_transformers_prefill_and_decode() -> None:
    """Qwen3.5's conv (width 4, SiLU): transformers' ``causal_conv1d_fn`` over the cached steps
    and the sequence, and ``causal_conv1d_update`` for one decoded token."""
    x, weight, state = _conv_inputs(6, 4)
    out, new_state = ops.causal_conv1d(x, weight, state, activation="silu")
    steps = torch.cat((state, x.transpose(1, 2)), dim=-1)
    theirs = qwen3_5.causal_conv1d_fn(steps, weight, None, activation="silu")[..., -7:]
    torch.testing.assert_close(out, theirs.transpose(1, 2), **FP32)
    torch.testing.assert_close(new_state, steps[..., -4:])
    token = torch.randn(2, 1, 6)
    their_state = new_state.clone()
    their_out = qwen3_5.causal_conv1d_update(
        token.transpose(1, 2), their_state, weight, None, activation="silu"
    )
    our_out, our_state = ops.causal_conv1d(token, weight, new_state, activation="silu")
    torch.testing.assert_close(our_out, their_out.transpose(1, 2), **FP32)
    torch.testing.assert_close(our_state, their_state)


def test_causal_conv1d_decode_continues_a_prefill() -> None:
    x, weight, _ = _conv_inputs(5, 4)
    whole, _ = ops.causal_conv1d(x, weight, activation="silu")
    first, state = ops.causal_conv1d(x[:, :5], weight, activation="silu")
    outputs = [first]
    for t in range(5, 7):
        out, state = ops.causal_conv1d(x[:, t : t + 1], weight, state, activation="silu")
        outputs.append(out)
    torch.testing.assert_close(torch.cat(outputs, dim=1), whole, **FP32)


@pytest.mark.parametrize("with_state", [False, True])
def test_causal_conv1d_calls_the_kernel_on_an_ascend_950(with_state, mock_npu, monkeypatch):
    """The kernel is documented for the Ascend 950 only; the mock reports an Atlas A2 SoC, so
    the SoC name is replaced here."""
    x, weight, state = _conv_inputs(128, 3, torch.bfloat16)
    state = state if with_state else None
    bias = torch.randn(128).bfloat16()
    expected = ops.causal_conv1d(x, weight, state, bias, activation="silu")
    spy = KernelSpy(monkeypatch, mock_npu.torch_npu, "npu_fused_causal_conv1d")
    monkeypatch.setattr(mock_npu.torch_npu.npu, "get_device_name", lambda device=None: "A")
    ops.causal_conv1d(x, weight, state, bias, activation="silu")
    assert spy.calls == 0  # an Atlas A2 runs the reference
    monkeypatch.setattr(
        mock_npu.torch_npu.npu, "get_device_name", lambda device=None: "Ascend950PR"
    )
    got = ops.causal_conv1d(x, weight, state, bias, activation="silu")
    assert spy.calls == 1
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


def test_outputs_are_contiguous_for_strided_inputs_as_the_fake_says() -> None:
    """The model hands transposed views (conv input, cached states); opcheck compares the fake
    outputs' strides with the real ones."""
    x = torch.randn(2, 6, 7).transpose(1, 2)
    conv_state = torch.randn(2, 4, 6).transpose(1, 2)
    torch.library.opcheck(
        torch.ops.ascend_vlm.causal_conv1d.default,
        (x, torch.randn(6, 4), conv_state, None),
        {"activation": "silu"},
    )
    q = torch.randn(2, 2, 5, 3).transpose(1, 2)
    v = torch.randn(2, 4, 5, 3).transpose(1, 2)
    g = -torch.rand(2, 4, 5).transpose(1, 2)
    state = torch.randn(2, 4, 3, 3).transpose(-1, -2)
    for op in (ops.chunk_gated_delta_rule, ops.recurrent_gated_delta_rule):
        overload = getattr(torch.ops.ascend_vlm, op.__name__).default
        torch.library.opcheck(overload, (q, q, v, g, g.sigmoid(), state), {"use_qk_l2norm": True})
