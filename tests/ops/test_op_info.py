"""OpInfo-style checks shared by every op, driven by the sample generators in _op_samples:

* the reference path matches the independent naive formula (hypothesis, fp32/bf16/fp16);
* the NPU path (mock torch_npu, or real hardware with ASCEND_VLM_TEST_REAL_NPU=1) calls the
  torch_npu kernel when the case is within its documented support and matches the same formula;
* ``torch.compile(fullgraph=True)`` and ``torch.export`` trace each op (fake impls) and agree
  with eager.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from _op_samples import (
    KernelSpy,
    assert_matches_naive,
    attention_cases,
    on_device,
    rms_norm_cases,
    rotary_cases,
    swiglu_cases,
    varlen_cases,
)
from hypothesis import HealthCheck, given, settings
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
    per_batch = case.table_form in ("BS", "mrope") and case.batch > 1
    return not (case.interleaved and per_batch)


@dataclass(frozen=True)
class OpInfo:
    op: Callable[..., torch.Tensor]
    cases: Callable[[], st.SearchStrategy]
    npu_kernel: str
    kernel_applies: Callable[[Any], bool] = lambda case: True


OP_INFOS = {
    "fused_attention": OpInfo(ops.fused_attention, attention_cases, "npu_fusion_attention"),
    "varlen_attention": OpInfo(
        ops.varlen_attention, varlen_cases, "npu_fusion_attention", _varlen_kernel_applies
    ),
    "rms_norm": OpInfo(ops.rms_norm, rms_norm_cases, "npu_rms_norm"),
    "rotary_embedding": OpInfo(
        ops.rotary_embedding, rotary_cases, "npu_rotary_mul", _rotary_kernel_applies
    ),
    "swiglu": OpInfo(ops.swiglu, swiglu_cases, "npu_swiglu"),
}


@pytest.mark.parametrize("name", sorted(OP_INFOS))
@SETTINGS
@given(data=st.data())
def test_reference_matches_naive(name: str, data: st.DataObject) -> None:
    info = OP_INFOS[name]
    case = data.draw(info.cases())
    args, kwargs = case.op_args()
    assert_matches_naive(info.op(*args, **kwargs), case.expected(), case.dtype)


@pytest.mark.parametrize("name", sorted(OP_INFOS))
@SETTINGS
@given(data=st.data())
def test_npu_path_matches_naive(name: str, data: st.DataObject, mock_npu, monkeypatch) -> None:
    info = OP_INFOS[name]
    case = data.draw(info.cases())
    spy = KernelSpy(monkeypatch, mock_npu.torch_npu, info.npu_kernel)
    args, kwargs = on_device(*case.op_args(), mock_npu.device)
    out = info.op(*args, **kwargs)
    assert spy.calls == (1 if info.kernel_applies(case) else 0)
    assert_matches_naive(out, case.expected(), case.dtype)


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
    torch._dynamo.reset()
    # aot_eager: dynamo + AOTAutograd on fake tensors (the fake impls), without inductor C++
    # codegen, whose first compile alone costs ~50 s on a 2-core machine.
    compiled = torch.compile(lambda *a: op(*a, **kwargs) * 2.0, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(*args), op(*args, **kwargs) * 2.0)


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
