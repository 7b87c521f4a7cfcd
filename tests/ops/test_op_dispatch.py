"""The public wrappers run the kernel directly only when the dispatcher would make no difference;
otherwise (gradients, compile, modes, fake/meta tensors) they go through the registered op."""

from __future__ import annotations

import pickle

import pytest
import torch
from _recording import RecordOps

from ascend_vlm import ops


def test_eager_inference_result_equals_the_registered_op() -> None:
    q, k, v = (torch.randn(2, 4, 3, 8) for _ in range(3))
    with torch.no_grad():
        direct = ops.fused_attention(q, k, v, causal=True)
    torch.testing.assert_close(direct, torch.ops.ascend_vlm.fused_attention(q, k, v, causal=True))


def test_dispatch_modes_see_the_custom_op() -> None:
    x = torch.randn(2, 8)
    with RecordOps() as recorder:
        ops.swiglu(x)
    assert "ascend_vlm.swiglu.default" in recorder.names


def test_inputs_requiring_grad_go_through_autograd() -> None:
    x = torch.randn(2, 8, requires_grad=True)
    out = ops.rms_norm(x, torch.ones(8))
    assert out.grad_fn is not None and "ascend_vlm" in type(out.grad_fn).__name__.lower()


def test_meta_tensors_use_the_fake_impl() -> None:
    q = torch.randn(2, 1, 4, 8, device="meta")
    mask = torch.ones(2, 4, dtype=torch.bool, device="meta")
    out = ops.fused_attention(q, q, q, attention_mask=mask, causal=True)
    assert out.is_meta and out.shape == q.shape


def test_a_meta_input_beside_real_ones_raises_instead_of_returning_a_fake_result() -> None:
    x, meta_weight = torch.randn(2, 8), torch.ones(8, device="meta")
    with torch.no_grad(), pytest.raises(RuntimeError, match="meta"):
        ops.rms_norm(x, meta_weight)


def _profiled_op_names(call) -> set[str]:
    with torch.profiler.profile() as profiler:
        call()
    return {event.name for event in profiler.events()}


def test_module_parameters_skip_the_dispatcher_in_inference_only() -> None:
    weight, x = torch.nn.Parameter(torch.ones(8)), torch.randn(2, 8)
    with torch.no_grad():
        inference = _profiled_op_names(lambda: ops.rms_norm(x, weight))
    assert "ascend_vlm::rms_norm" not in inference  # patched norms hand their weight Parameter
    assert "ascend_vlm::rms_norm" in _profiled_op_names(lambda: ops.rms_norm(x, weight))


@pytest.mark.parametrize("name", [n for n in ops.__all__ if callable(getattr(ops, n))])
def test_each_public_function_pickles_by_name(name: str) -> None:
    # Patched modules hold the public ops and compositions; pickling a patched model refers to
    # them by name.
    function = getattr(ops, name)
    assert function.__module__.startswith("ascend_vlm.ops.")
    assert pickle.loads(pickle.dumps(function)) is function
