"""QuantLinear: its output is the float64 math of its quantized weight, it holds no float
weight, casts with the model, converts 4-bit weights for the NPU kernel once, and takes a PEFT
LoRA adapter whose gradients flow while the base stays frozen."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ascend_vlm.quantization.quant_linear import QuantLinear
from ascend_vlm.quantization.rtn import quantize_rtn


def _layer(bits: int, group_size: int, symmetric: bool, bias: bool = True, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    linear = nn.Linear(200, 24, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(24, 200, generator=generator))
        if bias:
            linear.bias.copy_(torch.randn(24, generator=generator))
    quantized = quantize_rtn(linear.weight, bits, group_size, symmetric=symmetric)
    return QuantLinear.from_quantized(quantized, linear.bias), quantized


@pytest.mark.parametrize(("bits", "group_size"), [(8, 0), (8, 64), (4, 32), (4, 128)])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_forward_is_the_float64_math_of_the_quantized_weight(bits, group_size, symmetric, bias):
    layer, quantized = _layer(bits, group_size, symmetric, bias)
    x = torch.randn(3, 5, 200)
    expected = x.double() @ quantized.dequantize(torch.float64).t()
    if bias:
        expected = expected + layer.bias.double()
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-4)


def test_the_module_holds_buffers_not_a_float_weight():
    layer, quantized = _layer(4, 32, symmetric=False)
    assert set(layer.state_dict()) == {"qweight", "scale", "offset", "bias"}
    assert layer.qweight is quantized.qweight  # from_quantized shares, not copies
    assert layer.weight.shape == (0,) and layer.weight.dtype == quantized.scale.dtype
    assert not any(p.requires_grad for p in layer.parameters())
    assert isinstance(layer, nn.Linear)
    assert "bits=4, group_size=32, asymmetric, bias=True" in repr(layer)
    torch.testing.assert_close(layer.dequantize(), quantized.dequantize())


def test_casting_the_module_casts_scales_and_bias_not_integers():
    layer, _ = _layer(8, 0, symmetric=True)
    layer = layer.to(torch.bfloat16)
    assert layer.scale.dtype == layer.bias.dtype == layer.weight.dtype == torch.bfloat16
    assert layer.qweight.dtype == torch.int8
    assert layer(torch.randn(2, 200, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_int4_weights_are_converted_for_the_npu_kernel_once(mock_npu, monkeypatch):
    import ascend_vlm.quantization.quant_linear as quant_linear

    layer, quantized = _layer(4, 128, symmetric=False, seed=1)
    layer = layer.to(torch.float16)
    calls = []
    prepack = quant_linear.prepack_int4_for_npu
    monkeypatch.setattr(
        quant_linear, "prepack_int4_for_npu", lambda *args: calls.append(1) or prepack(*args)
    )
    x = torch.randn(4, 200, dtype=torch.float16)
    first = layer(x)
    second = layer(x)
    assert len(calls) == 1 and torch.equal(first, second)
    expected = x.double() @ quantized.dequantize(torch.float64).t() + layer.bias.double()
    torch.testing.assert_close(first.double(), expected, rtol=1e-2, atol=5e-2)
    with torch.no_grad():
        layer.qweight.copy_(torch.zeros_like(layer.qweight))  # an in-place write re-converts
    layer(x)
    assert len(calls) == 2
    layer.to(torch.bfloat16)  # new buffers: converted again on the next call
    assert layer._npu_weight is None
    layer(x.to(torch.bfloat16))
    assert len(calls) == 3
    x.requires_grad_(True)  # the packing is forward only: a training call dequantizes
    layer.to(torch.float16)(x).sum().backward()
    assert len(calls) == 3 and x.grad is not None


def test_a_lora_adapter_trains_on_top_of_the_frozen_quantized_base():
    from peft import LoraConfig, get_peft_model

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj, _ = _layer(4, 32, symmetric=False)

        def forward(self, x):
            return self.proj(x)

    block = Block()
    base_output = block(torch.ones(2, 200))
    model = get_peft_model(block, LoraConfig(r=4, target_modules=["proj"], lora_dropout=0.0))
    x = torch.randn(2, 200)
    torch.testing.assert_close(model(torch.ones(2, 200)), base_output)  # B starts at zero
    model(x).sum().backward()
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    assert all(p.grad is not None for name, p in model.named_parameters() if "lora_B" in name)
    with pytest.raises(RuntimeError, match=r"size of tensor a \(0\)"):  # no float weight to merge
        model.merge_and_unload()


@pytest.mark.parametrize("bits", [8, 4])
def test_the_layer_compiles_without_graph_breaks_on_the_cpu_path(bits):
    layer, _ = _layer(bits, 32, symmetric=bits == 8)
    x = torch.randn(2, 3, 200)
    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), layer(x))
