"""Every registered model_type answers every feature, gives a reason for each refusal, and
declares attribute paths that resolve on its tiny model."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from ascend_vlm import models
from ascend_vlm.models import REGISTRY, descriptor_for, model_types_supporting, require_feature
from ascend_vlm.models.descriptor import (
    FEATURE_LABELS,
    FEATURES,
    POSITION_SCHEMES,
    SUPPORTED,
    FamilyDescriptor,
    FeatureSupport,
    Refused,
    Supported,
    attribute_at,
)
from ascend_vlm.models.tiny import FAMILIES, build_model

# A tiny model of every registered model_type (the first tiny family of that type).
TINY_OF_TYPE = {}
for _name, _family in FAMILIES.items():
    TINY_OF_TYPE.setdefault(_family.config().model_type, _name)


def test_every_registered_model_type_has_a_tiny_model():
    assert set(TINY_OF_TYPE) == set(REGISTRY)


def test_the_feature_vocabulary_is_the_support_fields():
    assert tuple(field.name for field in dataclasses.fields(FeatureSupport)) == FEATURES
    assert set(FEATURE_LABELS) == set(FEATURES)
    assert all(FEATURE_LABELS.values())


@pytest.mark.parametrize("model_type", list(REGISTRY))
def test_descriptor_answers_every_feature(model_type):
    descriptor = REGISTRY[model_type]
    assert isinstance(descriptor, FamilyDescriptor)
    answers = descriptor.features.answers()
    assert list(answers) == list(FEATURES)
    for feature, answer in answers.items():
        assert isinstance(answer, (Supported, Refused)), feature
        if isinstance(answer, Refused):
            assert answer.reason.strip(), feature
    assert descriptor.position_scheme in POSITION_SCHEMES


def test_an_unanswered_feature_fails_to_build():
    answered = {feature: SUPPORTED for feature in FEATURES[1:]}
    with pytest.raises(TypeError, match=FEATURES[0]):
        FeatureSupport(**answered)


def test_a_feature_added_to_the_vocabulary_fails_every_family_that_does_not_answer_it():
    extended = dataclasses.make_dataclass(
        "ExtendedSupport",
        [("new_feature", object, dataclasses.field(metadata={"label": "a new feature"}))],
        bases=(FeatureSupport,),
        frozen=True,
    )
    for descriptor in REGISTRY.values():
        with pytest.raises(TypeError, match="new_feature"):
            extended(**descriptor.features.answers())


def test_a_refusal_without_a_reason_fails_to_build():
    with pytest.raises(ValueError, match=r"^reason: expected a non-empty sentence, got '  '"):
        Refused("  ")


def test_an_answer_that_is_neither_supported_nor_refused_fails_to_build():
    answers = {feature: SUPPORTED for feature in FEATURES}
    answers[FEATURES[-1]] = "no"
    with pytest.raises(TypeError, match=rf"^{FEATURES[-1]}: expected SUPPORTED or Refused"):
        FeatureSupport(**answers)


@pytest.mark.parametrize("model_type", list(REGISTRY))
def test_attribute_paths_resolve_on_the_tiny_model(model_type):
    model = build_model(TINY_OF_TYPE[model_type])
    descriptor = descriptor_for(model.config)
    layout = descriptor.layout
    multimodal = layout.multimodal_model(model)
    assert isinstance(multimodal, nn.Module)
    for path in (layout.vision_tower, layout.projector, layout.language_model):
        assert isinstance(attribute_at(multimodal, path), nn.Module), path
    assert isinstance(attribute_at(multimodal, layout.decoder_layers), nn.ModuleList)
    for name in layout.encoder_modules:
        assert isinstance(getattr(multimodal, name), nn.Module), name
    assert any(isinstance(attribute_at(model, path), nn.Module) for path in layout.tower_paths())
    for attribute in descriptor.visual_token_ids:
        assert isinstance(getattr(model.config, attribute), int), attribute
    for encoder in descriptor.encoders:
        assert callable(getattr(multimodal, encoder.method)), encoder.method
    if descriptor.position_scheme != "rope":
        assert callable(getattr(multimodal, "get_rope_index", None))
    deepstack = descriptor.deepstack_layers(model.config)
    assert (deepstack > 0) == (descriptor.deepstack is not None)
    assert models.spec_for(model.config) == descriptor.patch(model.config)


def test_require_feature_names_the_reason_or_the_unknown_family():
    with pytest.raises(
        ValueError,
        match=r"^model: token pruning supports model_type qwen2_vl, .*, got 'gemma3': its image "
        r"tokens attend",
    ):
        require_feature(build_model("gemma3"), "token_pruning")
    config = torch.nn.Module()
    config.model_type = "llama"
    with pytest.raises(
        ValueError, match=r"^config: BatchGenerator supports .*, got 'llama' from Module, which"
    ):
        require_feature(config, "batching", argument="config")
    with pytest.raises(ValueError, match=r"^feature: expected one of token_pruning, .*got 'nope'"):
        require_feature(build_model("gemma3"), "nope")
    qwen = build_model("qwen2_vl")
    assert require_feature(qwen, "vision_cache") is REGISTRY["qwen2_vl"]
    supporting = model_types_supporting("vision_cache")
    assert {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava"} <= set(supporting)
    assert "idefics3" not in supporting and "llava_next" not in supporting
    assert list(supporting) == [t for t in REGISTRY if t in supporting]  # registry order
