"""`ascend_vlm.verify`'s contract beyond finding faults: bad input is a ValueError naming the
argument; a given reference is checked against the model's weights; the generic path and the
float64 reference work; captures reduce to statistics as they run."""

from __future__ import annotations

import json

import pytest
import torch
from generic_vlm import aya_inputs, aya_vision
from torch import nn

import ascend_vlm
from ascend_vlm.models.tiny import build_model, make_inputs
from ascend_vlm.quantization.config import QuantizationConfig
from ascend_vlm.verification.capture_points import capture_points

pytestmark = pytest.mark.usefixtures("single_threaded_torch")


@pytest.fixture(scope="module")
def tiny() -> tuple[nn.Module, dict]:
    model = build_model("qwen2_vl")
    return model, make_inputs("qwen2_vl", model, n_images=1)


def test_inputs_without_images_are_refused(tiny) -> None:
    model, inputs = tiny
    text_only = {k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask")}
    with pytest.raises(ValueError, match=r"inputs: expected images \(pixel_values.*in input 1"):
        ascend_vlm.verify(model, [inputs, text_only])
    with pytest.raises(ValueError, match="inputs: expected a mapping of model inputs"):
        ascend_vlm.verify(model, [])


def test_a_model_the_reference_cannot_be_built_for_is_refused(tiny) -> None:
    _, inputs = tiny
    with pytest.raises(ValueError, match="model: expected a transformers PreTrainedModel"):
        ascend_vlm.verify(nn.Linear(2, 2), inputs)
    quantized = build_model("qwen2_vl")
    ascend_vlm.quantize(quantized, QuantizationConfig(), progress=False)
    with pytest.raises(ValueError, match=r"model: expected the weights of a stock .*qweight"):
        ascend_vlm.verify(quantized, inputs)


def test_a_reference_with_other_weights_is_refused(tiny) -> None:
    model, inputs = tiny
    with pytest.raises(ValueError, match=r"reference: expected the weights of model, got .* by"):
        ascend_vlm.verify(model, inputs, reference=build_model("qwen2_vl", seed=1))
    deeper = build_model("qwen2_vl", layers=3)
    with pytest.raises(ValueError, match=r"reference: expected .* unexpected .*layers\.2"):
        ascend_vlm.verify(model, inputs, reference=deeper)
    patched = build_model("qwen2_vl")
    ascend_vlm.patch(patched)
    with pytest.raises(ValueError, match="reference: expected a stock model, got one carrying"):
        ascend_vlm.verify(model, inputs, reference=patched)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"k": 0}, "k: expected a finite number > 0"),
        ({"slack": -1.0}, "slack: expected a finite number >= 0"),
        ({"reference_dtype": torch.bfloat16}, "reference_dtype: expected torch.float32"),
    ],
)
def test_bad_settings_are_refused(tiny, settings, message) -> None:
    model, inputs = tiny
    with pytest.raises(ValueError, match=message):
        ascend_vlm.verify(model, inputs, **settings)


def test_samples_without_a_processor_are_refused(tiny) -> None:
    model, inputs = tiny
    with pytest.raises(ValueError, match="samples: expected a processor"):
        ascend_vlm.verify(model, inputs, samples=[])


def test_a_model_in_training_mode_is_refused(tiny) -> None:
    model, inputs = tiny
    model.train()
    try:
        with pytest.raises(ValueError, match="model: expected eval mode"):
            ascend_vlm.verify(model, inputs)
    finally:
        model.eval()


def test_a_given_reference_in_float64_agrees_with_the_stock_model_in_float32(tiny) -> None:
    """The stock fp32 model against an fp64 reference with its weights: errors at fp32's
    rounding, the floor the same run, nothing flagged; the report serialises."""
    model, inputs = tiny
    reference = build_model("qwen2_vl")
    report = ascend_vlm.verify(model, inputs, reference=reference, reference_dtype=torch.float64)
    assert reference.dtype == torch.float64  # taken over, as documented
    assert report.first_flagged is None and report.reference_dtype == "float64"
    assert 0 < max(m.relative_l2 for m in report.modules) < 1e-5
    assert all(m.relative_l2 == m.floor_relative_l2 for m in report.modules)
    assert json.loads(json.dumps(report.as_dict()))["modules"][0]["depth"] == 0


def test_the_reference_captures_are_the_only_activations_kept(tiny, monkeypatch) -> None:
    """The floor's and the model's captures reduce to five sums each as they come."""
    from ascend_vlm.verification import verifier

    model, inputs = tiny
    sums = []
    original = verifier.error_sums

    def counting(test, reference):
        result = original(test, reference)
        sums.append(result.shape)
        return result

    monkeypatch.setattr(verifier, "error_sums", counting)
    report = ascend_vlm.verify(model, inputs)
    assert len(sums) == 2 * len(report.modules) and set(sums) == {torch.Size([5])}


@pytest.mark.mock_npu
def test_the_generic_path_is_verified_with_its_points_and_rope() -> None:
    model, inputs = aya_vision(), aya_inputs()
    kinds = {point.kind for point in capture_points(model)}
    assert kinds >= {"vision-block", "projector", "decoder-layer", "attention-vision", "rope"}
    model.to(torch.bfloat16)
    ascend_vlm.patch(model, strict=False)
    inputs["pixel_values"] = inputs["pixel_values"].to(torch.bfloat16)
    report = ascend_vlm.verify(model, inputs)
    assert report.first_flagged is None, str(report)
    assert report.model_type == "aya_vision" and not report.not_captured
    assert any(m.kind == "rope" for m in report.modules)


@pytest.mark.mock_npu
def test_a_flagged_rope_is_saved_as_its_rotary_function_and_replays_the_fault(tmp_path) -> None:
    from ascend_vlm.testing import faults
    from ascend_vlm.verification.replay import replay

    model = build_model("qwen2_vl")
    inputs = make_inputs("qwen2_vl", model, n_images=1)
    model.to(torch.bfloat16)
    ascend_vlm.patch(model)
    with faults.rope_sin_flipped():
        report = ascend_vlm.verify(model, inputs, replay_dir=tmp_path)
        faulty = replay(report.repro)
    assert report.first_flagged.name == "model.visual.blocks.0.attn.rope"
    assert report.repro == str(tmp_path / "model.visual.blocks.0.attn.rope.pt")
    assert faulty.target == "function _rope_vision" and faulty.kind == "rope"
    assert faulty.errors.rel_l2 > 100 * replay(report.repro).errors.rel_l2
