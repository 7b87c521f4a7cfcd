"""The features Llama 4's descriptor supports, run on the patched tiny Llama 4 (its generation
model holds the tower and language model itself): tracing here, adapters in
tests/adapters/test_llama4_adapters.py, quantization in tests/quantization/
test_quantize_model.py. The refused ones say why."""

from __future__ import annotations

import re

import pytest
import torch

import ascend_vlm
from ascend_vlm.models import REGISTRY, require_feature
from ascend_vlm.models.descriptor import Refused
from ascend_vlm.models.tiny import build_model, make_inputs
from ascend_vlm.observability import trace

pytestmark = pytest.mark.usefixtures("single_threaded_torch")


@pytest.fixture(scope="module")
def patched():
    model = build_model("llama4", attn_implementation="sdpa")
    ascend_vlm.patch(model)
    return model


def _logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


def test_tracing_times_every_stage_and_changes_no_output(patched) -> None:
    inputs = make_inputs("llama4", patched, n_images=1)
    expected = _logits(patched, inputs)
    with torch.no_grad(), trace(patched) as timeline:
        patched.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        traced = patched(**inputs).logits
    labels = [span.label for span in timeline.stages_of(0)]
    assert labels == ["vision_encode", "projector", "prefill", "decode 1", "decode 2", "decode 3"]
    assert torch.equal(traced, expected) and torch.equal(_logits(patched, inputs), expected)


@pytest.mark.parametrize(
    "feature",
    [f for f, a in REGISTRY["llama4"].features.answers().items() if isinstance(a, Refused)],
)
def test_refused_features_name_their_reason(patched, feature) -> None:
    reason = getattr(REGISTRY["llama4"].features, feature).reason
    with pytest.raises(ValueError, match=f"got 'llama4': {re.escape(reason)}$"):
        require_feature(patched, feature)
