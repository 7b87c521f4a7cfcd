"""OpInfo-style checks shared by every op, driven by the sample generators in _op_samples:

* the reference path matches the independent naive formula (hypothesis, fp32/bf16/fp16);
* the NPU path (mock torch_npu, or real hardware with ASCEND_VLM_TEST_REAL_NPU=1) calls the
  torch_npu kernel when the case is within its documented support and matches the same formula;
* backward, for every subset of the op's differentiable inputs that requires grad and every
  subset of its outputs that receives a gradient (the others get None), gives the gradients of
  the naive float64 formula, on the reference and the NPU path;
* ``torch.compile(fullgraph=True)`` and ``torch.export`` trace each op (fake impls) and agree
  with eager.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from _op_samples import (
    FLOAT_DTYPES,
    KernelSpy,
    as_float64,
    assert_matches_naive,
    attention_cases,
    causal_conv_cases,
    gated_delta_cases,
    moe_cases,
    on_device,
    rms_norm_cases,
    rotary_cases,
    rotary_pair_cases,
    swiglu_cases,
    tolerance,
    varlen_cases,
    weight_quant_cases,
)
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ascend_vlm import ops

SETTINGS = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _varlen_kernel_applies(case: Any) -> bool:
    """Varlen forbids fully masked rows, so segments with queries but no visible key stay on
    the reference."""
    return not any(
        q > 0 and (k == 0 or (case.causal and q > k))
        for q, k in zip(case.q_lens, case.kv_lens, strict=True)
    )


def _rotary_kernel_applies(case: Any) -> bool:
    """npu_rotary_mul's interleave mode takes only 11SD tables (no per-batch cos/sin)."""
    case = getattr(case, "single", case)  # the pair's q case
    per_batch = case.table_form in ("BS", "mrope") and case.batch > 1
    return not (case.interleaved and per_batch)


def _weight_quant_kernel_applies(case: Any) -> bool:
    """npu_weight_quant_batchmatmul takes fp16/bf16 x; int4 weights reach it only prepacked
    (ops.prepack_int4_for_npu), so the library's uint8 layout stays on the reference."""
    return case.dtype in (torch.float16, torch.bfloat16) and case.bits == 8


def _chunk_kernel_applies(case: Any) -> bool:
    """npu_chunk_gated_delta_rule takes bfloat16 with Dk = Dv = 128; smaller head dims are
    zero-padded up to 128 (ops.chunk_gated_delta_rule)."""
    return case.dtype == torch.bfloat16 and max(case.key_dim, case.value_dim) <= 128


def _recurrent_kernel_applies(case: Any) -> bool:
    """npu_recurrent_gated_delta_rule takes bfloat16 (sizes here are within its limits)."""
    return case.dtype == torch.bfloat16


# float32 gradients of a recurrence through exponentials and triangular solves (backward
# differentiates the whole scan) carry more rounding than one op's: 1e-4 instead of 1e-5.
GATED_DELTA_GRAD_TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}


@dataclass(frozen=True)
class OpInfo:
    """``differentiable``: positions of the op's inputs that can require grad;
    ``kernel_launches``: NPU kernel calls per op call when the kernel applies;
    ``grad_tolerance``: of the float32 gradients against the float64 formula's."""

    op: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]]
    cases: Callable[[], st.SearchStrategy]
    npu_kernel: str
    differentiable: tuple[int, ...]
    kernel_applies: Callable[[Any], bool] = lambda case: True
    kernel_launches: Callable[[Any], int] = lambda case: 1
    grad_tolerance: dict[str, float] = field(default_factory=lambda: tolerance(torch.float32))


