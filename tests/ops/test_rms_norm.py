"""rms_norm specifics: gradients, fp32 computation, input errors."""

from __future__ import annotations

import re

import pytest
import torch
from _op_samples import RmsNormCase

from ascend_vlm import ops


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_gradcheck_fp64(offset: float) -> None:
    case = RmsNormCase((2, 3, 5), 1e-6, offset, torch.float64, torch.float64, seed=1)
    (x, weight, eps), kwargs = case.op_args()
    inputs = (x.requires_grad_(), weight.requires_grad_())
    assert torch.autograd.gradcheck(lambda a, w: ops.rms_norm(a, w, eps, **kwargs), inputs)


def test_half_input_is_normalised_in_fp32() -> None:
    # Squares of 300 overflow fp16 (max 65504) unless the mean is taken in fp32.
    x = torch.full((2, 8), 300.0, dtype=torch.float16)
    out = ops.rms_norm(x, torch.ones(8, dtype=torch.float16))
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, torch.ones_like(out))


X = torch.randn(2, 3, 8)
BAD_CALLS = {
    "weight_shape": (
        lambda: ops.rms_norm(X, torch.ones(7)),
        "weight: expected shape (8,) matching x's last dim, got (7,)",
    ),
    "weight_rank": (lambda: ops.rms_norm(X, torch.ones(1, 8)), "weight: expected 1-D [H=8]"),
    "dtype": (lambda: ops.rms_norm(X.int(), torch.ones(8)), "x: expected dtype in"),
    "scalar": (lambda: ops.rms_norm(torch.tensor(1.0), torch.ones(1)), "x: expected at least 1-D"),
    "eps": (lambda: ops.rms_norm(X, torch.ones(8), -1.0), "eps: expected a float >= 0"),
}


@pytest.mark.parametrize("name", sorted(BAD_CALLS))
def test_bad_inputs_raise_value_error_naming_argument(name: str) -> None:
    call, message = BAD_CALLS[name]
    with pytest.raises(ValueError, match=re.escape(message)):
        call()
