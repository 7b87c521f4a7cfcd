"""The torch_npu kernels' documented limits (ops.kernel_constraints): the mock refuses a call
outside them as the real kernel does, and the ops keep every head dim a supported family uses
on the kernel (npu_fusion_attention, npu_rotary_mul: as it is; npu_chunk_gated_delta_rule:
zero-padded to 128), with the CPU reference's results."""

from __future__ import annotations

import re

import pytest
import torch
from _op_samples import KernelSpy, tolerance

from ascend_vlm import ops
from ascend_vlm.kernel_backend import using_backend
from ascend_vlm.ops import kernel_constraints
from ascend_vlm.ops.__main__ import main as ops_main
from ascend_vlm.testing import mock_ops
from ascend_vlm.testing.mock_ops import MOCK_OPS

FAMILY_HEAD_DIMS = kernel_constraints.FAMILY_HEAD_DIMS
NPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DTYPE_IDS = ["fp16", "bf16", "fp32"]


def _bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).bfloat16()


def _gated_delta_call(kernel, heads: int, key_dim: int, value_dim: int, tokens: int):
    """A call of one gated delta rule kernel on one sequence of ``tokens``."""
    q, k = _bf16(tokens, heads, key_dim), _bf16(tokens, heads, key_dim)
    v, beta = _bf16(tokens, heads, value_dim), torch.rand(tokens, heads).bfloat16()
    state = torch.zeros(1, heads, value_dim, key_dim, dtype=torch.bfloat16)
    lengths = torch.tensor([tokens], dtype=torch.int32)
    if kernel is mock_ops.npu_chunk_gated_delta_rule:
        return lambda: kernel(
            q, k, v, beta=beta, initial_state=state, actual_seq_lengths=lengths, scale=0.1
        )
    indices = torch.zeros(tokens, dtype=torch.int32)
    return lambda: kernel(
        q, k, v, state, beta=beta, scale=0.1, actual_seq_lengths=lengths,
        ssm_state_indices=indices,
    )  # fmt: skip


def _tnd_attention(tokens: int, heads: int, head_dim: int, lengths: list[int]):
    packed = torch.randn(tokens, heads, head_dim)
    return lambda: mock_ops.npu_fusion_attention(
        packed, packed, packed, heads, "TND", actual_seq_qlen=lengths, actual_seq_kvlen=lengths
    )


def _bnsd_attention(batch: int, heads: int, q_len: int, head_dim: int):
    q = torch.randn(batch, heads, q_len, head_dim)
    return lambda: mock_ops.npu_fusion_attention(q, q, q, heads, "BNSD")


def _rotary(shape: tuple[int, ...], mode: str = "half"):
    x, table = torch.randn(shape), torch.rand(1, 1, shape[2], shape[3])
    return lambda: mock_ops.npu_rotary_mul(x, table, table, rotary_mode=mode)


def _weight_quant(in_features: int, out_features: int):
    x = torch.randn(1, in_features).half()
    weight = torch.ones(in_features, out_features, dtype=torch.int8)
    scale = torch.ones(out_features).half()
    return lambda: mock_ops.npu_weight_quant_batchmatmul(x, weight, scale)


