"""transformers' common model tests over ascend_vlm's tiny models, for a checkout that lacks a
family's ``tests/models/<family>/test_modeling_<family>.py`` (the PyPI sdist ships only
``tests/*.py``).

``family_test_case(model_type, *mixins)`` returns a ``unittest.TestCase`` class that mixes
transformers' ``ModelTesterMixin`` (and ``GenerationTesterMixin``) with a model tester built from
``ascend_vlm.models.tiny``: the tiny config of that family and one image of inputs, labels
included. ``scripts/run_transformers_tests.py`` writes a one-line test module per missing family.
"""

from __future__ import annotations

import functools
import types
import unittest

import torch

from ascend_vlm.models import tiny
from ascend_vlm.testing.transformers_suite import models_built_stock

# ascend_vlm model_type -> ascend_vlm.models.tiny family name, where they differ
TINY_FAMILY = {"llava": "llava_clip"}


def tiny_family(model_type: str) -> tiny.TinyFamily:
    name = TINY_FAMILY.get(model_type, model_type)
    if name not in tiny.FAMILIES:
        raise ValueError(
            f"model_type: expected one of {sorted(set(tiny.FAMILIES) | set(TINY_FAMILY))}, "
            f"got {model_type!r}"
        )
    return tiny.FAMILIES[name]


@functools.cache
def _inputs(model_type: str) -> dict[str, torch.Tensor]:
    """One row of text with one image; sizing the image tokens may need a (stock) model."""
    family = tiny_family(model_type)
    with models_built_stock():
        model = tiny.build_model(family.name)
    inputs = tiny.make_inputs(family.name, model, n_images=1)
    labels = inputs["input_ids"].clone()
    labels[labels == tiny.IMAGE_TOKEN] = -100
    return {**inputs, "labels": labels}


class TinyModelTester:
    """The ``model_tester`` transformers' mixins read: config, inputs and the sizes they check."""

    def __init__(self, parent: unittest.TestCase, model_type: str) -> None:
        self.parent = parent
        self.model_type = model_type
        self.family = tiny_family(model_type)
        text = self.get_config().get_text_config()
        self.batch_size = 1
        self.is_training = True
        self.num_hidden_layers = text.num_hidden_layers
        self.num_attention_heads = text.num_attention_heads
        self.hidden_size = text.hidden_size
        self.vocab_size = text.vocab_size
        self.image_token_id = tiny.IMAGE_TOKEN
        self.pad_token_id = tiny.PAD

    def get_config(self):
        return self.family.config(tiny.TINY)

    @property
    def seq_length(self) -> int:
        return _inputs(self.model_type)["input_ids"].shape[1]

    def prepare_config_and_inputs_for_common(self):
        inputs = {name: value.clone() for name, value in _inputs(self.model_type).items()}
        return self.get_config(), inputs


def family_test_case(model_type: str, *mixins: type) -> type:
    """A TestCase class running `mixins` (transformers' tester mixins) on the tiny `model_type`."""
    import transformers
    from transformers.models.auto import modeling_auto

    family = tiny_family(model_type)
    generative = getattr(transformers, family.model_class)
    # The base model class; Llama 4's is its generation model itself (no Llama4Model).
    base = getattr(transformers, modeling_auto.MODEL_MAPPING_NAMES[model_type])

    def set_up(self) -> None:
        self.model_tester = TinyModelTester(self, model_type)

    camel = "".join(part.capitalize() for part in model_type.split("_"))
    return types.new_class(
        f"Tiny{camel}ModelTest",
        (*mixins, unittest.TestCase),
        exec_body=lambda ns: ns.update(
            all_model_classes=tuple(dict.fromkeys((generative, base))),
            all_generative_model_classes=(generative,),
            _is_composite=True,
            setUp=set_up,
        ),
    )
