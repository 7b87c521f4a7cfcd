"""`apply_to_instance`: the flags reach `patch`'s options, the report is patch's, and flags patch
cannot honour apart are refused by name."""

from __future__ import annotations

import pytest
import torch

import ascend_vlm
from ascend_vlm.integrations import apply_to_instance
from ascend_vlm.models.tiny import build_model, make_inputs


def _logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


def test_defaults_patch_every_kind_and_match_eager():
    model = build_model("qwen3_vl_moe")
    inputs = make_inputs("qwen3_vl_moe", model, n_images=1)
    expected = _logits(model, inputs)
    report = apply_to_instance(model)
    try:
        assert report is ascend_vlm.patch(model)  # the same options: patch's current report
        for kind in ("attention-text", "attention-vision", "norm", "rope", "mlp", "moe"):
            assert report.swapped_count(kind) > 0, kind
        torch.testing.assert_close(_logits(model, inputs), expected, atol=1e-4, rtol=0)
    finally:
        ascend_vlm.unpatch(model)


def test_flags_turn_kinds_off():
    model = build_model("qwen3_5_moe")
    report = apply_to_instance(model, norm=False, mlp=False, moe=False, rope=False)
    try:
        for kind in ("norm", "mlp", "moe", "rope"):
            assert report.swapped_count(kind) == 0 and report.left_alone_count(kind) > 0, kind
        assert report.swapped_count("linear-attention") > 0
        assert report.swapped_count("attention-text") > 0
    finally:
        ascend_vlm.unpatch(model)
    report = apply_to_instance(model, attention=False, linear_attention=False, vision=False)
    try:
        assert report.swapped_count("attention-text") == 0
        assert report.swapped_count("linear-attention") == 0
        assert report.swapped_count("attention-vision") == 0
        assert report.swapped_count("norm") > 0
    finally:
        ascend_vlm.unpatch(model)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"moe": False}, r"moe: ascend_vlm.patch switches it with mlp, .* got moe=False"),
        ({"attention": False}, r"linear_attention: .* expected linear_attention=attention=False"),
        ({"moe": 1}, r"moe: expected True or False, got 1"),
    ],
)
def test_flags_patch_cannot_honour_apart_are_refused(flags, message):
    model = build_model("qwen2_vl")
    error = TypeError if flags.get("moe") == 1 else ValueError
    with pytest.raises(error, match=message):
        apply_to_instance(model, **flags)
    assert not ascend_vlm.patching.is_patched(model)
