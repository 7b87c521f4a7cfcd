"""Round-to-nearest quantization: every weight within half a step of its grid, the grid's
integer ranges, signs of symmetric grids, repeated values, and bad schemes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_vlm.quantization.rtn import quantize_rtn


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 9),
    columns=st.integers(1, 300),
    bits=st.sampled_from([4, 8]),
    group_size=st.sampled_from([0, 32, 64, 128, 256]),
    symmetric=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_every_weight_lies_within_half_a_step(rows, columns, bits, group_size, symmetric, seed):
    weight = torch.randn(rows, columns, generator=torch.Generator().manual_seed(seed)) * 3
    quantized = quantize_rtn(weight, bits, group_size, symmetric=symmetric)
    group = group_size or columns
    groups = -(-columns // group)
    assert quantized.scale.shape == (groups, rows)
    assert (quantized.offset is None) == symmetric
    q = quantized.values().to(torch.int64)
    low, high = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    assert q.min() >= low and q.max() <= high
    step = quantized.scale.double().repeat_interleave(group, dim=0)[:columns].t()
    error = (quantized.dequantize(torch.float64) - weight.double()).abs()
    # half a step, and the float32 rounding of the scale's products
    assert torch.all(error <= step / 2 + 1e-5 * weight.abs().double().max())


def test_symmetric_grids_keep_zero_and_signs():
    weight = torch.tensor([[-2.0, -0.5, 0.0, 0.5, 2.0] * 8])
    quantized = quantize_rtn(weight, 8, 0, symmetric=True)
    q = quantized.values()[0]
    assert q[2] == 0 and torch.equal(q.sign(), weight[0].sign().to(torch.int8))
    assert q.abs().max() == 127


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("value", [0.3, -0.7, 0.0])
def test_a_repeated_value_is_reproduced(bits, symmetric, value):
    # the range [min(c, 0), max(c, 0)] has c at one end of the grid
    weight = torch.full((3, 70), value)
    dequantized = quantize_rtn(weight, bits, 32, symmetric=symmetric).dequantize()
    torch.testing.assert_close(dequantized, weight, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("bits", "symmetric"), [(8, True), (8, False), (4, False)])
def test_half_precision_scales_keep_every_weight_within_half_a_step(dtype, bits, symmetric):
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(16, 256, generator=generator) + torch.linspace(-3, 5, 16)[:, None]
    quantized = quantize_rtn(weight, bits, 64, symmetric=symmetric, dtype=dtype)
    if quantized.offset is not None:  # integer offsets, exact in half precision
        assert torch.equal(quantized.offset, quantized.offset.round())
        assert quantized.offset.abs().max() <= 2 ** (bits - 1)
    step = quantized.scale.double().repeat_interleave(64, dim=0).t()
    error = (quantized.dequantize(torch.float64) - weight.double()).abs()
    assert torch.all(error <= step / 2 * (1 + 1e-6))


def test_scales_take_the_requested_dtype_and_int4_is_packed():
    quantized = quantize_rtn(torch.randn(6, 65), 4, 32, dtype=torch.float16)
    assert quantized.scale.dtype == quantized.offset.dtype == torch.float16
    assert quantized.qweight.dtype == torch.uint8 and quantized.qweight.shape == (6, 33)


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ((3, 128), ValueError, r"^bits: expected one of \(4, 8\), got 3"),
        ((4, 48), ValueError, r"^group_size: expected 0 \(per channel\) or a multiple of 32"),
        ((4, 512), ValueError, r"^group_size: expected 0 \(per channel\) or a multiple of 32"),
        ((4.0, 128), TypeError, r"^bits: expected an int, got float"),
        ((8, True), TypeError, r"^group_size: expected an int, got bool"),
    ],
)
def test_bad_schemes_are_named(arguments, error, message):
    with pytest.raises(error, match=message):
        quantize_rtn(torch.randn(4, 64), *arguments)


def test_a_weight_that_is_not_a_float_matrix_is_refused():
    with pytest.raises(ValueError, match=r"^weight: expected a 2-D floating \(N, K\) tensor"):
        quantize_rtn(torch.randn(4, 4, 4), 8)
    with pytest.raises(ValueError, match=r"^weight: expected a 2-D floating"):
        quantize_rtn(torch.ones(4, 4, dtype=torch.int64), 8)
