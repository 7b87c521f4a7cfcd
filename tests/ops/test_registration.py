"""The op factory (ascend_vlm/ops/_registration.py): every function taking an op's arguments is
generated from its spec, and each path checks a call with the op's one check."""

from __future__ import annotations

import inspect
import pickle

import pytest
import torch
from _error_inputs import ERROR_INPUTS
from _recording import RecordOps
from torch._subclasses.fake_tensor import FakeTensorMode

from ascend_vlm import ops
from ascend_vlm.ops._op_spec import load_spec

OP_NAMES = ops.OPS
CASES = [(op, name) for op, table in ERROR_INPUTS.items() for name in sorted(table)]
# Rules on the values of cu_seqlens: fake tensors have none, so only real kernels check them.
VALUE_RULES = {("varlen_attention", n) for n in ("cu_end", "cu_order", "max_seqlen")}
# Under FakeTensorMode the public function cannot draw its dropout seed (a host read).
NEEDS_VALUES = VALUE_RULES | {("fused_attention", "dropout")}


@pytest.mark.parametrize("name", OP_NAMES)
def test_public_function_has_exactly_the_spec_signature_and_a_docstring(name: str) -> None:
    public = getattr(ops, name)
    assert inspect.signature(public) == load_spec(name).signature()
    assert (public.__name__, public.__qualname__) == (name, name)
    assert public.__doc__.split()[0] and "ValueError" in public.__doc__
    assert pickle.loads(pickle.dumps(public)) is public


def _message(call) -> str:
    with pytest.raises(ValueError) as raised:
        call()
    return str(raised.value)


@pytest.mark.parametrize(("op", "name"), CASES, ids=[f"{op}-{name}" for op, name in CASES])
def test_every_path_rejects_bad_input_with_the_kernels_message(op: str, name: str) -> None:
    call, expected = ERROR_INPUTS[op][name]
    with RecordOps() as recorder:  # a dispatch mode: the call goes through the registered kernel
        kernel = _message(call)
    assert f"ascend_vlm.{op}.default" in recorder.names
    assert expected in kernel
    with torch.no_grad():  # the eager fast path
        assert _message(call) == kernel
    if (op, name) not in NEEDS_VALUES:
        with FakeTensorMode(allow_non_fake_inputs=True):
            assert _message(call) == kernel


def test_value_rules_are_what_fake_tensors_cannot_check() -> None:
    for op, name in sorted(VALUE_RULES):
        call, _ = ERROR_INPUTS[op][name]
        with FakeTensorMode(allow_non_fake_inputs=True):
            assert call().shape == (6, 4, 8)  # the query's shape: the fake's rule


def test_the_check_runs_once_per_call_on_the_fast_path(monkeypatch) -> None:
    calls = []
    check = ops.swiglu.__globals__["_check"]  # what the generated functions call
    monkeypatch.setitem(ops.swiglu.__globals__, "_check", lambda *a: calls.append(a) or check(*a))
    x = torch.randn(2, 8)
    with torch.no_grad():
        out = ops.swiglu(x)
    assert calls == [(x, -1)] and out.shape == (2, 4)
