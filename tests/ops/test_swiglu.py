"""swiglu specifics: gradients, first-half gating, input errors."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from _recording import RecordOps

from ascend_vlm import ops
from ascend_vlm.ops.swiglu import swiglu_projections


@pytest.mark.parametrize("dim", [-1, 0])
def test_gradcheck_fp64(dim: int) -> None:
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: ops.swiglu(t, dim), (x,))


def test_first_half_is_gated() -> None:
    gate, up = torch.randn(3, 4), torch.randn(3, 4)
    out = ops.swiglu(torch.cat((gate, up), dim=-1))
    torch.testing.assert_close(out, F.silu(gate) * up)
    assert not torch.allclose(out, F.silu(up) * gate)


X = torch.randn(2, 6)


def test_projections_equal_the_op_on_the_concatenated_halves_with_gradients() -> None:
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    gate_proj, up_proj = (torch.nn.Linear(4, 5).double() for _ in range(2))
    expected = ops.swiglu(torch.cat((gate_proj(x), up_proj(x)), -1))
    torch.testing.assert_close(swiglu_projections(x, gate_proj, up_proj), expected)
    assert torch.autograd.gradcheck(lambda t: swiglu_projections(t, gate_proj, up_proj), (x,))


@pytest.mark.parametrize(
    ("up_proj", "message"),
    [
        (
            lambda x: x[:, :5],
            "up_proj(x): expected shape (2, 6) like gate_proj(x), got shape (2, 5)",
        ),
        (lambda x: x.double(), "up_proj(x): expected dtype torch.float32 (same as gate_proj(x))"),
    ],
)
def test_projections_reject_mismatched_halves(up_proj, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        swiglu_projections(X, lambda x: x, up_proj)


def _recorded_projections(device: torch.device) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    x = torch.randn(2, 4, device=device)
    gate_proj, up_proj = (torch.nn.Linear(4, 6).to(device) for _ in range(2))
    with torch.no_grad(), RecordOps() as recorder:
        out = swiglu_projections(x, gate_proj, up_proj)
        expected = F.silu(gate_proj(x)) * up_proj(x)
    return recorder.names, out, expected


def test_projections_on_the_reference_path_make_no_concatenation() -> None:
    names, out, expected = _recorded_projections(torch.device("cpu"))
    torch.testing.assert_close(out, expected)
    assert "aten.cat.default" not in names and "ascend_vlm.swiglu.default" not in names


def test_projections_feed_the_fused_kernel_their_concatenation(mock_npu) -> None:
    names, out, expected = _recorded_projections(mock_npu.device)
    torch.testing.assert_close(out, expected)
    assert names.index("aten.cat.default") < names.index("ascend_vlm.swiglu.default")
