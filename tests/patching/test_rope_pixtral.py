"""Pixtral's 2-D RoPE (Mistral 3's vision tower) through ops.rotary_embedding_pair: its axial
tables ([patches, head_dim], height frequencies then width ones) rotate q and k exactly as
transformers does, on a non-square image and with sharpened query/key weights so that the
positions decide the attention."""

from __future__ import annotations

import pytest
import torch

import ascend_vlm
from ascend_vlm.models.tiny import build_model

pytestmark = pytest.mark.usefixtures("single_threaded_torch")


def _sharpened_mistral3():
    """A tiny Mistral 3 whose vision query/key weights are scaled up: attention is far from
    uniform, so a patch rotated by the wrong position shows in the features."""
    model = build_model("mistral3")
    with torch.no_grad():
        for layer in model.model.vision_tower.transformer.layers:
            layer.attention.q_proj.weight.mul_(40)
            layer.attention.k_proj.weight.mul_(40)
    return model


def _features(model, device: torch.device) -> torch.Tensor:
    # 16 x 8 pixels of a 16 x 16 canvas: a 4 x 2 patch grid, so height and width differ
    pixels = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(0)).to(device)
    sizes = torch.tensor([[16, 8]], device=device)
    with torch.no_grad():
        return model.model.get_image_features(pixels, image_sizes=sizes).last_hidden_state


def _unrotated(module, inputs, output):
    cos, _ = output
    return torch.ones_like(cos), torch.zeros_like(cos)


@pytest.mark.parametrize("path", ["cpu", "mock"])
def test_pixtral_2d_rope_matches_stock_and_positions_matter(path, request) -> None:
    device = torch.device("cpu")
    if path == "mock":
        device = request.getfixturevalue("mock_npu").device
    model = _sharpened_mistral3().to(device)
    expected = _features(model, device)
    rotary = model.model.vision_tower.patch_positional_embedding
    handle = rotary.register_forward_hook(_unrotated)
    try:
        without_positions = _features(model, device)
    finally:
        handle.remove()
    assert (without_positions - expected).abs().max() > 1e-2  # the positions decide the output
    report = ascend_vlm.patch(model)
    try:
        assert (
            report.swapped[
                ("rope", "PixtralAttention", "ops.rotary_embedding_pair (via apply_rotary_pos_emb)")
            ]
            == 2
        )
        got = _features(model, device)
    finally:
        ascend_vlm.unpatch(model)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
