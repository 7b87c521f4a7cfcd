"""Qwen3.5's and Qwen3.5-MoE's answers to the features: tracing, which no other test runs on
them, works patched (adapters: tests/adapters/test_qwen3_5_adapters.py); the refused features
refuse with their reason."""

from __future__ import annotations

import copy

import pytest
import torch

import ascend_vlm
from ascend_vlm.models import descriptor_for, require_feature
from ascend_vlm.models.descriptor import Refused
from ascend_vlm.models.tiny import build_model, make_inputs

pytestmark = pytest.mark.usefixtures("single_threaded_torch")


FAMILIES = ("qwen3_5", "qwen3_5_moe")


@pytest.fixture(scope="module", params=FAMILIES)
def base(request):
    return build_model(request.param)


def test_tracing_a_patched_generate_names_every_stage(base):
    from ascend_vlm.observability import trace

    model = copy.deepcopy(base)
    ascend_vlm.patch(model)
    inputs = make_inputs(model.config.model_type, model, n_images=1)
    with torch.no_grad(), trace(model) as timeline:
        model.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    stages = [span.label for span in timeline.stages_of(0)]
    assert stages == ["vision_encode", "projector", "prefill", "decode 1", "decode 2", "decode 3"]


REFUSED = ("token_pruning", "kv_compression", "chat_sessions", "batching", "attention_overlay")


@pytest.mark.parametrize("feature", REFUSED)
def test_a_refused_feature_names_its_reason(base, feature):
    check_refusal(base, feature)


def check_refusal(base, feature: str) -> None:
    """`feature` is Refused for `base`'s family and require_feature raises with its reason."""
    answer = getattr(descriptor_for(base.config).features, feature)
    assert isinstance(answer, Refused)
    with pytest.raises(ValueError, match=f"got '{base.config.model_type}': ") as raised:
        require_feature(base, feature)
    assert answer.reason in str(raised.value)


def test_the_cache_a_chat_session_would_crop_cannot_be_cropped(base):
    """Why chat sessions are refused: transformers will not crop a Gated DeltaNet layer."""
    with torch.no_grad():
        cache = base(**make_inputs(base.config.model_type, base), use_cache=True).past_key_values
    with pytest.raises(RuntimeError, match="crop"):
        cache.crop(cache.get_seq_length() - 2)