# "kernel/case": the call, the refusal's argument and expected text (the documented limit)
OUT_OF_SPEC_CALLS = {
    "npu_fusion_attention/D769": (
        _bnsd_attention(1, 1, 2, 769),
        "query: expected head dim D in [1, 768], got 769",
    ),
    "npu_fusion_attention/257-heads": (
        _bnsd_attention(1, 257, 2, 4),
        "head_num: expected an int in [1, 256] (query heads), got 257",
    ),
    "npu_fusion_attention/gqa": (
        lambda: mock_ops.npu_fusion_attention(
            torch.randn(1, 3, 2, 4), torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4), 3, "BNSD"
        ),
        "key: expected a head count dividing Nq=3 (Nq/Nkv integer), got 2",
    ),
    "npu_fusion_attention/TND-D769": (
        _tnd_attention(3, 1, 769, [1, 3]),
        "query: expected head dim D in [1, 768], got 769",
    ),
    "npu_fusion_attention/TND-1025-segments": (
        _tnd_attention(1025, 1, 4, list(range(1, 1026))),
        "actual_seq_qlen: expected 1 to 1024 sequences in varlen, got 1025 entries",
    ),
    "npu_fusion_attention/TND-masked-row": (
        lambda: mock_ops.npu_fusion_attention(
            torch.randn(3, 1, 4),
            torch.randn(1, 1, 4),
            torch.randn(1, 1, 4),
            1,
            "TND",
            atten_mask=torch.ones(2048, 2048, dtype=torch.bool).triu(1),
            actual_seq_qlen=[3],
            actual_seq_kvlen=[1],
            sparse_mode=3,
        ),
        "atten_mask: expected no fully masked row in varlen (TND) mode",
    ),
    "npu_rotary_mul/D896": (
        _rotary((1, 1, 2, 896)),
        "input: expected an even last dim D < 896, got D=896",
    ),
    "npu_rotary_mul/odd-D": (
        _rotary((1, 1, 2, 7)),
        "input: expected an even last dim D < 896, got D=7",
    ),
    "npu_rotary_mul/interleave-BN": (
        _rotary((40, 25, 2, 8), "interleave"),
        "input: expected B * N < 1000 in 'interleave' mode, got (BNSD: B=40, N=25)",
    ),
    "npu_rms_norm/1-D": (
        lambda: mock_ops.npu_rms_norm(torch.randn(8), torch.ones(8)),
        "input: expected 2 to 8 dims, got 1 dims",
    ),
    "npu_rms_norm/bf16-gamma-for-fp16": (
        lambda: mock_ops.npu_rms_norm(torch.randn(2, 8).half(), torch.ones(8).bfloat16()),
        "input/gamma: expected a dtype pair in",
    ),
    "npu_swiglu/9-D": (
        lambda: mock_ops.npu_swiglu(torch.randn((1,) * 8 + (2,))),
        "input: expected 1 to 8 dims, got 9 dims",
    ),
    "npu_swiglu/fp64": (
        lambda: mock_ops.npu_swiglu(torch.randn(2, 4).double()),
        "input: expected dtype in (float16, bfloat16, float32), got torch.float64",
    ),
    "npu_fused_causal_conv1d/dim64": (
        lambda: mock_ops.npu_fused_causal_conv1d(
            torch.zeros(1, 2, 64).half(), torch.zeros(3, 64).half(), torch.zeros(1, 2, 64).half()
        ),
        "x: expected dim % 128 == 0, got dim=64",
    ),
    "npu_grouped_matmul/K65536": (
        lambda: mock_ops.npu_grouped_matmul(
            [torch.zeros(1, 65536).half()],
            [torch.zeros(1, 65536, 1).half()],
            group_list=torch.tensor([1]),
            split_item=2,
            group_type=0,
            group_list_type=0,
        ),
        "x/weight: expected K and N below 65536, got (65536, 1)",
    ),
    "npu_moe_token_unpermute/top513": (
        lambda: mock_ops.npu_moe_token_unpermute(
            torch.zeros(513, 2), torch.arange(513, dtype=torch.int32), torch.ones(1, 513)
        ),
        "probs: expected topK <= 512, got 513",
    ),
    "npu_moe_token_permute/top513": (
        lambda: mock_ops.npu_moe_token_permute(
            torch.zeros(1, 2), torch.zeros(1, 513, dtype=torch.int64)
        ),
        "indices: expected topK <= 512 and < 16777215 elements, got (513, 513)",
    ),
    "npu_convert_weight_to_int4pack/last-dim-12": (
        lambda: mock_ops.npu_convert_weight_to_int4pack(torch.zeros(2, 12, dtype=torch.int32)),
        "weight: expected a last dim that is a multiple of 8, got 12",
    ),
    "npu_weight_quant_batchmatmul/K65536": (
        _weight_quant(65536, 1),
        "x/weight: expected K, N in [1, 65535], got (65536, 1)",
    ),
}