OP_INFOS = {
    "causal_conv1d": OpInfo(
        ops.causal_conv1d,
        causal_conv_cases,
        "npu_fused_causal_conv1d",
        (0, 1, 2, 3),
        # documented for the Ascend 950 only, and the mock reports an Atlas A2 SoC:
        # tests/ops/test_gated_delta_rule.py runs the kernel path with the SoC name replaced
        lambda case: False,
    ),
    "chunk_gated_delta_rule": OpInfo(
        ops.chunk_gated_delta_rule,
        lambda dtypes=FLOAT_DTYPES: gated_delta_cases(dtypes, kernel_dims=128),
        "npu_chunk_gated_delta_rule",
        (0, 1, 2, 3, 4, 5),
        _chunk_kernel_applies,
        grad_tolerance=GATED_DELTA_GRAD_TOLERANCE,
    ),
    "recurrent_gated_delta_rule": OpInfo(
        ops.recurrent_gated_delta_rule,
        gated_delta_cases,
        "npu_recurrent_gated_delta_rule",
        (0, 1, 2, 3, 4, 5),
        _recurrent_kernel_applies,
        kernel_launches=lambda case: case.tokens,  # one call per time step
        grad_tolerance=GATED_DELTA_GRAD_TOLERANCE,
    ),
    "fused_attention": OpInfo(
        ops.fused_attention, attention_cases, "npu_fusion_attention", (0, 1, 2)
    ),
    "varlen_attention": OpInfo(
        ops.varlen_attention,
        varlen_cases,
        "npu_fusion_attention",
        (0, 1, 2),
        _varlen_kernel_applies,
    ),
    # One grouped matmul per projection; bfloat16 also permutes with npu_moe_token_permute.
    "moe_experts": OpInfo(
        ops.moe_experts,
        moe_cases,
        "npu_grouped_matmul",
        (0, 1, 3, 4),
        kernel_launches=lambda case: 2,
    ),
    "rms_norm": OpInfo(ops.rms_norm, rms_norm_cases, "npu_rms_norm", (0, 1)),
    "rotary_embedding": OpInfo(
        ops.rotary_embedding, rotary_cases, "npu_rotary_mul", (0, 1, 2), _rotary_kernel_applies
    ),
    "rotary_embedding_pair": OpInfo(
        ops.rotary_embedding_pair,
        rotary_pair_cases,
        "npu_rotary_mul",
        (0, 1, 2, 3),
        _rotary_kernel_applies,
        kernel_launches=lambda case: 2,
    ),
    "swiglu": OpInfo(ops.swiglu, swiglu_cases, "npu_swiglu", (0,)),
    "weight_quant_matmul": OpInfo(
        ops.weight_quant_matmul,
        weight_quant_cases,
        "npu_weight_quant_batchmatmul",
        (0,),
        _weight_quant_kernel_applies,
    ),
}


