"""rms_norm specifics: gradients, fp32 computation, input errors."""

from __future__ import annotations

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
