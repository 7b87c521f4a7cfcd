"""GLM's RoPE variants on the patched path: GLM-4V's M-RoPE on GPT-J pairs of a partial rotary
dimension (`text-interleaved`) and GLM-4.5V's (MoE) on NeoX halves, against transformers' own
functions and through whole models whose sharpened query/key weights make positions matter."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

import ascend_vlm
from ascend_vlm.models.tiny import build_model, make_inputs
from ascend_vlm.patching.adapters import rope_adapter, rope_forward

pytestmark = pytest.mark.usefixtures("single_threaded_torch")

# model_type -> (the adapter style its decoder needs, the class whose forward calls the function)
TEXT_ROPE = {
    "glm4v": ("text-interleaved", "Glm4vTextAttention"),
    "glm4v_moe": ("text", "Glm4vMoeTextAttention"),
}


def _modeling(model_type: str):
    return importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")


def _mrope_tables(model) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder's cos/sin [B=2, S=12, Dr] for distinct temporal, height and width positions."""
    generator = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 40, (3, 2, 12), generator=generator)
    hidden = torch.zeros(2, 12, model.config.text_config.hidden_size)
    return model.model.language_model.rotary_emb(hidden, positions)


@pytest.mark.parametrize("model_type", list(TEXT_ROPE))
def test_the_adapter_equals_transformers_function_and_the_other_layout_does_not(model_type):
    model = build_model(model_type)
    cos, sin = _mrope_tables(model)
    head_dim = model.model.language_model.layers[0].self_attn.head_dim
    assert cos.shape[-1] == head_dim // 2  # partial rotary: the rest passes through
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(2, 2, 12, head_dim, generator=generator)
    k = torch.randn(2, 1, 12, head_dim, generator=generator)
    expected = _modeling(model_type).apply_rotary_pos_emb(q, k, cos, sin)
    style, _ = TEXT_ROPE[model_type]
    other = "text" if style == "text-interleaved" else "text-interleaved"
    for got, reference in zip(rope_adapter(style)(q, k, cos, sin), expected, strict=True):
        torch.testing.assert_close(got, reference, atol=1e-5, rtol=0)
        assert torch.equal(got[..., head_dim // 2 :], reference[..., head_dim // 2 :])
    wrong = rope_adapter(other)(q, k, cos, sin)[0]
    assert (wrong - expected[0]).abs().max() > 1e-2


def _sharpened(model_type: str):
    """A tiny model whose text query/key weights are scaled up: attention is far from uniform,
    so a rotation of the wrong dims changes the logits."""
    model = build_model(model_type)
    with torch.no_grad():
        for layer in model.model.language_model.layers:
            layer.self_attn.q_proj.weight.mul_(6)
            layer.self_attn.k_proj.weight.mul_(6)
    return model


def _logits(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


# model_type -> the npu_rotary_mul modes its text and vision RoPE launch on the mock NPU
KERNEL_MODES = {
    "glm4v": {"interleave", "half"},
    "glm46v": {"interleave", "half"},
    "glm4v_moe": {"half"},
}


@pytest.mark.parametrize("path", ["cpu", "mock"])
@pytest.mark.parametrize("model_type", list(KERNEL_MODES))
def test_sharpened_models_match_stock_on_every_path(model_type, path, request, monkeypatch):
    model = _sharpened(model_type)
    device, modes = torch.device("cpu"), set()
    if path == "mock":
        mock_npu = request.getfixturevalue("mock_npu")
        device, kernel = mock_npu.device, mock_npu.torch_npu.npu_rotary_mul

        def recording(x, r1, r2, rotary_mode="half", **kwargs):
            modes.add(rotary_mode)
            return kernel(x, r1, r2, rotary_mode=rotary_mode, **kwargs)

        monkeypatch.setattr(mock_npu.torch_npu, "npu_rotary_mul", recording)
    model = model.to(device)
    inputs = {k: v.to(device) for k, v in make_inputs(model_type, model, n_images=2).items()}
    expected = _logits(model, inputs)
    ascend_vlm.patch(model)
    try:
        got = _logits(model, inputs)
    finally:
        ascend_vlm.unpatch(model)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert modes == (KERNEL_MODES[model_type] if path == "mock" else set())


@pytest.mark.parametrize("model_type", list(TEXT_ROPE))
def test_the_sharpened_logits_tell_the_pair_layouts_apart(model_type):
    # The check above can fail: rotating the other layout's dims moves these logits.
    model = _sharpened(model_type)
    inputs = make_inputs(model_type, model, n_images=1)
    expected = _logits(model, inputs)
    style, attention = TEXT_ROPE[model_type]
    other = "text" if style == "text-interleaved" else "text-interleaved"
    wrong = copy.deepcopy(model)
    for module in wrong.modules():
        if type(module).__name__ == attention:
            module.forward = rope_forward(module, "apply_rotary_pos_emb", other)
    assert (_logits(wrong, inputs) - expected).abs().max() > 1e-3
