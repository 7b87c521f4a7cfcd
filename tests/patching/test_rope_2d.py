"""The 2-D RoPE variants of the vision towers (Pixtral's axial tables in Mistral 3,
PaddleOCR-VL's axial tables on its varlen path) and PaddleOCR-VL's M-RoPE decoder through
ops.rotary_embedding_pair: each rotary module's tables rotate q and k exactly as transformers
does, on a non-square image (a 4 x 2 patch grid, so height and width differ) and with sharpened
query/key weights, so that the positions decide the attention."""

from __future__ import annotations

import pytest
import torch

import ascend_vlm
from ascend_vlm.models.descriptor import attribute_at
from ascend_vlm.models.tiny import BOS, IMAGE_TOKEN, VISION_START, build_model

pytestmark = pytest.mark.usefixtures("single_threaded_torch")


def _mistral3_image() -> dict:
    # 16 x 8 pixels of a 16 x 16 canvas: 4 x 2 patches of 4 pixels, 2 tokens after the merge
    pixels = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    return {"pixel_values": pixels, "image_sizes": torch.tensor([[16, 8]])}


def _paddleocr_image() -> dict:
    # a 4 x 2 grid of 4-pixel patches ([patches, 3, 4, 4] rows), 2 tokens after the merge
    pixels = torch.randn(8, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    return {"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, 4, 2]])}


# family -> (its non-square image, the rotary modules whose tables the test checks)
FAMILIES = {
    "mistral3": (_mistral3_image, ("model.vision_tower.patch_positional_embedding",)),
    "paddleocr_vl": (
        _paddleocr_image,
        ("model.visual.vision_model.encoder.rotary_pos_emb", "model.language_model.rotary_emb"),
    ),
}
CASES = [(family, rotary) for family, (_, rotaries) in FAMILIES.items() for rotary in rotaries]


def _sharpened(family: str):
    """The tiny model of `family` with every query/key weight scaled up: attention is far
    from uniform, so a q or k rotated by the wrong position shows in the logits."""
    model = build_model(family)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith(("q_proj", "k_proj")):
                module.weight.mul_(40)
    return model


def _inputs(family: str, device: torch.device) -> dict:
    ids = torch.tensor([[BOS, VISION_START, IMAGE_TOKEN, IMAGE_TOKEN, 7, 8, 9, 10, 11, 12]])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), **FAMILIES[family][0]()}
    if "image_grid_thw" in inputs:
        inputs["mm_token_type_ids"] = (ids == IMAGE_TOKEN).int()
    return {name: value.to(device) for name, value in inputs.items()}


def _outputs(model, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(the image's vision features before the projector, the logits)."""
    image = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    image.pop("mm_token_type_ids", None)
    with torch.no_grad():
        features = model.model.get_image_features(**image).last_hidden_state
        return features, model(**inputs).logits


def _unrotated(module, inputs, output):
    cos, _ = output
    return torch.ones_like(cos), torch.zeros_like(cos)


@pytest.mark.parametrize("path", ["cpu", "mock"])
@pytest.mark.parametrize(("family", "rotary"), CASES, ids=[f"{f}-{r}" for f, r in CASES])
def test_2d_rope_matches_stock_and_its_positions_matter(family, rotary, path, request) -> None:
    device = torch.device("cpu")
    if path == "mock":
        device = request.getfixturevalue("mock_npu").device
    model = _sharpened(family).to(device)
    inputs = _inputs(family, device)
    expected = _outputs(model, inputs)
    handle = attribute_at(model, rotary).register_forward_hook(_unrotated)
    try:
        without_positions = _outputs(model, inputs)
    finally:
        handle.remove()
    # these positions decide the features (a vision rotary) or the logits (a text one)
    observed = 0 if "vision" in rotary or "visual" in rotary else 1
    assert (without_positions[observed] - expected[observed]).abs().max() > 1e-2
    report = ascend_vlm.patch(model)
    try:
        assert report.swapped_count("rope") == 4
        got = _outputs(model, inputs)
    finally:
        ascend_vlm.unpatch(model)
    for produced, reference in zip(got, expected, strict=True):
        torch.testing.assert_close(produced, reference, atol=1e-5, rtol=1e-5)