# "kernel/case": (heads, Dk, Dv, tokens) of one sequence, the refusal's text
GATED_DELTA_CASES = {
    "npu_chunk_gated_delta_rule/D64": (
        (1, 64, 64, 2),
        "query/value: expected head dims Dk = Dv = 128, got (64, 64)",
    ),
    "npu_chunk_gated_delta_rule/65-heads": (
        (65, 128, 128, 1),
        "value: expected Nk, Nv <= 64, got (65, 65)",
    ),
    "npu_recurrent_gated_delta_rule/D257": (
        (1, 257, 8, 1),
        "query/value: expected Nk, Nv, Dk, Dv <= 256, got (1, 1, 257, 8)",
    ),
    "npu_recurrent_gated_delta_rule/9-tokens": (
        (1, 8, 8, 9),
        "actual_seq_lengths: expected L_i <= 8, got [9]",
    ),
}
OUT_OF_SPEC_CALLS |= {
    name: (_gated_delta_call(getattr(mock_ops, name.split("/")[0]), *sizes), reason)
    for name, (sizes, reason) in GATED_DELTA_CASES.items()
}


@pytest.mark.parametrize("name", sorted(OUT_OF_SPEC_CALLS))
def test_mock_refuses_what_the_docs_refuse(name: str) -> None:
    """A RuntimeError in torch_npu's style naming the kernel, the aclnn status, the argument,
    the documented limit and the doc it comes from."""
    call, reason = OUT_OF_SPEC_CALLS[name]
    kernel = name.split("/")[0]
    with pytest.raises(RuntimeError, match=re.escape(reason)) as refused:
        call()
    message = str(refused.value)
    assert message.startswith(f"{kernel}: NPU function error: call failed, error code is 161002")
    assert f"documented limit: {kernel_constraints.DOCS} {kernel}" in message


def test_the_limits_table_has_a_row_per_mocked_kernel(capsys) -> None:
    ops_main(["--kernel-limits"])
    rows = capsys.readouterr().out.splitlines()[2:]
    assert len(rows) == len(kernel_constraints.KERNEL_LIMITS)
    kernels = " ".join(row.split(" | ")[0] for row in rows)
    assert all(name in kernels for name in MOCK_OPS), sorted(set(MOCK_OPS) - set(kernels.split()))


@pytest.mark.parametrize("head_dim", FAMILY_HEAD_DIMS)
def test_every_family_head_dim_is_within_the_documented_limits(head_dim: int) -> None:
    """npu_fusion_attention documents D in [1, 768] with no alignment (its tiling checks only
    that), npu_rotary_mul an even D < 896: no family head dim needs padding for either."""
    for dtype in NPU_DTYPES:
        assert kernel_constraints.fusion_attention_refusal(dtype, 1, 16, 16, 1, 1, head_dim) is None
        tokens = (16, 16)
        varlen = kernel_constraints.fusion_attention_varlen_refusal(
            dtype, 16, 16, head_dim, tokens, 2
        )
        assert varlen is None
        assert kernel_constraints.rotary_mul_refusal(dtype, head_dim, 1, 16, "half", "BNSD") is None


def _on_mock_and_cpu(op, *args, **kwargs):
    """``op`` on the mock NPU's kernel path and on the CPU reference."""
    out = op(*args, **kwargs)
    with using_backend("cpu"):
        return out, op(*args, **kwargs)


