"""``ops.weight_quant_matmul`` beyond the shared OpInfo checks: the full grid of bit widths, group
sizes (K not a multiple of the group, odd N), dtypes, offsets and biases on the reference and the
NPU path; which CPU kernel runs; int4 through ``prepack_int4_for_npu``; SoC fallbacks;
gradients; ``dequantize_weight``. Oracle: the float64 formula of ``_op_samples.WeightQuantCase``.
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from _op_samples import KernelSpy, WeightQuantCase, as_float64, on_device

from ascend_vlm import ops
from ascend_vlm.kernel_backend import using_backend

KERNEL = "npu_weight_quant_batchmatmul"
# K = 300 leaves a partial last group for every group size; N = 7 is odd.
GRID = list(
    itertools.product(
        (8, 4),
        (0, 32, 128, 256),
        (torch.float16, torch.bfloat16, torch.float32),
        (False, True),
        (False, True),
    )
)


def _case(
    bits: int = 8,
    group_size: int = 0,
    dtype: torch.dtype = torch.float32,
    *,
    with_offset: bool = False,
    with_bias: bool = False,
    leading: tuple[int, ...] = (2, 3),
    in_features: int = 300,
    out_features: int = 7,
    scale_dtype: torch.dtype | None = None,
    seed: int = 0,
) -> WeightQuantCase:
    return WeightQuantCase(
        leading=leading,
        in_features=in_features,
        out_features=out_features,
        bits=bits,
        group_size=group_size,
        with_offset=with_offset,
        with_bias=with_bias,
        dtype=dtype,
        scale_dtype=dtype if scale_dtype is None else scale_dtype,
        seed=seed,
    )


def assert_close_to_naive(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Tolerances relative to the output's scale: 1e-5 for fp32, 2e-2 for fp16/bf16 (whose
    dequantized weights are rounded to the activation dtype)."""
    assert out.dtype == dtype and out.shape == expected.shape
    bound = {torch.float64: 1e-10, torch.float32: 1e-5}.get(dtype, 2e-2)
    scale = max(1.0, expected.abs().max().item())
    torch.testing.assert_close(out.cpu().double(), expected, atol=bound * scale, rtol=bound)


