"""``torch.library.opcheck`` on every op's OpInfo samples (the table in test_op_info).

opcheck runs the registered ``torch.ops.ascend_vlm.<name>.default`` under its four checks: the
schema (no undeclared mutation or aliasing of inputs), the autograd registration, the fake
kernel against the real one (shapes, dtypes, strides) and AOT dispatch with static and dynamic
shapes. Each sample runs without and with gradients on its floating-point positional inputs
(only positional inputs can receive gradients), on the reference path and on the NPU path
(mock torch_npu, or real hardware with ASCEND_VLM_TEST_REAL_NPU=1).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _op_samples import on_device
from hypothesis import Phase, given, settings
from test_op_info import OP_INFOS

from ascend_vlm import ops

SAMPLES_PER_OP = 2
SAMPLE_DTYPES = (torch.float32, torch.bfloat16)


def _samples(name: str) -> list[Any]:
    """The first :data:`SAMPLES_PER_OP` cases the op's strategy draws, the same every run."""
    drawn: list[Any] = []

    @settings(
        max_examples=SAMPLES_PER_OP,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.generate],
    )
    @given(OP_INFOS[name].cases(dtypes=SAMPLE_DTYPES))
    def collect(case: Any) -> None:
        drawn.append(case)

    collect()
    return drawn[:SAMPLES_PER_OP]


def _with_grads(args: tuple) -> tuple:
    """``args`` with every floating-point tensor a fresh leaf that requires grad."""
    return tuple(
        a.detach().clone().requires_grad_(True)
        if isinstance(a, torch.Tensor) and a.is_floating_point()
        else a
        for a in args
    )


# varlen_attention's segment lengths are values of cu_seqlens, moe_experts' rows per expert
# counts of selected_experts: their backward (the reference recomputed) reads them on the host,
# which fake tensors cannot, so AOT autograd cannot trace it. The forward traces through the
# fake kernel and is checked like every other op's.
_UNTRACEABLE_BACKWARD = {"moe_experts", "varlen_attention"}
_ALL_CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor")
_AOT = ("test_aot_dispatch_dynamic",)


def _opcheck_all_samples(name: str, device: torch.device) -> int:
    """opcheck each sample of ``name`` on ``device`` without and with grads; returns the number
    of opcheck runs (each raises on the first failing check)."""
    overload = getattr(torch.ops.ascend_vlm, name).default
    runs = 0
    for case in _samples(name):
        args, kwargs = on_device(*case.op_args(), device)
        for sample_args, grads in ((args, False), (_with_grads(args), True)):
            aot = () if grads and name in _UNTRACEABLE_BACKWARD else _AOT
            torch.library.opcheck(overload, sample_args, kwargs, test_utils=_ALL_CHECKS + aot)
            runs += 1
    return runs


def test_the_table_covers_every_public_op() -> None:
    assert sorted(OP_INFOS) == sorted(ops.OPS)


@pytest.mark.parametrize("name", sorted(OP_INFOS))
def test_opcheck_reference_path(name: str) -> None:
    assert _opcheck_all_samples(name, torch.device("cpu")) == 2 * SAMPLES_PER_OP


@pytest.mark.parametrize("name", sorted(OP_INFOS))
def test_opcheck_npu_path(name: str, mock_npu) -> None:
    assert _opcheck_all_samples(name, mock_npu.device) == 2 * SAMPLES_PER_OP