def _as_tuple(out: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def _assert_all_match_naive(out: Any, expected: Any, case: Any) -> None:
    """Each output against the naive formula's; ``case.output_dtypes`` when outputs differ in
    dtype (a recurrent state in float32), else every output in ``case.dtype``."""
    outputs = _as_tuple(out)
    dtypes = getattr(case, "output_dtypes", (case.dtype,) * len(outputs))
    for got, want, dtype in zip(outputs, _as_tuple(expected), dtypes, strict=True):
        assert_matches_naive(got, want, case.dtype, dtype)


@pytest.mark.parametrize("name", sorted(OP_INFOS))
@SETTINGS
@given(data=st.data())
def test_reference_matches_naive(name: str, data: st.DataObject) -> None:
    info = OP_INFOS[name]
    case = data.draw(info.cases())
    args, kwargs = case.op_args()
    _assert_all_match_naive(info.op(*args, **kwargs), case.expected(), case)


@pytest.mark.parametrize("name", sorted(OP_INFOS))
@SETTINGS
@given(data=st.data())
def test_npu_path_matches_naive(name: str, data: st.DataObject, mock_npu, monkeypatch) -> None:
    info = OP_INFOS[name]
    case = data.draw(info.cases())
    spy = KernelSpy(monkeypatch, mock_npu.torch_npu, info.npu_kernel)
    args, kwargs = on_device(*case.op_args(), mock_npu.device)
    out = info.op(*args, **kwargs)
    assert spy.calls == (info.kernel_launches(case) if info.kernel_applies(case) else 0)
    _assert_all_match_naive(out, case.expected(), case)


def _nonempty_subsets(items: tuple[int, ...]) -> list[tuple[int, ...]]:
    return [
        subset
        for size in range(1, len(items) + 1)
        for subset in itertools.combinations(items, size)
    ]


GRAD_SUBSETS = [
    (name, subset)
    for name, info in sorted(OP_INFOS.items())
    for subset in _nonempty_subsets(info.differentiable)
]


def _weighted_loss(outputs: tuple[torch.Tensor, ...], used: tuple[int, ...]) -> torch.Tensor:
    """``sum_i <outputs[i], w_i>`` over the ``used`` outputs, with fixed random weights ``w_i``;
    the other outputs receive no gradient."""
    generator = torch.Generator().manual_seed(11)
    return sum(
        (
            outputs[i].double()
            * torch.randn(outputs[i].shape, generator=generator, dtype=torch.float64)
        ).sum()
        for i in used
    )


def _grads(loss: torch.Tensor, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """d loss / d inputs, zeros where the loss does not depend on an input (or on none); the
    graph is kept for the next subset of outputs."""
    if not loss.requires_grad:
        return [torch.zeros_like(t, dtype=torch.float64) for t in inputs]
    grads = torch.autograd.grad(loss, inputs, allow_unused=True, retain_graph=True)
    return [
        torch.zeros_like(t, dtype=torch.float64) if g is None else g.double()
        for g, t in zip(grads, inputs, strict=True)
    ]


@pytest.mark.parametrize("backend", ["cpu", "mock"])
@pytest.mark.parametrize(
    ("name", "requiring"),
    GRAD_SUBSETS,
    ids=[f"{n}-{'+'.join(map(str, s))}" for n, s in GRAD_SUBSETS],
)
@settings(
    max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_grad_of_each_input_subset_matches_naive(
    name: str, requiring: tuple[int, ...], backend: str, data: st.DataObject, request
) -> None:
    """Only the inputs at positions ``requiring`` require grad; the loss uses each nonempty
    subset of the outputs in turn. fp32 op gradients against the float64 formula's."""
    info = OP_INFOS[name]
    case = data.draw(info.cases(dtypes=(torch.float32,)))
    args, kwargs = case.op_args()
    assume(all(args[i] is not None for i in requiring))  # an optional input left out
    if backend == "mock":
        args, kwargs = on_device(args, kwargs, request.getfixturevalue("mock_npu").device)
    leaves = [args[i].detach().requires_grad_(True) for i in requiring]
    op_args = list(args)
    naive_args = list(as_float64(args))
    naive_leaves = []
    for position, leaf in zip(requiring, leaves, strict=True):
        op_args[position] = leaf
        naive_args[position] = leaf.detach().double().requires_grad_(True)
        naive_leaves.append(naive_args[position])
    outputs = _as_tuple(info.op(*op_args, **kwargs))
    expected = _as_tuple(case.naive(*naive_args))
    for used in _nonempty_subsets(tuple(range(len(outputs)))):
        got = _grads(_weighted_loss(outputs, used), leaves)
        want = _grads(_weighted_loss(expected, used), naive_leaves)
        for position, got_grad, want_grad in zip(requiring, got, want, strict=True):
            torch.testing.assert_close(
                got_grad.cpu(),
                want_grad,
                **info.grad_tolerance,
                msg=lambda m, p=position, u=used: f"input {p}, outputs {u}: {m}",
            )


def _compile_sample(name: str) -> tuple[tuple, dict]:
    """One fixed small case per op (generated deterministically from the op's strategy)."""
    strategy = OP_INFOS[name].cases(dtypes=(torch.float32,))
    case = {}

    @settings(max_examples=1, deadline=None, database=None, derandomize=True)
    @given(strategy)
    def pick(drawn: Any) -> None:
        case["value"] = drawn

    pick()
    return case["value"].op_args()


@pytest.mark.parametrize("name", sorted(OP_INFOS))
def test_compile_fullgraph_matches_eager(name: str) -> None:
    op = OP_INFOS[name].op
    args, kwargs = _compile_sample(name)

    def doubled(*a: Any) -> list[torch.Tensor]:
        return [2.0 * out for out in _as_tuple(op(*a, **kwargs))]

    torch._dynamo.reset()
    # aot_eager: dynamo + AOTAutograd on fake tensors (the fake impls), without inductor C++
    # codegen, whose first compile alone costs ~50 s on a 2-core machine.
    compiled = torch.compile(doubled, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(*args), doubled(*args))


def test_export_traces_ops() -> None:
    class Block(torch.nn.Module):
        def forward(self, q, k, v, weight):
            attended = ops.fused_attention(q, k, v, causal=True)
            return ops.swiglu(ops.rms_norm(attended, weight), dim=-1)

    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    weight = torch.randn(8)
    exported = torch.export.export(Block(), (q, k, v, weight))
    targets = {str(node.target) for node in exported.graph.nodes if node.op == "call_function"}
    assert {
        "ascend_vlm.fused_attention.default",
        "ascend_vlm.rms_norm.default",
        "ascend_vlm.swiglu.default",
    } <= targets
    torch.testing.assert_close(exported.module()(q, k, v, weight), Block()(q, k, v, weight))