@pytest.mark.parametrize(
    ("bits", "group_size", "dtype", "with_offset", "with_bias"),
    GRID,
    ids=[
        f"w{b}-g{g}-{str(d)[6:]}{'-offset' if o else ''}{'-bias' if c else ''}"
        for b, g, d, o, c in GRID
    ],
)
@pytest.mark.parametrize("backend", ["cpu", "mock"])
def test_grid_matches_float64_dequantized_reference(
    bits, group_size, dtype, with_offset, with_bias, backend, request, monkeypatch
) -> None:
    rank = 1 + (bits + group_size // 32 + with_offset + 2 * with_bias) % 3  # x of rank 1, 2, 3
    case = _case(
        bits,
        group_size,
        dtype,
        with_offset=with_offset,
        with_bias=with_bias,
        leading=(2, 3)[: rank - 1],
    )
    args, kwargs = case.op_args()
    calls = None
    if backend == "mock":
        npu = request.getfixturevalue("mock_npu")
        spy = KernelSpy(monkeypatch, npu.torch_npu, KERNEL)
        args, kwargs = on_device(args, kwargs, npu.device)
        calls = spy
    assert_close_to_naive(ops.weight_quant_matmul(*args, **kwargs), case.expected(), dtype)
    if calls is not None:  # fp16/bf16 int8 reach the kernel; uint8 int4 needs prepacking
        assert calls.calls == (dtype != torch.float32 and bits == 8)


@pytest.mark.parametrize("group_size", [0, 32, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_int4_on_the_npu_kernel_through_prepack(group_size, dtype, mock_npu, monkeypatch) -> None:
    case = _case(4, group_size, dtype, with_offset=True, with_bias=True, in_features=296)
    (x, packed, scale, offset, bias, _), _ = on_device(*case.op_args(), mock_npu.device)
    prepacked = ops.prepack_int4_for_npu(packed, case.in_features)
    assert prepacked.dtype == torch.int32 and prepacked.shape == (7, 296 // 8)
    spy = KernelSpy(monkeypatch, mock_npu.torch_npu, KERNEL)
    out = ops.weight_quant_matmul(x, prepacked, scale, offset, bias, group_size)
    assert spy.calls == 1
    assert_close_to_naive(out, case.expected(), dtype)


def test_group_size_at_least_k_is_passed_to_the_kernel_as_per_channel(
    mock_npu, monkeypatch
) -> None:
    case = _case(8, 128, torch.float16, with_offset=True, in_features=40)  # one partial group
    seen = []
    original = mock_npu.torch_npu.npu_weight_quant_batchmatmul

    def recording(*args, **kwargs):
        seen.append((args[1].shape, args[1].is_contiguous(), kwargs["antiquant_group_size"]))
        return original(*args, **kwargs)

    monkeypatch.setattr(mock_npu.torch_npu, KERNEL, recording)
    args, kwargs = on_device(*case.op_args(), mock_npu.device)
    assert_close_to_naive(ops.weight_quant_matmul(*args, **kwargs), case.expected(), case.dtype)
    assert seen == [((40, 7), False, 0)]  # the (K, N) transposed view of our (N, K) weight


@pytest.mark.parametrize(
    ("soc", "takes"),
    [
        # Atlas A2/A3: everything in fp16/bf16.
        ("Ascend910B3", {"int8-fp16", "int8-bf16", "group-fp16", "int4"}),
        ("Ascend910_9391", {"int8-fp16", "int8-bf16", "group-fp16", "int4"}),
        # Atlas inference cards: int8 per channel with fp16 x only.
        ("Ascend310P3", {"int8-fp16"}),
        ("Ascend910A", set()),
    ],
)
def test_soc_limits_fall_back_to_the_reference(soc, takes, mock_npu, monkeypatch) -> None:
    if not mock_npu.is_mock:
        pytest.skip("models other SoCs through the mock's get_device_name")
    monkeypatch.setattr(mock_npu.torch_npu.npu, "get_device_name", lambda device=None: soc)
    calls = {
        "int8-fp16": _case(8, 0, torch.float16, with_bias=True),
        "int8-bf16": _case(8, 0, torch.bfloat16, with_bias=True),
        "group-fp16": _case(8, 32, torch.float16, with_offset=True),
        "int4": _case(4, 32, torch.float16, in_features=296),
    }
    for name, case in calls.items():
        spy = KernelSpy(monkeypatch, mock_npu.torch_npu, KERNEL)
        (x, weight, scale, offset, bias, group_size), _ = case.op_args()
        if name == "int4":
            weight = ops.prepack_int4_for_npu(weight, case.in_features)
            if name not in takes:
                message = "x: expected float16 or bfloat16 (..., K) with at least one row"
                with pytest.raises(ValueError, match=re.escape(message)):
                    ops.weight_quant_matmul(x, weight, scale, offset, bias, group_size)
                continue
        out = ops.weight_quant_matmul(x, weight, scale, offset, bias, group_size)
        assert spy.calls == (name in takes), name
        assert_close_to_naive(out, case.expected(), case.dtype)


class _CountingInt8PackMm:
    def __init__(self, monkeypatch) -> None:
        self.calls = 0
        original = torch._weight_int8pack_mm

        def counting(*args):
            self.calls += 1
            return original(*args)

        monkeypatch.setattr(torch, "_weight_int8pack_mm", counting)


@pytest.mark.parametrize(
    ("changes", "uses_kernel"),
    [
        ({}, True),
        ({"with_bias": True, "leading": (3,)}, True),
        ({"leading": ()}, True),
        ({"with_offset": True}, False),  # the kernel has no offset
        ({"group_size": 32}, False),  # nor groups
        ({"dtype": torch.float32}, False),  # its fp32/fp16 paths are slower than dequantizing
        ({"dtype": torch.float16}, False),
        ({"in_features": 40}, False),  # K must be a multiple of 32 (module docstring)
        ({"bits": 4}, False),
    ],
)
def test_cpu_int8_kernel_runs_where_it_applies(changes, uses_kernel, monkeypatch) -> None:
    settings = {"dtype": torch.bfloat16, "in_features": 256, **changes}
    case = _case(settings.pop("bits", 8), settings.pop("group_size", 0), **settings)
    kernel = _CountingInt8PackMm(monkeypatch)
    args, _ = case.op_args()
    with using_backend("cpu"):
        out = ops.weight_quant_matmul(*args)
    assert kernel.calls == uses_kernel
    assert_close_to_naive(out, case.expected(), case.dtype)


def test_cpu_int8_kernel_serves_the_forward_and_dequantizing_the_backward(monkeypatch) -> None:
    """The kernel has no derivative: backward recomputes through dequantize-and-matmul."""
    case = _case(8, 0, torch.bfloat16, in_features=256, with_bias=True)
    kernel = _CountingInt8PackMm(monkeypatch)
    (x, weight, scale, offset, bias, group_size), _ = case.op_args()
    leaf = x.detach().requires_grad_(True)
    weights = torch.randn((2, 3, 7), generator=torch.Generator().manual_seed(5))
    with using_backend("cpu"):
        out = ops.weight_quant_matmul(leaf, weight, scale, offset, bias, group_size)
        (out.double() * weights).sum().backward()
    assert kernel.calls == 1
    naive_x = x.double().requires_grad_(True)
    (case.naive(naive_x, weight, scale.double(), None, bias.double(), 0) * weights).sum().backward()
    assert_close_to_naive(leaf.grad, naive_x.grad, torch.bfloat16)


@pytest.mark.parametrize(("bits", "group_size"), [(8, 0), (8, 32), (4, 64), (4, 0)])
@pytest.mark.parametrize("backend", ["cpu", "mock"])
def test_gradcheck_on_x_in_float64(bits, group_size, backend, request) -> None:
    case = _case(
        bits,
        group_size,
        torch.float64,
        with_offset=True,
        with_bias=True,
        leading=(2,),
        in_features=70,
        out_features=3,
    )
    (x, weight, scale, offset, bias, _), _ = case.op_args()
    if backend == "mock":
        request.getfixturevalue("mock_npu")
    leaf = x.detach().requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda t: ops.weight_quant_matmul(t, weight, scale, offset, bias, group_size), (leaf,)
    )


def test_gradient_of_x_matches_the_naive_formula_through_a_float_scale() -> None:
    case = _case(4, 32, torch.float32, with_offset=True, with_bias=True, leading=(2, 2))
    (x, weight, scale, offset, bias, group_size), _ = case.op_args()
    leaf = x.detach().requires_grad_(True)
    scale_leaf = scale.detach().requires_grad_(True)
    out = ops.weight_quant_matmul(leaf, weight, scale_leaf, offset, bias, group_size)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    (out * weights).sum().backward()
    naive_x = x.double().requires_grad_(True)
    naive_scale = scale.double().requires_grad_(True)
    expected = case.naive(naive_x, weight, naive_scale, offset.double(), bias.double(), 32)
    (expected * weights.double()).sum().backward()
    torch.testing.assert_close(leaf.grad.double(), naive_x.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(scale_leaf.grad.double(), naive_scale.grad, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize(("bits", "group_size"), [(8, 0), (8, 96), (4, 32), (4, 256)])
def test_dequantize_weight_is_the_formula(bits, group_size) -> None:
    case = _case(bits, group_size, with_offset=True, in_features=301, scale_dtype=torch.float64)
    (_, weight, scale, offset, _, _), _ = case.op_args()
    dense = ops.dequantize_weight(weight, scale, offset, group_size, 301, torch.float64)
    eye = torch.eye(301, dtype=torch.float64)  # x = I: the naive formula gives W^T
    expected = case.naive(eye, weight, scale, offset, None, group_size).t()
    torch.testing.assert_close(dense, expected, atol=1e-12, rtol=1e-12)
    assert ops.dequantize_weight(weight, scale, None, group_size, 301).dtype == torch.float32


def _int32_weight() -> tuple[torch.Tensor, ...]:
    case = _case(4, 32, torch.bfloat16, in_features=64)
    (x, _, scale, _, _, _), _ = case.op_args()
    return x, torch.zeros(7, 8, dtype=torch.int32), scale


def test_int32_weight_on_the_reference_path_is_refused() -> None:
    x, weight, scale = _int32_weight()
    message = (
        "weight: expected int8 (N, K) or uint8 (N, ceil(K/2)) off the NPU kernel: int32 "
        "NPU-prepacked weights (prepack_int4_for_npu) only run on the NPU kernel, forward only; "
        "pass the uint8 layout instead, got int32 of shape (7, 8) with backend 'cpu'"
    )
    with using_backend("cpu"), pytest.raises(ValueError, match=re.escape(message)):
        ops.weight_quant_matmul(x, weight, scale, group_size=32)
    with pytest.raises(ValueError, match=re.escape("weight: expected int8 (N, K) or uint8")):
        ops.dequantize_weight(weight, scale, None, 32, 64)


def test_int32_weight_is_forward_only_on_the_npu_path(mock_npu) -> None:
    x, weight, scale = on_device(_int32_weight(), {}, mock_npu.device)[0]
    leaf = x.detach().requires_grad_(True)
    out = ops.weight_quant_matmul(leaf, weight, scale, group_size=32)
    with pytest.raises(ValueError, match=re.escape("only run on the NPU kernel, forward only")):
        out.float().sum().backward()
    with pytest.raises(ValueError, match=re.escape("x: expected float16 or bfloat16")):
        ops.weight_quant_matmul(x.float(), weight, scale, group_size=32)


def test_prepack_rejects_k_not_a_multiple_of_8_and_backends_without_the_kernel() -> None:
    packed = torch.zeros(3, 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match=re.escape("in_features: expected a positive multiple")):
        ops.prepack_int4_for_npu(packed, 15)
    with using_backend("cpu"), pytest.raises(RuntimeError, match="keep the uint8 layout"):
        ops.prepack_int4_for_npu(packed, 16)


def test_compile_fullgraph_with_int4_groups_and_bf16_matches_eager() -> None:
    case = _case(4, 64, torch.bfloat16, with_offset=True, with_bias=True, in_features=200)
    args, _ = case.op_args()
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda *a: ops.weight_quant_matmul(*a) * 2, fullgraph=True, backend="aot_eager"
    )
    torch.testing.assert_close(compiled(*args), ops.weight_quant_matmul(*args) * 2)


def test_float64_inputs_match_the_formula_exactly() -> None:
    case = _case(8, 32, torch.float64, with_offset=True, with_bias=True)
    args, _ = case.op_args()
    expected = case.naive(*as_float64(args))
    assert_close_to_naive(ops.weight_quant_matmul(*args), expected, torch.float64)
