"""The features the Llama 4 and Llama 3.2 Vision descriptors support, run on their patched tiny
models (Llama 4's generation model holds the tower and language model itself): tracing here,
adapters in tests/adapters/test_llama_adapters.py, quantization in
tests/quantization/test_quantize_model.py. The refused ones say why."""

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


FAMILIES = ("llama4", "mllama")


@pytest.fixture(scope="module")
def patched():
    """family name -> its tiny model, patched (built on first use, shared by the module)."""
    cache: dict[str, torch.nn.Module] = {}

    def get(family: str) -> torch.nn.Module:
        if family not in cache:
            cache[family] = build_model(family, attn_implementation="sdpa")
            ascend_vlm.patch(cache[family])
        return cache[family]

    return get


def _logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_tracing_times_every_stage_and_changes_no_output(patched, family) -> None:
    patched = patched(family)
    inputs = make_inputs(family, patched, n_images=1)
    expected = _logits(patched, inputs)
    with torch.no_grad(), trace(patched) as timeline:
        patched.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        traced = patched(**inputs).logits
    labels = [span.label for span in timeline.stages_of(0)]
    assert labels == ["vision_encode", "projector", "prefill", "decode 1", "decode 2", "decode 3"]
    assert torch.equal(traced, expected) and torch.equal(_logits(patched, inputs), expected)


REFUSED = [
    (family, feature)
    for family in FAMILIES
    for feature, answer in REGISTRY[family].features.answers().items()
    if isinstance(answer, Refused)
]


@pytest.mark.parametrize(("family", "feature"), REFUSED)
def test_refused_features_name_their_reason(patched, family, feature) -> None:
    reason = getattr(REGISTRY[family].features, feature).reason
    with pytest.raises(ValueError, match=f"got '{family}': {re.escape(reason)}$"):
        require_feature(patched(family), feature)
