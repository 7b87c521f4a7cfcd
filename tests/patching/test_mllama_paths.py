"""Llama 3.2 Vision's cross-attention, patched: with sharpened query/key weights (self- and
cross-attention, so positions and image tiles matter) and open cross-attention gates the logits
equal stock, and the cross-attention mask (which text tokens see which image) reaches the fused
op."""

from __future__ import annotations

import pytest
import torch

import ascend_vlm
from ascend_vlm.models.tiny import build_model, make_inputs

pytestmark = pytest.mark.usefixtures("single_threaded_torch")


def _sharpened(attn_implementation: str):
    """The tiny mllama with sharpened text query/key weights and its cross-attention gates
    opened (initialised to 0, they hide the cross-attention output from the logits)."""
    model = build_model("mllama", attn_implementation=attn_implementation)
    with torch.no_grad():
        for layer in model.model.language_model.layers:
            attention = getattr(layer, "self_attn", None) or layer.cross_attn
            attention.q_proj.weight.mul_(4)
            attention.k_proj.weight.mul_(4)
            for gate in ("cross_attn_attn_gate", "cross_attn_mlp_gate"):
                if hasattr(layer, gate):
                    getattr(layer, gate).fill_(1.0)
    return model


def _logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


@pytest.mark.parametrize("path", ["cpu", "mock"])
@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_cross_attention_over_several_images_matches_stock(attn_implementation, path, request):
    model = _sharpened(attn_implementation)
    if path == "mock":
        model = model.to(request.getfixturevalue("mock_npu").device)
    inputs = make_inputs("mllama", model, n_images=2)
    stock = _logits(model, inputs)
    ascend_vlm.patch(model)
    try:
        patched = _logits(model, inputs)
    finally:
        ascend_vlm.unpatch(model)
    torch.testing.assert_close(patched, stock, atol=1e-5, rtol=1e-5)
    # ... and the mask matters: letting every token see both images moves the logits.
    unmasked = {**inputs, "cross_attention_mask": torch.ones_like(inputs["cross_attention_mask"])}
    assert (_logits(model, unmasked) - stock).abs().max() > 1e-3