@pytest.mark.parametrize("dtype", NPU_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", FAMILY_HEAD_DIMS)
def test_fused_attention_takes_family_head_dims_unpadded(
    head_dim, dtype, mock_npu, monkeypatch
) -> None:
    spy = KernelSpy(monkeypatch, mock_npu.torch_npu, "npu_fusion_attention")
    generator = torch.Generator().manual_seed(head_dim)
    q, k, v = (
        torch.randn(2, heads, 5, head_dim, generator=generator).to(dtype) for heads in (4, 2, 2)
    )
    out, expected = _on_mock_and_cpu(ops.fused_attention, q, k, v, causal=True)
    assert spy.shapes[0][:2] == ((2, 4, 5, head_dim), (2, 2, 5, head_dim))
    torch.testing.assert_close(out, expected, **tolerance(dtype))


@pytest.mark.parametrize("dtype", NPU_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", FAMILY_HEAD_DIMS)
def test_varlen_attention_takes_family_head_dims_unpadded(
    head_dim, dtype, mock_npu, monkeypatch
) -> None:
    """The vision towers' packed attention: TND with segments of several lengths."""
    spy = KernelSpy(monkeypatch, mock_npu.torch_npu, "npu_fusion_attention")
    packed = torch.randn(9, 2, head_dim, generator=torch.Generator().manual_seed(3)).to(dtype)
    cu_seqlens = torch.tensor([0, 4, 9], dtype=torch.int32)
    out, expected = _on_mock_and_cpu(
        ops.varlen_attention, packed, packed, packed, cu_seqlens, cu_seqlens
    )
    assert spy.shapes == [((9, 2, head_dim),) * 3]
    torch.testing.assert_close(out, expected, **tolerance(dtype))


@pytest.mark.parametrize("dtype", NPU_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", (8, 64, 72, 80, 96, 128))
def test_rotary_embedding_takes_family_head_dims_unpadded(
    head_dim, dtype, mock_npu, monkeypatch
) -> None:
    spy = KernelSpy(monkeypatch, mock_npu.torch_npu, "npu_rotary_mul")
    x = torch.randn(1, 2, 6, head_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    angles = torch.rand(1, 6, head_dim // 2).repeat(1, 1, 2) * 6.0
    out, expected = _on_mock_and_cpu(
        ops.rotary_embedding, x, angles.cos().to(dtype), angles.sin().to(dtype)
    )
    assert spy.shapes[0][0] == (1, 2, 6, head_dim)
    torch.testing.assert_close(out, expected, **tolerance(dtype))


def _delta_inputs(key_dim: int, value_dim: int, seed: int):
    """bfloat16 q/k ``[2, 5, 2, Dk]``, v ``[2, 5, 4, Dv]``, g/beta ``[2, 5, 4]`` and a state."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    q, k, v = randn(2, 5, 2, key_dim), randn(2, 5, 2, key_dim), randn(2, 5, 4, value_dim)
    g = -torch.nn.functional.softplus(randn(2, 5, 4))
    beta = torch.sigmoid(randn(2, 5, 4))
    state = randn(2, 4, key_dim, value_dim) * 0.1
    return (*(t.bfloat16() for t in (q, k, v, g, beta)), state)


@pytest.mark.parametrize(("key_dim", "value_dim"), [(8, 8), (64, 72), (80, 96), (128, 128)])
def test_chunk_gated_delta_rule_pads_head_dims_below_128(
    key_dim, value_dim, mock_npu, monkeypatch
) -> None:
    """The kernel takes only Dk = Dv = 128: smaller head dims reach it zero-padded (q, k, v,
    the state), with the scale of the original Dk, and come back sliced: the reference's
    output and final state."""
    spy = KernelSpy(monkeypatch, mock_npu.torch_npu, "npu_chunk_gated_delta_rule")
    inputs = _delta_inputs(key_dim, value_dim, seed=key_dim)
    (out, state), (want_out, want_state) = _on_mock_and_cpu(
        ops.chunk_gated_delta_rule, *inputs, use_qk_l2norm=True
    )
    assert spy.shapes == [((10, 2, 128), (10, 2, 128), (10, 4, 128))]
    assert out.shape == want_out.shape == (2, 5, 4, value_dim)
    assert state.shape == want_state.shape == (2, 4, key_dim, value_dim)
    # the kernel rounds its state and inputs to bfloat16
    torch.testing.assert_close(out, want_out, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(state, want_state, atol=3e-2, rtol=3e-2)


def test_chunk_gated_delta_rule_runs_the_reference_above_128(mock_npu, monkeypatch) -> None:
    spy = KernelSpy(monkeypatch, mock_npu.torch_npu, "npu_chunk_gated_delta_rule")
    out, expected = _on_mock_and_cpu(
        ops.chunk_gated_delta_rule, *_delta_inputs(136, 8, seed=0), use_qk_l2norm=True
    )
    assert spy.calls == 0
    torch.testing.assert_close(out, expected)
